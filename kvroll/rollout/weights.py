"""Weight movement, written once for every transport: the bucket plan, packing, checksums, ZeRO-3 gathering.

    plan = BucketPlan.for_model(model, dtype=torch.bfloat16, bucket_bytes=1 << 30)   # names/shapes/dtypes, once
    buffer = plan.new_buffer(0, device)                      # [bucket bytes] uint8
    with plan.fetch(model, 0) as tensors:                    # a collective per bucket under ZeRO-3
        plan.pack(0, tensors, buffer)
    digest = bucket_checksum(buffer)                         # on the buffer's device; the receiver computes it too
    plan.unpack(0, buffer, dict(engine_model.named_parameters()) | dict(engine_model.named_buffers()))

Parameters and buffers (rotary ``inv_freq``: a worker built on the meta device has none of its own) travel as raw
bytes in flat ``uint8`` buckets of about ``bucket_bytes``; floating parameters are cast to the engine's dtype when
packed, buffers keep theirs. Every tensor starts at a 16-byte offset so each slice can be viewed as its dtype. The
same plan serves the NCCL/gloo broadcast, the Ray object-store refresh of a restarted worker and the colocated
engine, so a checksum computed by the trainer equals the one a worker computes over the same weights. The tensors
are the model's ``named_sources`` (sources.py): a PEFT LoRA model is planned, gathered and packed as its merged
weights under the base model's names.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from kvroll.checks import as_int
from kvroll.rollout.sources import Source, held_whole, named_sources

_ALIGN = 16


@dataclass(frozen=True)
class TensorSpec:
    """Where one named tensor lies in its bucket."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int  # bytes from the bucket's start
    nbytes: int


class BucketPlan:
    """The layout of a model's weights in buckets (see module doc). Picklable: it is sent to workers once."""

    def __init__(self, buckets: list[list[TensorSpec]], sizes: list[int]):
        self.buckets, self.sizes = buckets, sizes

    @classmethod
    def for_model(cls, model: nn.Module, dtype: torch.dtype | None = None,
                  bucket_bytes: int = 1 << 30) -> "BucketPlan":
        """Plan ``model``'s parameters (cast to ``dtype`` when floating) and buffers into ~``bucket_bytes`` buckets."""
        if not (as_int(bucket_bytes) is not None and bucket_bytes >= _ALIGN):
            raise ValueError(f"bucket_bytes={bucket_bytes!r} is invalid: use an integer >= {_ALIGN} (about 1 GB "
                             "is the default; smaller buckets overlap packing and sending more finely).")
        entries = []
        for name, source in named_sources(model):
            shape, src_dtype = _full_shape(source.tensor), param_dtype(source.tensor)
            entries.append((name, shape, dtype if dtype is not None and src_dtype.is_floating_point else src_dtype))
        for name, source in named_sources(model, "buffers"):
            entries.append((name, tuple(source.tensor.shape), source.tensor.dtype))
        buckets, sizes, current, size = [], [], [], 0
        for name, shape, tensor_dtype in entries:
            nbytes = _numel(shape) * tensor_dtype.itemsize
            if current and size + nbytes > bucket_bytes:
                buckets.append(current)
                sizes.append(_round_up(size, 8))
                current, size = [], 0
            current.append(TensorSpec(name, shape, tensor_dtype, size, nbytes))
            size = _round_up(size + nbytes, _ALIGN)
        if current:
            buckets.append(current)
            sizes.append(_round_up(size, 8))
        return cls(buckets, sizes)

    def __len__(self) -> int:
        return len(self.buckets)

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes)

    def names(self) -> list[str]:
        return [spec.name for bucket in self.buckets for spec in bucket]

    def new_buffer(self, index: int, device: torch.device | str) -> torch.Tensor:
        return torch.zeros(self.sizes[index], dtype=torch.uint8, device=device)  # [bucket bytes]

    def fetch(self, model: nn.Module, index: int):
        """A context giving bucket ``index``'s tensors by name (full ZeRO-3 parameters inside; collective).

        A merged LoRA weight is computed when it is read, so ranks that only take part in the gather skip the math.
        """
        return self.fetcher(model)(index)

    def fetcher(self, model: nn.Module) -> Callable[[int], "_Fetched"]:
        """``fetch`` for one pass over the buckets, walking the model's module tree once."""
        sources = dict(named_sources(model)) | dict(named_sources(model, "buffers"))
        return lambda index: _Fetched({spec.name: sources[spec.name] for spec in self.buckets[index]})

    @torch.no_grad()
    def pack(self, index: int, tensors: Mapping[str, torch.Tensor], buffer: torch.Tensor) -> torch.Tensor:
        """Copy bucket ``index``'s tensors (cast to their planned dtype) into ``buffer``; returns it."""
        for spec in self.buckets[index]:
            _view(buffer, spec).copy_(tensors[spec.name].detach().reshape(spec.shape))
        return buffer

    @torch.no_grad()
    def unpack(self, index: int, buffer: torch.Tensor, targets: dict[str, torch.Tensor]) -> None:
        """Copy bucket ``index`` from ``buffer`` into ``targets`` in place (keeps captured CUDA graphs valid)."""
        for spec in self.buckets[index]:
            target = targets.get(spec.name)
            if target is None:
                raise ValueError(f"weight sync: the engine model has no tensor named {spec.name!r}; trainer and "
                                 "workers must build the same architecture (same config).")
            if tuple(target.shape) != spec.shape:
                raise ValueError(f"weight sync: {spec.name!r} has shape {tuple(target.shape)} on the worker, "
                                 f"{spec.shape} on the trainer; they must build the same architecture.")
            target.copy_(_view(buffer, spec))

    def checksums(self, model: nn.Module, device: torch.device | str | None = None) -> list[tuple[int, int]]:
        """Every bucket's checksum over ``model``'s current weights, packed as a sync would pack them."""
        out, fetch = [], self.fetcher(model)
        for index in range(len(self)):
            with fetch(index) as tensors:
                dev = device or next(iter(tensors.values())).device
                out.append(bucket_checksum(self.pack(index, tensors, self.new_buffer(index, dev))))
        return out


