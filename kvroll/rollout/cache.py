"""The static compressed KV cache: buffers allocated once, kept full of the tokens the policy keeps.

Budget accounting, sinks, the protected recent window, prompt placement and compaction live here, once;
policies only score. The cache is a transformers ``Cache`` so the HF model's attention modules hand it their
post-RoPE keys and values; the registered ``kvroll`` attention function (``attention.py``) then calls
``attend``. Every decode-path op has static shapes and no host synchronisation (CUDA-graph capturable).
Policy state (``cache.state``) tensors are laid out [layers, slots, ...] or [slots, ...] and updated in place,
so slot views (the CUDA graphs of smaller batches) and slot moves (live-slot compaction) carry them.

Invariants the fused kernel relies on: in every (layer, slot, head) the slots below ``count`` are live
(pos >= 0), so it reads no positions for validity (``dense``); for a "contrib" policy ``vnorm`` holds
||v||_1 of every slot, so whatever writes ``v`` (update, place, compact, move_slot) writes ``vnorm`` too.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from kvroll.kernels.cache_write import cache_write, cache_write_torch, value_norm
from kvroll.kernels.compact import ascending_keep, gather_to_front, gather_to_front_torch
from kvroll.kernels.decode_attention import decode_attention, decode_attention_torch, masked_argmin_stat, triton
from kvroll.kernels.pdl_gemm import attention_pdl, pdl_available, rotary_signal_late
from kvroll.policies.base import evictable_mask, layer_major, layer_slot_index

KERNEL_HEAD_DIMS = (16, 32, 64, 128, 256)  # what the fused decode kernel tiles


@dataclass
class PromptKV:
    """A prefilled (possibly compressed) prompt, ready to be copied into sample slots."""

    k: torch.Tensor  # [layers, kv_heads, kept, D]
    v: torch.Tensor  # [layers, kv_heads, kept, D]
    pos: torch.Tensor  # [layers, kv_heads, kept] true positions of the kept tokens
    length: int  # prompt length (the first generated token's position)


def contiguous_span(slots: torch.Tensor) -> slice | None:
    """slice(first, last + 1) if ``slots`` [n] is first, first + 1, ..., last; else None (one host sync)."""
    if slots.numel() == 0:
        return None
    first = int(slots[0])
    if slots.numel() > 1 and not bool((slots.diff() == 1).all()):
        return None
    return slice(first, first + slots.numel())


class CompressedKVCache(Cache):
    """Per-layer K/V of shape [slots, kv_heads, capacity, head_dim] plus slot metadata (see module docstring)."""

    kernel_on_cpu = False  # tests: run the Triton kernel on CPU tensors too (needs TRITON_INTERPRET=1)
    # under a periodic policy live positions ascend with the slot in every row (appends at ``count``, compaction
    # in slot order, prompts placed in time order): R-KV's redundancy kernel relies on it without checking (see
    # ``compact``). Not under a policy that compacts by filling holes (``fills_holes``: Hard-KV's attention base,
    # ``hole_fill_slots``), nor under a step policy, which overwrites its argmin slot in place (no reader asks then).
    _time_ordered = True

    @property
    def time_ordered(self) -> bool:
        return self._time_ordered and not getattr(self.policy, "fills_holes", False)

    @time_ordered.setter
    def time_ordered(self, value: bool) -> None:
        self._time_ordered = value

    def __init__(self, num_layers, slots, num_kv_heads, capacity, head_dim, dtype, device, policy, budget, scale):
        super().__init__(layers=[])
        shape = (num_layers, slots, num_kv_heads, capacity)
        self.k = torch.zeros(*shape, head_dim, dtype=dtype, device=device)  # [L, S, Hkv, C, D]
        self.v = torch.zeros(*shape, head_dim, dtype=dtype, device=device)  # [L, S, Hkv, C, D]
        self.pos = torch.full(shape, -1, dtype=torch.int32, device=device)  # true position per slot; -1 = empty
        # [L, S, Hkv, C] fp32 ||v||_1 of every slot, kept with V for the LongFlow statistic (None otherwise)
        self.vnorm = torch.zeros(shape, dtype=torch.float32, device=device) if policy.stat == "contrib" else None
        self.count = torch.zeros(shape[:-1], dtype=torch.int64, device=device)  # [L, S, Hkv] slots in use
        self.write_idx = torch.zeros(shape[:-1], dtype=torch.int64, device=device)  # [L, S, Hkv] next write
        self.cur_pos = torch.zeros(slots, dtype=torch.int64, device=device)  # [S] position being decoded
        self.slot_ids = torch.arange(slots, device=device)  # [S] slot indices (views of it index a slot range)
        self.num_layers, self.slots, self.num_kv_heads = num_layers, slots, num_kv_heads
        self.capacity, self.head_dim, self.scale = capacity, head_dim, scale
        self.policy, self.budget = policy, budget
        self.generator: torch.Generator | None = None  # set by the engine; handed to prompt_keep_idx (no policy draws from it)
        self.mode = "decode"
        self.rotary_pdl = False  # the last rotary kernel was a PDL launch of the chain (kvroll.kernels.pdl_gemm)
        self._prompt: list = [None] * num_layers
        self.prompt_lengths: list[int] | None = None  # a batched prefill's prompt lengths (engine._prefill_many)
        self.prompt_pad: torch.Tensor | None = None  # and its padded positions [B, 1, P, 1] bool (None: no padding)
        self.state = policy.init_state(self) if hasattr(policy, "init_state") else {}
        # a step policy evicts: the next write index comes from this step's argmin (``attend``); the others
        # (``full``, the periodic policies) append, and the cache write advances it (min(count, capacity - 1))
        self.evicts = not policy.periodic and policy.name != "full"
        self.event_span: slice | None = None  # set while compress_slots runs (see there)
        self.kvroll_residual = None  # a decode step's residual stream between fused decoder layers (fused_add_norm)

    # ---- sizes -------------------------------------------------------------------------------------------
    def kv_bytes(self) -> int:
        """Bytes of the K and V buffers: layers x slots x 2 x kv_heads x capacity x head_dim x dtype bytes."""
        return 2 * self.k.numel() * self.k.element_size()

    def metadata_bytes(self) -> int:
        """Bytes of positions, counts, write indices, decode positions, ``vnorm`` and policy state (stated
        separately from K/V)."""
        tensors = [self.pos, self.vnorm, self.count, self.write_idx, self.cur_pos, *self.state.values()]
        return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))

    # ---- the transformers Cache surface ------------------------------------------------------------------
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """Write this step's post-RoPE K/V ([slots, Hkv, 1, D]) into each head's write slot."""
        if self.mode == "prefill":
            return key_states, value_states
        write = cache_write if self._use_kernels(key_states) else cache_write_torch  # one kernel vs ~11 ops
        write(self.k[layer_idx], self.v[layer_idx], self.vnorm[layer_idx] if self.vnorm is not None else None,
              self.pos[layer_idx], self.count[layer_idx], self.write_idx[layer_idx], self.cur_pos, key_states,
              value_states, self.capacity, advance=not self.evicts)
        return self.k[layer_idx], self.v[layer_idx]

    def rotary_write(self, layer_idx: int, q, k, v, cos, sin, pdl: bool = False, **norms):
        """A decode step's rotary and cache write in one kernel (``kernels/rotary.py``): q, k, v [slots, 1, H, D]
        before HF's transpose (slices of the joined QKV row), HF's cos / sin [slots, 1, D], Qwen3's ``q_norm`` /
        ``k_norm``. Writes the rotated keys and the values as ``update`` would; returns the rotated queries
        [slots, 1, Hq, D], or None where the kernels do not serve (the caller then takes rotary + ``update``).
        ``pdl``: the kernel is a programmatic dependent launch (``kvroll.kernels.pdl_gemm``)."""
        self.rotary_pdl = False  # (``attend`` reads it: whether the decode kernel follows a chained rotary)
        if self.mode != "decode" or not self._use_kernels(k) or k.shape[0] != self.slots or k.shape[1] != 1 \
                or k.dtype != self.k[layer_idx].dtype:  # the fused write stores HF's roundings in k's dtype
            return None
        from kvroll.kernels.rotary import CacheWrite, rotary

        ring = self.state["queries"][layer_idx] if getattr(self.policy, "ring_in_rotary", False) \
            and "queries" in self.state else None  # R-KV's / SnapKV's observation window: the kernel stores q too
        write = CacheWrite(v, self.k[layer_idx], self.v[layer_idx],
                           self.vnorm[layer_idx] if self.vnorm is not None else None, self.pos[layer_idx],
                           self.count[layer_idx], self.write_idx[layer_idx], self.cur_pos, self.capacity,
                           not self.evicts, ring)
        late = pdl and rotary_signal_late(k.shape[0], k.shape[2], q.shape[2] // k.shape[2])  # [slots, 1, H, D]
        q_rot = rotary(q, k, cos, sin, write=write, pdl=pdl, late_signal=late, **norms)[0]
        self.rotary_pdl = bool(pdl)
        self.ring_written = layer_idx if ring is not None else None  # the policy's observe skips its ring write
        return q_rot

    def _use_kernels(self, t: torch.Tensor, any_head_dim: bool = False) -> bool:
        """The Triton kernels serve CUDA tensors (and CPU ones under ``kernel_on_cpu``); the decode and cache-write
        kernels only the head dims they tile, the compaction kernel any (``any_head_dim``)."""
        on = (t.is_cuda or self.kernel_on_cpu) and triton is not None
        return on and (any_head_dim or self.head_dim in KERNEL_HEAD_DIMS)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    # ---- decode ------------------------------------------------------------------------------------------
    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Attention of q [slots, Hq, D] over the layer's live tokens; then, for a step policy, pick the next write
        slot (the others' was advanced by the cache write)."""
        policy = self.policy
        pos = self.pos[layer]
        evicts = self.evicts
        sinks, window = policy.protected() if evicts else (0, 1)
        fused_argmin = evicts and getattr(policy, "argmin_on_stat", policy.stat == "contrib")
        observes = hasattr(policy, "observe")
        # the kernel reads only [0, count); head dims it does not tile (not a power of two in [16, 256]) use torch
        # the decode kernel joins the chain of PDL launches after a chained rotary (kvroll.kernels.pdl_gemm)
        chain_pdl, self.rotary_pdl = self.rotary_pdl and self.mode == "decode" \
            and attention_pdl(q.shape[0], self.k[layer].shape[1], q.shape[1] // self.k[layer].shape[1]) \
            and pdl_available(q.device), False
        if self._use_kernels(q):
            vnorm = self.vnorm[layer] if self.vnorm is not None else None
            # a policy whose observe only adds the statistic into a running sum (Hard-KV's votes): the kernel adds
            stat_sum = policy.stat_sum(self, layer) if hasattr(policy, "stat_sum") else None
            out, stat, evict = decode_attention(  # dense: every slot below count is live (see module docstring)
                q, self.k[layer], self.v[layer], pos, self.cur_pos, self.scale, stat=policy.stat,
                argmin=fused_argmin, sinks=sinks, window=window, layer_shared=policy.granularity == "layer",
                length=self.count[layer], return_stat=observes or not fused_argmin,
                vnorm=vnorm, dense=True, write_idx=self.write_idx[layer] if fused_argmin and not observes else None,
                stat_into=stat_sum,
                chain_pdl=chain_pdl,
            )
            if stat_sum is not None:
                observes = False  # done: the kernel added it
            if fused_argmin and not observes:
                return out  # the kernel set write_idx (its where(count < capacity, count, evict))
        else:
            evictable = evictable_mask(pos, self.cur_pos, sinks, window) if fused_argmin else None
            out, stat, evict = decode_attention_torch(
                q, self.k[layer], self.v[layer], pos >= 0, self.scale, stat=policy.stat,
                evictable=evictable, layer_shared=policy.granularity == "layer",
            )
        if observes:
            policy.observe(self, layer, q, stat)
        if evicts and evict is None:
            scores = policy.step_scores(self, layer, stat)  # [S, Hkv, C], higher = keep
            evictable = evictable_mask(pos, self.cur_pos, sinks, window)
            evict = masked_argmin_stat(scores, evictable, policy.granularity == "layer")
        if evicts:
            count = self.count[layer]
            self.write_idx[layer] = torch.where(count < self.capacity, count, evict.expand_as(count))
        return out

    def due_for_compression(self) -> torch.Tensor:
        """[slots] bool: a periodic policy's cache is full in some layer/head (or its schedule says so)."""
        if hasattr(self.policy, "steps_until_due"):  # Hard-KV compresses every N steps, not when full
            return self.policy.steps_until_due(self) <= 0
        return (self.count >= self.capacity).any(dim=0).any(dim=-1)

    def compress_slots(self, slots: torch.Tensor | list[int]) -> None:
        """Run the periodic policy on ``slots`` in every layer and compact what it keeps.

        While it runs, ``event_span`` is ``slice(first, last + 1)`` when ``slots`` is one ascending contiguous
        range (rows that started together fill up together), so that the policies read their rows as views
        (``kvroll.policies.base.slot_rows``) instead of gathering copies of K. ``slots`` given as a host list of
        ints (the engine's host schedule) costs no host sync; a device tensor costs one (its span). No slots: no-op."""
        if len(slots) == 0:
            return
        if isinstance(slots, (list, tuple)):
            span, slots = self._slot_index(list(slots))
        else:
            span = contiguous_span(slots)
        self.compress_index(slots, span)

    # an event on few slots batches the layers, so that an event on 1-2 slots runs a handful of kernels for all
    # layers instead of a handful per layer: up to ``layer_batch_rows`` (layer, slot) rows per policy call (0: per
    # layer; None: as many rows as hold ``layer_batch_elems`` elements of the event's largest tensor per row, its
    # keys or its window logits (``policy.row_elems``): 256 rows of Qwen3-1.7B at budget 1024 + buffer 128, the
    # best of 64-512 on an H200 (session 14: a 64-slot event 1.2x, 32 slots 1.4x faster than 64 rows; 512 no
    # better), as many as a 256-slot event layer by layer; more rows for a smaller model's cache, fewer for a
    # wider GQA group's logits)
    layer_batch_rows: int | None = None
    layer_batch_elems = 256 * 8 * 1152 * 128

    def compress_index(self, slots: torch.Tensor, span: slice | None = None) -> None:
        """``compress_slots`` for a device index ``slots`` [n] int64 and its span if contiguous (else None): no host
        sync for the host-scheduled policies (R-KV, SnapKV, LagKV, Hard-KV), so an event can be captured in a CUDA
        graph.

        A policy whose ``compress`` takes a slice of layers (``batches_layers``: R-KV, SnapKV, LagKV, Hard-KV) scores
        and compacts several layers per call (``layer_batch_rows``): the same rows, scored row by row, in fewer, fuller
        kernels."""
        self.event_span = span
        # a policy that lists its kept tokens in time order (``keeps_in_time_order``) lists them in slot order in
        # this time-ordered cache: the compaction needs no sort
        # (and one that fills holes lists them in an order just as safe in place: ``hole_fill_slots``)
        ascending = (self.time_ordered and getattr(self.policy, "keeps_in_time_order", False)) \
            or getattr(self.policy, "fills_holes", False)
        per_call = 1
        if getattr(self.policy, "batches_layers", False):
            rows = self.layer_batch_rows
            if rows is None:
                rows = self.layer_batch_elems // self.policy.row_elems(self)
            per_call = max(1, rows // max(1, slots.shape[0]))
        try:
            for first in range(0, self.num_layers, per_call):
                layer = first if per_call == 1 else slice(first, min(first + per_call, self.num_layers))
                keep_idx, keep_count = self.policy.compress(self, layer, slots)
                self.compact(layer, slots, keep_idx, keep_count, ascending=ascending)
        finally:
            self.event_span = None

    def _slot_index(self, slots: list[int]) -> tuple[slice | None, torch.Tensor]:
        """(span or None, the slots as a device int64 tensor) from host ints, without a host sync: a contiguous
        range is a view of a device ``arange``, anything else one asynchronous copy from pinned memory."""
        first = slots[0]
        if slots == list(range(first, first + len(slots))):
            return slice(first, first + len(slots)), self.slot_ids[first:first + len(slots)]
        index = torch.tensor(slots, dtype=torch.int64)
        if self.k.is_cuda:
            index = index.pin_memory().to(self.k.device, non_blocking=True)
        return None, index

    def compact(self, layer, slots, keep_idx, keep_count=None, ascending: bool = False) -> None:
        """Move the kept tokens of ``slots`` to the front: keep_idx [n, Hkv, K] (K <= capacity), distinct slots.

        ``layer`` a slice: keep_idx [layers x n, Hkv, K] holds each layer's rows in turn (layer-major, as the
        layer-batched ``compress`` returns them), and one launch compacts them all.
        ``keep_count`` [n, Hkv] (optional) marks only the first keep_count[i, h] entries live (Hard-KV). On CUDA
        (and with ``kernel_on_cpu``) the Triton kernel moves them in place in ascending slot order, so keep_idx is
        sorted first; every periodic policy already lists its kept tokens in time order, which is slot order in
        the cache (appends go to ``count``, compactions keep the order), so the layout is the torch path's.
        ``ascending=True``: the caller guarantees keep_idx strictly ascending below keep_count, or in
        ``hole_fill_slots``'s order (every entry j below keep_count j itself or a slot at or past keep_count: as
        safe in place) (unchecked: a check would synchronise), so the kernel path skips the sort; entries at or
        past keep_count are not read there. ``after_compact`` gets keep_idx in the order the rows now hold (sorted on the kernel path, unless
        given in ``hole_fill_slots``'s order; entries at or past keep_count are not tokens).
        """
        n, num_heads, kept = keep_idx.shape
        if keep_count is None:
            keep_count = torch.full((n, num_heads), kept, dtype=torch.int64, device=keep_idx.device)
        slots = slots.to(self.k.device)
        # every (layer, slot) row of a buffer [L, S, ...] as a row of [L x S', ...] (S' the full cache's slots: a
        # slot view's rows keep the full cache's layer stride), so one launch compacts several layers
        rows = layer_slot_index(self.k, layer, slots)
        assert n == rows.numel(), (keep_idx.shape, layer, slots.shape)
        vnorm = layer_major(self.vnorm) if self.vnorm is not None else None
        bufs = (layer_major(self.k), layer_major(self.v), layer_major(self.pos), vnorm)
        if self._use_kernels(self.k, any_head_dim=True):
            keep_idx = (keep_idx.to(torch.int32).contiguous() if ascending
                        else ascending_keep(keep_idx, keep_count, self.capacity))
            gather_to_front(*bufs, rows, keep_idx, keep_count.contiguous())
        else:
            gather_to_front_torch(*bufs, rows, keep_idx, keep_count)
        layer_major(self.count)[rows] = keep_count
        layer_major(self.write_idx)[rows] = keep_count.clamp(max=self.capacity - 1)
        if hasattr(self.policy, "after_compact"):  # Hard-KV's, for one layer or a slice of them
            self.policy.after_compact(self, layer, slots, keep_idx)

    # ---- slot views and moves (CUDA graphs of smaller batches, live-slot compaction) -----------------------
    def _slot_dim(self, t) -> int | None:
        """Where a policy-state tensor keeps its slots: [layers, slots, ...] -> 1, [slots, ...] -> 0, else None."""
        if not isinstance(t, torch.Tensor) or t.ndim == 0:
            return None
        if t.ndim >= 2 and tuple(t.shape[:2]) == (self.num_layers, self.slots):
            return 1
        return 0 if t.shape[0] == self.slots else None

    def _per_slot(self):
        """(tensor, slot dim) of every per-slot buffer, policy state included."""
        out = [(self.k, 1), (self.v, 1), (self.pos, 1), (self.count, 1), (self.write_idx, 1), (self.cur_pos, 0)]
        out += [(self.vnorm, 1)] if self.vnorm is not None else []
        return out + [(t, self._slot_dim(t)) for t in self.state.values() if self._slot_dim(t) is not None]

    def slot_view(self, batch: int) -> "CompressedKVCache":
        """A cache over the first ``batch`` slots sharing this one's storage (policy state updated in place)."""
        view = copy.copy(self)
        view.k, view.v, view.pos = self.k[:, :batch], self.v[:, :batch], self.pos[:, :batch]
        view.vnorm = self.vnorm[:, :batch] if self.vnorm is not None else None
        view.count, view.write_idx = self.count[:, :batch], self.write_idx[:, :batch]
        view.cur_pos = self.cur_pos[:batch]
        view.state = {name: t if self._slot_dim(t) is None else t.narrow(self._slot_dim(t), 0, batch)
                      for name, t in self.state.items()}
        view.slots = batch
        return view

    def move_slot(self, src: int, dst: int) -> None:
        """Copy everything slot ``src`` holds into slot ``dst`` (``src`` is then free)."""
        for tensor, dim in self._per_slot():
            tensor.select(dim, dst).copy_(tensor.select(dim, src))

    def steps_until_due(self) -> torch.Tensor:
        """[slots] decode steps each slot may take before a periodic policy must compress it (full or due)."""
        room = self.capacity - self.count.amax(dim=0).amax(dim=-1)
        if hasattr(self.policy, "steps_until_due"):
            room = torch.minimum(room, self.policy.steps_until_due(self))
        return room

    # ---- prefill and placement ---------------------------------------------------------------------------
    def store_prompt(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keep (a compressed view of) the prompts' K/V: q [B, Hq, P, D], k/v [B, Hkv, P, D]; row b's prompt is its
        first ``prompt_lengths[b]`` positions (right padding after it; None: B = 1 and all P positions)."""
        lengths = self.prompt_lengths or [k.shape[2]]
        rows = []
        for b, length in enumerate(lengths):
            keep = min(length, self.policy.prompt_keep(self.budget), self.capacity - 1)
            if keep < length:
                assert k.shape[0] == 1, "a prompt compressed at prefill is prefilled alone (engine._prefill)"
                values = {"v": v[0]} if getattr(self.policy, "prompt_uses_values", False) else {}  # LagKV scores V
                idx = self.policy.prompt_keep_idx(q[0], k[0], keep, self.scale, generator=self.generator, **values)
                idx_d = idx[..., None].expand(-1, -1, self.head_dim)
                rows.append((k[0].gather(1, idx_d), v[0].gather(1, idx_d), idx.to(torch.int32)))
            else:  # the whole prompt (a view: take_prompts copies it)
                idx = torch.arange(length, device=k.device, dtype=torch.int32).expand(self.num_kv_heads, -1)
                rows.append((k[b, :, :length], v[b, :, :length], idx))
        self._prompt[layer] = rows

    def prefill_limit(self) -> int:
        """The longest prompt kept whole at prefill (a longer one is compressed there, alone)."""
        return prefill_limit(self.policy, self.budget, self.capacity)

    def take_prompts(self, lengths: list[int]) -> list[PromptKV]:
        """The prefilled prompts of the last forward, one ``PromptKV`` per row (copies, in the cache's dtype)."""
        layers, self._prompt = self._prompt, [None] * self.num_layers
        out = []
        for b, length in enumerate(lengths):
            ks, vs, ps = zip(*(rows[b] for rows in layers))
            out.append(PromptKV(torch.stack(ks).to(self.k.dtype), torch.stack(vs).to(self.v.dtype), torch.stack(ps),
                                length))
        return out

    def take_prompt(self, length: int) -> PromptKV:
        return self.take_prompts([length])[0]

    def place(self, slot: int, prompt: PromptKV) -> None:
        """Copy a prefilled prompt into ``slot``; the slot then decodes from position ``prompt.length``."""
        kept = prompt.k.shape[2]
        self.k[:, slot, :, :kept] = prompt.k
        self.v[:, slot, :, :kept] = prompt.v
        if self.vnorm is not None:
            self.vnorm[:, slot, :, :kept] = value_norm(prompt.v)
        self.pos[:, slot] = -1
        self.pos[:, slot, :, :kept] = prompt.pos
        self.count[:, slot] = kept
        self.write_idx[:, slot] = kept
        self.cur_pos[slot] = prompt.length
        if hasattr(self.policy, "reset_slot"):
            self.policy.reset_slot(self, slot, prompt)


def prefill_limit(policy, budget: int, capacity: int) -> int:
    """The longest prompt a cache of ``policy`` at ``budget`` with ``capacity`` slots keeps whole at prefill; a
    longer one is compressed there to this many tokens (``CompressedKVCache.prefill_limit``)."""
    return min(policy.prompt_keep(budget), capacity - 1)
