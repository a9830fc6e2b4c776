"""R-KV (papers/r-kv.txt): redundancy-aware decode-time compression for reasoning models.

The cache holds budget B + buffer (128) slots. When it is full, the B + 128 - alpha candidates (every token but
the alpha = 8 newest) are scored and the top B - alpha are kept with the alpha newest, per KV head and row:

* importance: logits of the alpha observation queries (post-RoPE, from a per-layer query ring) against the
  candidate keys; GQA takes the max over the group's query heads of the *raw* logits, softmax over the
  candidates only (fp32), mean over the alpha queries, ``max_pool1d(7, padding 3)`` along tokens (Eqs. 2-4);
* redundancy: cosine similarity of the normalised keys (eps 1e-8) of all cached tokens, diagonal zeroed; for
  each token u, its similarity to its ``beta`` most recent tokens v with S[u, v] > T is zeroed (the authors'
  code keeps beta = 1); column mean, softmax over tokens (Eqs. 5-6);
* score = lambda * importance - (1 - lambda) * redundancy, lambda = 0.1 (Eq. 7).

Redundancy is computed per batch row (the June-2025 reference code used row 0 for every row: not copied). A row
whose ``u`` has no similar token zeroes nothing (the reference code's ``max`` over an all-zero index row would
zero S[u, 0]: not copied either).

    CompressionConfig(policy="rkv", budget=1024)             # buffer 128, alpha 8, T 0.5, beta 1, lambda 0.1
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvroll.kernels.rkv_redundancy import rkv_redundancy_blocked, rkv_redundancy_triton, triton
from kvroll.policies.base import check_float, check_int, check_range
from kvroll.policies.window import (WindowedPolicy, candidate_mask, check_window_budget, compress_top_and_recent,
                                    keep_top_and_recent, window_logits)


@dataclass(frozen=True)
class RKVParams:
    """R-KV hyperparameters (paper defaults; ``mix_lambda`` is the paper's lambda, the code's class uses 0.07)."""

    buffer: int = 128
    window: int = 8  # alpha: observation queries, and the newest tokens always kept
    pool_kernel: int = 7
    threshold: float = 0.5
    beta: int = 1
    mix_lambda: float = 0.1

    def __post_init__(self):
        name = "RKVParams"
        check_int(name, "buffer", self.buffer, 1)
        check_int(name, "window", self.window, 1)
        check_range(name, "window", self.window, self.window <= self.buffer, f"<= buffer={self.buffer}")
        check_int(name, "pool_kernel", self.pool_kernel, 1)
        check_range(name, "pool_kernel", self.pool_kernel, self.pool_kernel % 2 == 1, "odd")
        check_float(name, "threshold", self.threshold, -1.0, 1.0)
        check_int(name, "beta", self.beta, 0)
        check_float(name, "mix_lambda", self.mix_lambda, 0.0, 1.0)


def rkv_importance(q_obs: torch.Tensor, k: torch.Tensor, cand: torch.Tensor, scale: float,
                   pool_kernel: int) -> torch.Tensor:
    """Eqs. 2-4. q_obs [n, Hq, W, D]; k [n, Hkv, C, D]; cand [n, Hkv, C] bool. Returns [n, Hkv, C] fp32."""
    n, num_kv_heads, capacity = k.shape[:3]
    logits = window_logits(q_obs, k).mul_(scale).amax(dim=2)  # [n, Hkv, W, C]
    logits = logits.masked_fill(~cand[:, :, None], float("-inf"))
    probs = logits.softmax(dim=-1).nan_to_num(0.0)  # a head with no candidate has nothing to score
    importance = probs.mean(dim=2).view(n * num_kv_heads, 1, capacity)
    importance = F.max_pool1d(importance, pool_kernel, stride=1, padding=pool_kernel // 2)
    return importance.view(n, num_kv_heads, capacity)


def rkv_redundancy(k: torch.Tensor, live: torch.Tensor, pos: torch.Tensor, threshold: float,
                   beta: int) -> torch.Tensor:
    """Eqs. 5-6 over the live tokens. k [n, Hkv, C, D]; live, pos [n, Hkv, C]. Returns [n, Hkv, C] fp32.

    The readable reference: it materialises [n, Hkv, C, C] (~20 GB per layer at n = 224, C = 1152). The
    policies call ``rkv_redundancy_fast``, which computes the same without it.
    """
    capacity = k.shape[2]
    kf = k.float()
    normed = kf / (kf.norm(dim=-1, keepdim=True) + 1e-8)
    sim = normed @ normed.transpose(-1, -2)  # [n, Hkv, C, C]: row u, column v
    pair = live[..., :, None] & live[..., None, :]
    eye = torch.eye(capacity, dtype=torch.bool, device=k.device)
    sim = sim.masked_fill(~pair | eye, 0.0)
    if beta > 0:
        similar = sim > threshold
        rank = torch.where(similar, pos[..., None, :].long().expand_as(sim), -1)  # position of each similar v
        top = rank.topk(min(beta, capacity), dim=-1)
        exempt = torch.zeros_like(similar).scatter_(-1, top.indices, top.values >= 0)
        sim = sim.masked_fill(exempt, 0.0)
    mean = sim.sum(dim=-2) / live.sum(dim=-1, keepdim=True).clamp_min(1)  # column mean over rows u
    return mean.masked_fill(~live, float("-inf")).softmax(dim=-1).nan_to_num(0.0)


# Which redundancy kernel runs on CUDA (``rkv_redundancy_triton``'s ``kernel``): "auto" = a slot-ordered kernel
# ("scan" while ``rkv_redundancy.ORDERED_SCAN``, else "ordered") when the cache holds its tokens in time order (the
# engine's always do), else the full-matrix one.
RKV_KERNEL = "auto"


def rkv_redundancy_fast(k: torch.Tensor, live: torch.Tensor, pos: torch.Tensor, threshold: float,
                        beta: int, time_ordered: bool = False) -> torch.Tensor:
    """``rkv_redundancy`` in bounded memory: the Triton kernel on CUDA (beta <= 1), else the row-blocked torch
    version (``kvroll.kernels.rkv_redundancy``). Same shapes and contract; pos int32 (the cache's).
    ``time_ordered``: the caller guarantees live positions ascend with the slot (the engine's caches), so the
    kernel choice skips ``slot_ordered``'s check (a host sync)."""
    if k.is_cuda and triton is not None and beta <= 1:
        return rkv_redundancy_triton(k, live, pos.to(torch.int32), threshold, beta, kernel=RKV_KERNEL,
                                     time_ordered=time_ordered)
    return rkv_redundancy_blocked(k, live, pos, threshold, beta)


def rkv_scores(q_obs, k, pos, cur_pos, scale, params: RKVParams, time_ordered: bool = False) -> torch.Tensor:
    """Selection score (higher = keep) of every slot, [n, Hkv, C]; only candidates are meaningful."""
    cand = candidate_mask(pos, cur_pos, params.window)
    importance = rkv_importance(q_obs, k, cand, scale, params.pool_kernel)
    redundancy = rkv_redundancy_fast(k, pos >= 0, pos, params.threshold, params.beta, time_ordered)
    return params.mix_lambda * importance - (1 - params.mix_lambda) * redundancy


class RKVPolicy(WindowedPolicy):
    """Periodic R-KV compression when budget + buffer is full (see the module docstring)."""

    name = "rkv"

    def validate_budget(self, budget):
        check_window_budget("RKVParams", self.name, self.params.window, budget, "the newest tokens kept")

    def compress(self, cache, layer, slots):
        return compress_top_and_recent(cache, layer, slots, self.params.window, lambda q_obs, k, pos, cur_pos:
                                       rkv_scores(q_obs, k, pos, cur_pos, cache.scale, self.params,
                                                  getattr(cache, "time_ordered", False)))

    def prompt_keep_idx(self, q, k, keep, scale, generator=None):
        """The same score on the prompt, the last ``window`` prompt queries observing: [Hkv, keep]."""
        length = k.shape[1]
        window = min(self.params.window, keep)
        params = dataclasses.replace(self.params, window=window, buffer=max(window, self.params.buffer))
        pos = torch.arange(length, device=k.device, dtype=torch.int32).expand(1, k.shape[0], -1)
        cur = torch.tensor([length], device=k.device)
        scores = rkv_scores(q[None, :, length - window:], k[None], pos, cur, scale, params)
        return keep_top_and_recent(scores, pos, cur, keep, window)[0]
