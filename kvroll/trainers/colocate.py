"""Colocated weights: the engine's own module tree, kept equal to the training model's parameters.

    weights = ColocatedWeights(train_model)            # dtype None: share the trainer's storage where possible
    engine = RolloutEngine(weights.engine_model, ...)
    stats = weights.sync()              # after an optimizer step: {"seconds", "shared", "copied", "bytes"}

The engine gets a separate module tree (built on the meta device from a copy of the model config, so setting its
attention implementation leaves the trainer's model untouched). Each engine parameter is the training parameter's
own storage when dtype and layout allow, so an optimizer step updates the engine for free and ``sync`` only checks
the pointers; otherwise (another engine dtype, ZeRO-3 partitioned parameters, a parameter replaced since) it is an
on-device buffer refreshed by an in-place copy, which keeps captured CUDA graphs valid. Under DeepSpeed ZeRO-3
every rank gathers the parameters (a collective per bucket of up to 2^27 elements) and copies them.

A PEFT LoRA model gives the engine its base model's architecture and names, and its merged weights
(``kvroll/rollout/sources.py``): a LoRA layer's weight is an engine buffer refreshed with W + scale·B@A (fp32 math,
cast by the copy) at each sync, since its value is no training tensor's, and so is a ``modules_to_save`` module's
(the active copy can change); every other weight is shared as above. The trainer's model is read, never merged in
place: a sync that would copy into a tensor the trainer still uses is refused.
"""
from __future__ import annotations

import copy
import hashlib
import time

import torch
from torch import nn

from kvroll.rollout.sources import Source, base_model, named_sources
from kvroll.rollout.weights import gathered, param_dtype


class ColocatedWeights:
    """The engine model for a training model and the step that keeps it in sync (see module doc)."""

    def __init__(self, train_model: nn.Module, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None):
        self.train_model = train_model
        self.zero3 = any(hasattr(p, "ds_id") for p in train_model.parameters())
        self.dtype = dtype or param_dtype(next(train_model.parameters()))
        # The trainer's device (accelerator.device); a ZeRO-3 parameter's own device is where its shard lives.
        self.device = _indexed(device if device is not None else next(train_model.parameters()).device)
        self.engine_model = self._build()
        self.first_sync = self.sync()

    def _build(self) -> nn.Module:
        base = base_model(self.train_model)
        config = copy.deepcopy(base.config)
        # The plain constructor, not from_config: under ZeRO-3 transformers would wrap the latter in
        # deepspeed.zero.Init and partition the engine's copy too.
        with torch.device("meta"):
            model = type(base)(config)
        sources = dict(named_sources(self.train_model, remove_duplicate=False))
        made: dict[int, nn.Parameter] = {}  # id(training tensor) -> engine param; keeps tied weights tied
        for name, _ in list(model.named_parameters(remove_duplicate=False)):
            if name not in sources:
                raise ValueError(f"kvroll: the engine model has a parameter {name!r} the training model lacks; "
                                 "is the training model wrapped in a way kvroll does not support?")
            src = sources[name]
            if id(src.tensor) not in made:
                made[id(src.tensor)] = nn.Parameter(self._engine_tensor(src), requires_grad=False)
            _set(model, name, made[id(src.tensor)], "_parameters")
        buffers = dict(named_sources(self.train_model, "buffers", remove_duplicate=False))
        for name, _ in list(model.named_buffers(remove_duplicate=False)):
            _set(model, name, buffers[name].tensor, "_buffers")  # rotary inv_freq etc.: read-only, shared as is
        model.generation_config = copy.deepcopy(getattr(base, "generation_config", None))
        return model.eval()

    def _engine_tensor(self, src: Source) -> torch.Tensor:
        if self._shareable(src):
            return src.tensor.detach()
        tensor = src.tensor
        shape = tuple(tensor.ds_shape) if hasattr(tensor, "ds_shape") else tuple(tensor.shape)
        return torch.empty(shape, dtype=self.dtype, device=self.device)

    def _shareable(self, src: Source) -> bool:
        tensor = src.tensor
        return not src.deltas and not src.adaptable and not hasattr(tensor, "ds_id") and tensor.dtype == self.dtype \
            and tensor.device == self.device

    @torch.no_grad()
    def sync(self) -> dict[str, float]:
        """Make every engine parameter equal the training parameter; all ranks must call it under ZeRO-3."""
        start = time.perf_counter()
        shared = copied = copied_bytes = 0
        targets = dict(self.engine_model.named_parameters())
        sources = named_sources(self.train_model)
        training = {src.tensor.data_ptr() for _, src in sources if src.tensor.numel()}  # storage the trainer uses
        for bucket in _buckets(sources):
            with gathered([p for _, src in bucket for p in src.params]):  # one collective per bucket under ZeRO-3
                for name, src in bucket:
                    target = targets[name]
                    if not src.deltas and target.data_ptr() == src.tensor.data_ptr() \
                            and target.dtype == src.tensor.dtype:
                        shared += 1
                        continue
                    if target.data_ptr() in training:  # a copy would overwrite one of the trainer's own tensors
                        raise ValueError(
                            f"kvroll: the engine shares {name!r} with the training model, which now needs another "
                            "value there (a LoRA adapter or modules_to_save added on that module since the engine "
                            "was built); copying it would overwrite the trainer's weight. Add every adapter before "
                            "the first rollout (or before building ColocatedWeights).")
                    target.copy_(src.value())
                    copied += 1
                    copied_bytes += target.numel() * target.element_size()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return {"seconds": time.perf_counter() - start, "shared": shared, "copied": copied, "bytes": copied_bytes}


def weights_checksum(model: nn.Module, dtype: torch.dtype | None = None) -> str:
    """sha256 over the bytes of every engine weight of ``model`` (cast to ``dtype`` first when given), in name order.

    A PEFT LoRA model's engine weights are its merged weights under the base names (``named_sources``), so its
    checksum equals that of an engine that holds them.
    """
    digest = hashlib.sha256()
    for name, src in sorted(named_sources(model), key=lambda item: item[0]):
        with gathered(src.params):
            tensor = src.value()
            tensor = tensor.to(dtype if dtype is not None else src.tensor.dtype)
            digest.update(name.encode())
            digest.update(tensor.contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _indexed(device) -> torch.device:
    """A device spelled as tensors report theirs (``cuda:<i>``, plain ``cpu``), so comparing with one works.

    Accelerate may say ``cuda`` (no index) or ``cpu:0`` (CPU ranks); ``torch.device`` equality sees those as
    different from a parameter's ``cuda:0`` / ``cpu``, which would turn shared storage into copies.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu") if device.type == "cpu" else device


def _buckets(named: list[tuple[str, Source | torch.Tensor]], max_numel: int = 1 << 27):
    """Consecutive runs of sources of at most ``max_numel`` elements in all (a larger one goes alone)."""
    bucket, numel = [], 0
    for name, item in named:
        size = sum(int(getattr(p, "ds_numel", p.numel())) for p in getattr(item, "params", [item]))
        if bucket and numel + size > max_numel:
            yield bucket
            bucket, numel = [], 0
        bucket.append((name, item))
        numel += size
    if bucket:
        yield bucket


def _set(model: nn.Module, name: str, value: torch.Tensor, kind: str) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    getattr(module, kind)[attr] = value
