"""What the windowed periodic policies (``snapkv``, ``rkv``) share: a query ring buffer and the top+recent keep.

Both keep a per-layer ring of the last ``window`` post-RoPE decode queries (the observation window), append
until the cache (budget + buffer) is full, then score the candidates (every live token but the ``window``
newest) and keep the top ``budget - window`` of them plus the ``window`` newest tokens, per KV head.

    state = query_ring_state(cache, 8, policy.num_q_heads)   # in init_state
    ring_write(cache, layer, q)                         # in observe
    q_obs = ring_read(cache, layer, slots, window)      # [n, Hq, W, D], oldest first (layer: int or a slice)
    logits = window_logits(q_obs, k)                    # [n, Hkv, G, W, C] fp32, unscaled
    keep = keep_top_and_recent(scores, pos, cur_pos, budget, window)   # [n, Hkv, budget]
    check_window_budget("RKVParams", "rkv", 8, budget, "the newest tokens kept")    # in validate_budget
    keep_idx, _ = compress_top_and_recent(cache, layer, slots, 8, score_fn)          # in compress
    k_rows = layer_rows(cache, cache.k, slice(0, 4), slots)   # [4 * n, Hkv, C, D]: layers 0-3, layer-major
    class RKVPolicy(WindowedPolicy): ...                 # the protocol methods both share
"""
from __future__ import annotations

import torch

from kvroll.policies.base import ascending_slots, check_budget, layer_major, layer_slot_index, slot_rows

# torch >= 2.8: bf16/fp16 GEMMs with an fp32 output (CUDA only)
_BMM_OUT_DTYPE = "dtype" in torch.ops.aten.bmm.overloads()


def query_ring_state(cache, window: int, num_q_heads: int) -> dict:
    """Policy state holding the last ``window`` queries per (layer, slot): [L, S, W, Hq, D] in the cache dtype.

    The engine tells the policy Hq (``policy.num_q_heads``) before it allocates the cache.
    """
    shape = (cache.num_layers, cache.slots, window, num_q_heads, cache.head_dim)
    return {"queries": torch.zeros(shape, dtype=cache.k.dtype, device=cache.k.device)}


def ring_write(cache, layer: int, q: torch.Tensor) -> None:
    """Store this step's query q [S, Hq, D] at ring index cur_pos % W."""
    ring = cache.state["queries"][layer]  # [S, W, Hq, D]
    idx = (cache.cur_pos % ring.shape[1])[:, None, None, None].expand(-1, 1, q.shape[1], q.shape[2])
    ring.scatter_(1, idx, q[:, None].to(ring.dtype))


def layer_rows(cache, t: torch.Tensor, layer: int | slice, slots: torch.Tensor) -> torch.Tensor:
    """The rows of ``slots`` in ``layer`` (an int) or in each layer of ``layer`` (a slice, ``cache.compress_index``'s
    layer-batched events), from a tensor laid out [L, S, ...]: [n, ...] for one layer (a view over an event span,
    ``slot_rows``), else [layers x n, ...] layer-major (one gathered copy: a batched event holds few slots)."""
    if isinstance(layer, int):
        return slot_rows(cache, t[layer], slots)
    if layer.stop - layer.start == 1:
        return slot_rows(cache, t[layer.start], slots)
    return layer_major(t)[layer_slot_index(t, layer, slots)]


def repeat_layers(x: torch.Tensor, layer: int | slice) -> torch.Tensor:
    """A per-slot tensor [n, ...] repeated for each layer of ``layer`` (layer-major, as ``layer_rows``)."""
    if isinstance(layer, int) or layer.stop - layer.start == 1:
        return x
    return x.repeat(layer.stop - layer.start, *[1] * (x.ndim - 1))


def ring_read(cache, layer: int | slice, slots: torch.Tensor, window: int) -> torch.Tensor:
    """The last ``window`` queries of ``slots``, oldest first: [n, Hq, W, D] in the cache dtype ([layers x n, ...]
    for a slice of layers, layer-major).

    Compression runs before the step at ``cur_pos``, so the window holds positions cur_pos - W .. cur_pos - 1.
    """
    ring = layer_rows(cache, cache.state["queries"], layer, slots)  # [n, W, Hq, D]
    size = ring.shape[1]
    cur_pos = repeat_layers(slot_rows(cache, cache.cur_pos, slots), layer)
    order = (cur_pos[:, None] - window + torch.arange(window, device=ring.device)) % size  # [n, W]
    idx = order[:, :, None, None].expand(-1, -1, ring.shape[2], ring.shape[3])
    return ring.gather(1, idx).transpose(1, 2)