def checksum_tensor(buffer: torch.Tensor) -> torch.Tensor:
    """A cheap, order-sensitive integer checksum of a bucket's bytes, identical on CPU and GPU.

    The bytes are read as int64 words laid out as a [rows, 1024] grid (zero-padded); the checksum is the pair
    (Σ_c (2c+1)·colsum_c, Σ_r (r+1)·rowsum_r) with wrapping int64 arithmetic. The column weights are odd, so
    invertible modulo 2**64: any changed word changes the first sum, whatever its bits (with even weights a flipped
    top bit in an odd row and column wrapped to zero in both). A move of a word to another row changes the second;
    to another column of its row the first, unless the two words differ only in their top bit. Integer sums do not
    depend on the reduction order, so a trainer and a worker (or a CPU and a GPU) get the same pair. Two reads of
    the bucket, no host sync.
    """
    words, cols = buffer.view(torch.int64), 1024
    rows = words.numel() // cols
    grid, tail = words[: rows * cols].view(rows, cols), words[rows * cols:]  # the tail: a last, partial row
    col_sums = grid.sum(0)  # [1024]
    col_sums[: tail.numel()] += tail
    row_sums = torch.cat([grid.sum(1), tail.sum()[None]])  # [rows + 1]
    col_weight = torch.arange(1, 2 * cols, 2, dtype=torch.int64, device=buffer.device)  # odd: 1, 3, .., 2047
    row_weight = torch.arange(1, rows + 2, dtype=torch.int64, device=buffer.device)
    return torch.stack([(col_sums * col_weight).sum(), (row_sums * row_weight).sum()])  # [2] int64


def bucket_checksum(buffer: torch.Tensor) -> tuple[int, int]:
    """``checksum_tensor`` read to the host (a sync)."""
    return tuple(int(x) for x in checksum_tensor(buffer).tolist())


class _Fetched(contextlib.AbstractContextManager):
    """Named sources of one bucket; ZeRO-3 parameters are gathered (on every rank) inside the block."""

    def __init__(self, sources: dict[str, Source]):
        self.sources = sources
        self._gather = gathered([p for source in sources.values() for p in source.params])

    @property
    def synchronises(self) -> bool:
        """Whether entering synchronises the device (a ZeRO-3 gather: ``send_buckets`` polls for its broadcasts
        first)."""
        return not isinstance(self._gather, contextlib.nullcontext)

    def __enter__(self) -> "_Values":
        self._gather.__enter__()
        return _Values(self.sources)

    def __exit__(self, *exc):
        return self._gather.__exit__(*exc)


class _Values(Mapping):
    """Name -> tensor, each computed when read (``Source.value``)."""

    def __init__(self, sources: dict[str, Source]):
        self.sources = sources

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.sources[name].value()

    def __iter__(self):
        return iter(self.sources)

    def __len__(self) -> int:
        return len(self.sources)


def gathered(params: list[torch.Tensor]):
    """Full ZeRO-3 parameters inside the block on every rank (a collective: all ranks must enter); read-only.

    Not gathered: a parameter already full (``AVAILABLE``: persistent, or inside an outer gather, which DeepSpeed
    would refuse to nest) and one this rank holds whole (``held_whole``: a partition group of one), whose partition
    ``Source.value`` reads."""
    partitioned = [p for p in params if hasattr(p, "ds_id") and p.ds_status.name != "AVAILABLE" and not held_whole(p)]
    if not partitioned:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None)


def _view(buffer: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    return buffer[spec.offset: spec.offset + spec.nbytes].view(spec.dtype).view(spec.shape)


def _full_shape(param: torch.Tensor) -> tuple[int, ...]:
    return tuple(param.ds_shape) if hasattr(param, "ds_shape") else tuple(param.shape)


def param_dtype(param: torch.Tensor) -> torch.dtype:
    """A parameter's dtype, a ZeRO-3 shard's included (its placeholder reports none of its own)."""
    return param.ds_tensor.dtype if hasattr(param, "ds_tensor") else param.dtype


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