def window_logits(q_obs: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Raw (unscaled) logits of each KV group's queries, [n, Hkv, G, W, C] fp32.

    q_obs [n, Hq, W, D] (Hq = Hkv x G, head-major); k [n, Hkv, C, D]. On CUDA with q and k both bf16 (or
    fp16) the products are exact in fp32 and the GEMM accumulates in fp32, so ``out_dtype=float32`` gives the
    fp32 einsum's values without an fp32 copy of K (torch >= 2.8; older versions upcast).
    """
    n, num_q_heads, window, dim = q_obs.shape
    num_kv_heads, capacity = k.shape[1], k.shape[2]
    group = num_q_heads // num_kv_heads
    q_rows = q_obs.reshape(n * num_kv_heads, group * window, dim)  # Hq = Hkv x G, head-major
    k_cols = k.reshape(n * num_kv_heads, capacity, dim).transpose(1, 2)
    if _BMM_OUT_DTYPE and k.is_cuda and q_obs.dtype == k.dtype and k.dtype in (torch.bfloat16, torch.float16):
        logits = torch.bmm(q_rows, k_cols, out_dtype=torch.float32)
    else:
        logits = torch.bmm(q_rows.float(), k_cols.float())
    return logits.view(n, num_kv_heads, group, window, capacity)


def candidate_mask(pos: torch.Tensor, cur_pos: torch.Tensor, window: int) -> torch.Tensor:
    """[n, Hkv, C] live tokens older than the ``window`` newest: pos in [0, cur_pos - window)."""
    return (pos >= 0) & (pos < (cur_pos - window)[:, None, None])


def keep_top_and_recent(scores: torch.Tensor, pos: torch.Tensor, cur_pos: torch.Tensor, budget: int,
                        window: int) -> torch.Tensor:
    """Slots to keep: top ``budget - window`` candidates by ``scores`` + the ``window`` newest, in time order.

    scores, pos: [n, Hkv, C]; cur_pos: [n]. Returns [n, Hkv, budget] int64 (slot indices, ascending position).
    """
    cand = candidate_mask(pos, cur_pos, window)
    top = scores.float().masked_fill(~cand, float("-inf")).topk(budget - window, dim=-1).indices
    recent = pos.long().masked_fill(pos < 0, -1).topk(window, dim=-1).indices  # the newest W live tokens
    keep = torch.cat([top, recent], dim=-1)
    order = pos.gather(-1, keep).argsort(dim=-1)
    return keep.gather(-1, order)


def keep_top_and_window_ordered(scores: torch.Tensor, pos: torch.Tensor, cur_pos: torch.Tensor, budget: int,
                                window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``keep_top_and_recent`` on a time-ordered cache (live positions ascend with the slot: the engine's), where
    time order is slot order: the keep mask's slots by a partition, no sort. Returns (slots [n, Hkv, budget], the
    counts [n, Hkv]): the window is the live non-candidates, so a row whose newest ``window`` positions are not all
    live keeps fewer than ``budget`` (its count says so; past it the slots are padding). Every engine event is on
    a full row, where both keep the same ``budget`` slots (tested)."""
    cand = candidate_mask(pos, cur_pos, window)
    top = scores.float().masked_fill(~cand, float("-inf")).topk(budget - window, dim=-1, sorted=False).indices
    keep = (pos >= 0) & ~cand  # the window: live, not a candidate
    return ascending_slots(keep.scatter_(-1, top, True), budget)


def check_window_budget(params_name: str, policy: str, window: int, budget, kept: str) -> None:
    """A windowed policy's budget must exceed its window (``kept`` says what the window holds) by a token.

    The error names the budget (a budget below the default window is the usual mistake) and both fixes."""
    check_budget(policy, budget, window + 1, f"{params_name}.window={window} ({kept}) plus at least one selected "
                 f"token; raise the budget or lower window")


def compress_top_and_recent(cache, layer: int | slice, slots: torch.Tensor, window: int, score_fn):
    """A windowed policy's ``compress``: ``score_fn(q_obs, k, pos, cur_pos)`` -> [n, Hkv, C] keep-scores over the
    slots' observation window, then the top ``budget - window`` plus the ``window`` newest. Returns (keep, counts)
    (counts None: every row keeps ``budget``).

    ``layer`` a slice: every layer of it at once, its rows layer-major ([layers x n, Hkv, budget]); the scores
    of a row depend on that row alone, so this equals the layers one by one."""
    pos = layer_rows(cache, cache.pos, layer, slots)
    cur_pos = repeat_layers(slot_rows(cache, cache.cur_pos, slots), layer)
    q_obs = ring_read(cache, layer, slots, window)
    scores = score_fn(q_obs, layer_rows(cache, cache.k, layer, slots), pos, cur_pos)
    if getattr(cache, "time_ordered", False):
        return keep_top_and_window_ordered(scores, pos, cur_pos, cache.budget, window)
    return keep_top_and_recent(scores, pos, cur_pos, cache.budget, window), None


class WindowedPolicy:
    """The policy methods R-KV and SnapKV share: ``params.window`` protected newest tokens and observation queries
    (a query ring), budget + ``params.buffer`` slots, a prompt kept to the budget, and ``budget`` tokens left by
    every compression (so the engine schedules the next one on the host, ``kvroll/rollout/schedule.py``).
    Subclasses set ``name`` and define ``validate_budget``, ``compress`` and ``prompt_keep_idx``."""

    periodic, stat, granularity = True, None, "head"
    keeps_in_time_order = True  # ``compress`` lists the kept tokens in time order (``CompressedKVCache.compact``)
    batches_layers = True  # ``compress`` takes a slice of layers too (``CompressedKVCache.compress_index``)

    def __init__(self, params):
        self.params = params
        self.num_q_heads: int | None = None  # set by the engine before the cache is allocated

    def protected(self):
        return 0, self.params.window

    def capacity(self, budget, max_len):
        return budget + self.params.buffer

    def prompt_keep(self, budget):
        return budget

    def kept_after_compress(self, budget):
        return budget

    def init_state(self, cache):
        return query_ring_state(cache, self.params.window, self.num_q_heads)

    def row_elems(self, cache) -> int:
        """Elements of the largest tensor an event holds per (layer, slot) row: its keys [Hkv, C, D] or its fp32
        window logits [Hq, W, C] (``CompressedKVCache.compress_index`` sizes its layer-batched calls by it)."""
        return cache.capacity * max(cache.num_kv_heads * cache.head_dim, self.num_q_heads * self.params.window)

    ring_in_rotary = True  # the fused rotary kernel may store the step's queries in the ring (cache.rotary_write)

    def observe(self, cache, layer, q, stat):
        if getattr(cache, "ring_written", None) == layer:  # done in this step's rotary kernel
            cache.ring_written = None
            return
        ring_write(cache, layer, q)
