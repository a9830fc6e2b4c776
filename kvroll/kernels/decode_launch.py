"""How a ``decode_attention`` call is launched: its splits, tiles, warps, stages, who finishes the rows and how
the logits are stored, each rule with the measurement it came from (``docs/benchmarks/kernel_decode.md``,
``engine_throughput.md``), and the device facts they read. The kernels and the launcher that applies these are in
``decode_attention.py``; the rules change how fast a call runs, never its results.

    splits = default_splits(slots, num_kv_heads, capacity, block_n, device, stat=True, head_dim=128)
    warps, stages = launch_config(slots * num_kv_heads, head_dim, stat=True, device=device)

The upper-case switches (``FINISH_EARLY``, ``MERGE_APART``, ...) turn a measured change off again for the
benchmarks' A/B runs (``benchmarks/*_ab.py``); the launcher reads them here at each call.
"""
from __future__ import annotations

import functools
import os

import torch

try:  # grid dependency control (programmatic dependent launch), Triton 3.4+
    from triton.language.extra.cuda import gdc_wait
except ImportError:  # pragma: no cover - no PDL then
    gdc_wait = None

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.lru_cache(maxsize=None)
def sm_count(device) -> int:
    """SMs of a CUDA device (4 elsewhere, so that the interpreter's tests reach the few-rows paths); asked once."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


@functools.lru_cache(maxsize=None)
def pdl_ok(device) -> bool:
    """Programmatic dependent launch: an NVIDIA GPU of compute capability >= 9 (Hopper) and a Triton with
    ``launch_pdl`` and ``gdc_wait`` (3.4+); never under the interpreter."""
    if device.type != "cuda" or _INTERPRET or torch.version.hip is not None or gdc_wait is None:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    fields = getattr(CUDAOptions, "__dataclass_fields__", {})
    return "launch_pdl" in fields and torch.cuda.get_device_capability(device)[0] >= 9


def merge_sb(splits: int, elems: int) -> int:
    """Splits per load of the merge: at most ~4k elements per [splits, elems] tile, 2 at least."""
    return min(max(2, pow2(splits)), max(2, 4096 // elems))


def _base_splits(rows: int, capacity: int, block_n: int, sms: int, stat: bool, resident: int = 2) -> int:
    if _one_split(rows, capacity, sms, resident, stat):
        return 1
    per_sm, tiles = (32, 12) if stat else (16, 8)
    want = max(1, round(per_sm * sms / rows))
    return max(1, min(want, capacity // (tiles * block_n)))


def long_tail(slots: int, num_kv_heads: int, capacity: int, block_n: int, device, stat: bool) -> bool:
    """Whether a call takes the long tail's configuration: fewer (slot, head) rows than SMs and, with a statistic,
    rows longer than 2,048 tokens or fewer programs than half the SMs at the usual split count. (Session 10's
    H200 runs: at batch 8 and 2,048 tokens the usual 2 splits finished by the last arrival were 5-15% faster than
    the tail's; at batch 1, or 8k tokens and more, the tail's were 1.1-3.5x faster.)"""
    sms, rows = sm_count(device), slots * num_kv_heads
    if rows >= sms:
        return False
    return not stat or capacity > 2048 or rows * _base_splits(rows, capacity, block_n, sms, stat) < sms // 2


TAIL_SHORT_SPLITS = True  # False: the long tail's splits with a statistic take 256 tokens at least (before session 36)


def tail_stat_split(rows: int, group: int, head_dim: int) -> int:
    """Tokens a long-tail split with a statistic takes at least: 128 at fewer than 16 (slot, KV head) rows of
    head_dim <= 128 where a head's (query head, dim) elements are fewer than 1,024, else 256. Session 36's H100 probe
    (``benchmarks/finish_early_ab.py``, LongFlow's call, the merge kernel finishing), two runs: one slot of 8 KV
    heads at 1,536-3,000 tokens, head_dim 64 with groups 1-8 and head_dim 128 with groups 1-4, 0.82-0.92x the time
    of 256-token splits (one slot x head_dim 64 x group 8 x 2,048 tokens: 1.54x -> 1.36-1.39x SDPA). Left out:
    head_dim 128 x group 8 (1,024 elements: the merge reads twice as many partial outputs), 1.00-1.01x at one slot
    and 1.12x at two; two slots (16 rows) 0.975-1.00x at head_dim 64 x group 8 x 2,048 tokens and 1.09x at group 4
    x 3,000 tokens (16 splits of 188 tokens against 11); three slots 1.00x; head_dim 256 (32-token tiles), not
    measured."""
    return 128 if TAIL_SHORT_SPLITS and rows < 16 and head_dim <= 128 and pow2(group) * head_dim < 1024 else 256


TAIL_MAX_SPLITS = 16  # the long tail's splits per row at most (session 13: 32 were 1.1-1.4x slower than 16)


def _kv_tile_bytes(block_n: int, head_dim: int, elem_size: int, num_stages: int) -> int:
    """Shared memory of a split program's K and V tiles over its pipeline stages."""
    return num_stages * 2 * block_n * head_dim * elem_size


def tail_programs_per_sm(block_n: int, head_dim: int, elem_size: int, num_stages: int) -> int:
    """Split programs that run at once on one SM in the long tail: 2 where a program's K and V tiles of every
    pipeline stage take at most 100 KB of shared memory, else 1 (a 128-token tile at head_dim 128 takes 192 KB)."""
    return 2 if _kv_tile_bytes(block_n, head_dim, elem_size, num_stages) <= 100 * 1024 else 1


SM_SHARED_BYTES = 228 * 1024  # shared memory per SM on an H100 / H200 (the interpreter's stand-in too)


@functools.lru_cache(maxsize=None)
def resident_programs(block_n: int, head_dim: int, elem_size: int, num_stages: int, device=None) -> int:
    """Split programs that fit on one SM at once by their K and V tiles of every pipeline stage (1 to 4): 2 at
    head_dim 128 with 64-token tiles and 3 stages (96 KB), 4 at head_dim 64."""
    smem = SM_SHARED_BYTES
    if device is not None and device.type == "cuda":
        smem = getattr(torch.cuda.get_device_properties(device), "shared_memory_per_multiprocessor", smem) or smem
    return max(1, min(4, smem // _kv_tile_bytes(block_n, head_dim, elem_size, num_stages)))


LAUNCH_RULE = True  # False: 4 warps and 3 stages everywhere, the defaults before session 22 (the A/B's "old")


def launch_config(rows: int, head_dim: int, stat: bool, device, elem_size: int = 2,
                  block_n: int | None = None) -> tuple[int, int]:
    """(num_warps, num_stages) of a call with ``rows`` (slot, KV head) rows: 4 warps and 3 stages but where
    session 22's H100 sweep (``benchmarks/attn_config_sweep.py``: 17-256 slots x 8 KV heads x 1,024-4,096 tokens x
    head_dim 128 / 64, attention alone and LongFlow's statistic; docs/benchmarks/kernel_decode.md) and the engine's
    A/B found better, with ``fill`` = rows / the programs one wave of the 3-stage tiles holds
    (``resident_programs``: 2 per SM at head_dim 128, 4 at 64). Measured on an H100; H200s share its 132 SMs and
    shared memory:

    * attention alone, head_dim 128, 1.2 <= fill <= 2.1: 2 stages (3 programs per SM): 0.94-0.99x the time at
      384-512 rows; at fill ~1 and ~3 they were up to 2% and 8% slower. With 3 programs per SM ``_one_split``'s wave is
      larger, so rows of more than 1,152 tokens there also take one split instead of several and the merge kernel
      (the sweep timed the calls as the launcher makes them: 0.96-0.98x at 64 slots of 2,048-4,096 tokens).
    * attention alone, head_dim 64, fill >= 1.4: 2 stages: 0.93-0.99x at 768-2,048 rows; 1-15% slower below.
    * the statistic: 4 warps, 3 stages (2 stages with the logits stored from the registers in
      ``stat_two_stages``'s window, which ``decode_attention`` applies before this). 8 warps took 0.97x the time
      at 512 rows of 1,024 tokens in the sweep, but in the engine's A/B LongFlow's decode kernel took 1.087x; at
      head_dim 64 the sweep was mixed.

    In the engine at batch 64 (budget 1,024; attention alone): SnapKV's, R-KV's and LagKV's decode kernels took
    0.95-0.96x their time with 3 stages (engine_throughput.md, session 22). Rows fewer than the SMs (the long
    tail's own rules), other head dims, tiles and element sizes: 4 and 3."""
    if not LAUNCH_RULE or block_n not in (None, 64) or elem_size != 2 or head_dim not in (64, 128):
        return 4, 3
    sms = sm_count(device)
    if rows < sms:
        return 4, 3
    fill = rows / (sms * resident_programs(64, head_dim, elem_size, 3, device))
    if not stat and ((head_dim == 128 and 1.2 <= fill <= 2.1) or (head_dim == 64 and fill >= 1.4)):
        return 4, 2
    return 4, 3


STAT_LAUNCH_RULE = True  # False: the statistic keeps 3 stages and its store (before session 23; the A/B's "old")


def stat_two_stages(rows: int, head_dim: int, capacity: int, group: int, device, elem_size: int = 2,
                    block_n: int | None = None, early_store: bool = True) -> bool:
    """Whether a call with a statistic takes 2 pipeline stages with the logits stored from the dot's registers
    ("asm") instead of 3 stages and the late store (``decode_attention`` applies it where neither ``num_stages``
    nor ``logit_store`` is given, on an NVIDIA GPU). ``early_store``: the call's logits can be stored before the
    softmax update (cached norms, or the mass), which "asm" needs.

    Session 23's H100 probe (``benchmarks/stat_epilogue_probe.py``: 17-352 slots x 8 KV heads x 1,024-4,096 tokens,
    head_dim 128 / 64, groups 1-8, LongFlow's call: cached norms, argmin; ``raw/s23/hardkv_mass_probe.py``: the
    mass added into Hard-KV's votes), with ``fill`` = rows / the programs one wave of the 3-stage tiles holds (2 per
    SM at head_dim 128): at head_dim 128, 1.09 <= fill <= 2.0 (36-66 slots of 8 KV heads on 132 SMs), at most 2,048
    tokens and 4 query heads per KV head, 0.83-1.00x the time (1,024 tokens 0.83-0.97x; 2,048 tokens 0.96-1.00x;
    groups 1, 2, 4; the mass at 64 slots x 1,152 tokens 0.954x). With 2 stages the late store's layout conversion
    through shared memory keeps the programs at 2 per SM; at 64 slots 2 stages with the late store took 1.06x,
    "asm" alone 0.99x (at 48 slots 2 stages alone gave as much, 0.957x). Left out, measured: 4,096 tokens
    (1.02-1.05x), 8 query heads per KV head (1.02x), fills past 2.0 (69 slots: 1.14x / 1.05x at 1,024 / 2,048
    tokens; 72-80: up to 1.15x; 96-352: 0.97-1.02x, the mass at 128-256 slots 0.98-0.99x), below 1.09 (33 slots:
    1.00x; 17-24: 0.91-1.21x), head_dim 64 (0.98-1.18x). Measured on an H100 only: on other GPUs (a CUDA device
    whose compute capability is not 9.x, ROCm) it answers False. The CPU device stands in for an H100 in the
    tests."""
    if not STAT_LAUNCH_RULE or not early_store or elem_size != 2 or block_n not in (None, 64) or head_dim != 128 \
            or capacity > 2048 or group > 4:
        return False
    if device is not None and torch.device(device).type == "cuda" \
            and (torch.version.hip is not None or torch.cuda.get_device_capability(device)[0] != 9):
        return False
    fill = rows / (sm_count(device) * resident_programs(64, head_dim, elem_size, 3, device))
    return 1.09 <= fill <= 2.0


def _one_split(rows: int, capacity: int, sms: int, resident: int, stat: bool) -> bool:
    """Rows >= SMs: whether one split per row (no merge kernel, no second program per row) is the call to make.
    Session 18's H100 sweeps (17-128 slots x 8 KV heads x 1,024-8,192 tokens x head_dim 128 / 64, splits 1-8,
    interleaved graph medians; docs/benchmarks/kernel_decode.md), with ``fill`` = rows / the programs one wave
    holds:

    * attention alone: one split was as fast as the old rule's 2-16 splits and merge kernel or faster (0.82-1.00x
      their time on the 35 shapes it changes), and within 5% of the fastest split count, from a third of a wave
      up to 1.5 waves at any length, and from a third of a wave up at <= 1,152 tokens; at ~2 waves and >= 2,048
      tokens the old rule's splits were 1-9% faster, and below a third of a wave 2-4 splits were 8-21% faster.
    * with the statistic (a wave counted at 2 programs per SM at most: its registers), one split from 0.7 to 1.5
      waves at 2,048-4,096 tokens: 0.82-1.02x the old rule's 2-5 splits (at 8,192 tokens 0.98-1.03x: kept); one
      program per SM (136 rows at head_dim 64) or ~2 waves were up to 21% slower with one split."""
    if rows < sms:  # the long tail's calls (``long_tail``) have their own rule
        return False
    if stat:
        fill = rows / (sms * min(resident, 2))
        return 0.7 <= fill <= 1.5 and capacity <= 4096
    fill = rows / (sms * resident)
    return fill >= 1 / 3 and (capacity <= 1152 or fill <= 1.5)


FEW_ROWS_SPLITS = True  # False: default_splits' base rule's 2 splits at few rows, head_dim 64 (before session 23)


def default_splits(slots: int, num_kv_heads: int, capacity: int, block_n: int, device, stat: bool = True,
                   tail: bool | None = None, head_dim: int = 128, elem_size: int = 2, num_stages: int = 3,
                   group: int = 1) -> int:
    """With a statistic (finished by the last program to arrive): about 32 (slot, head, split) programs per SM,
    at least 12 tiles per split (the session-5 H200 sweep's best: K1 4, K2 8, K3 1 split). Attention alone: about
    16 per SM, at least 8 tiles per split (session 4's sweep: K1 2, K2 4, K3 1). Either way one split where
    ``_one_split`` says so (rows filling a share of a wave of ``resident_programs`` per SM; session 18).
    In the long tail (``long_tail``: fewer (slot, head) rows than SMs): one wave, the most splits whose programs
    all run at once (``tail_programs_per_sm`` per SM), at most ``TAIL_MAX_SPLITS``, with splits of 128 tokens at
    least (with a statistic ``tail_stat_split``'s 128 or 256). Session 13's H200 search over 1-64 splits at 8-64
    rows x 2k-32k tokens: a second, partial wave costs 10-35% (at 32 rows and 8k tokens, 4 splits 1.00x SDPA, 5
    splits 1.30x); splits beyond one wave cost as much. ``tail``: ``long_tail``'s answer when the caller has it;
    ``head_dim``, ``elem_size`` (bytes) and ``num_stages`` size the tail's programs; ``group`` is the query heads
    per KV head.

    With a statistic at head_dim 64 and 1,536-2,048 tokens, where the base rule's 2 splits (12 tiles each at
    least) give at most 1.25 programs per SM (``FEW_ROWS_SPLITS``): 4 splits. Session 23's H100 probe
    (``benchmarks/stat_epilogue_probe.py``, LongFlow's call) at 40-80 (slot, head) rows: 0.89-0.97x the time (8
    slots x 8 KV heads x 2,048 tokens, groups 2 / 4 / 8: 0.885 / 0.910 / 0.917); at 96-128 rows 4 splits were
    1.04-1.14x, at head_dim 128 1.05-1.10x (not taken there)."""
    sms, rows = sm_count(device), slots * num_kv_heads
    if long_tail(slots, num_kv_heads, capacity, block_n, device, stat) if tail is None else tail:
        wave = sms * tail_programs_per_sm(block_n, head_dim, elem_size, num_stages) // rows
        least = tail_stat_split(rows, group, head_dim) if stat else 128
        return max(1, min(wave, TAIL_MAX_SPLITS, capacity // max(block_n, least)))
    base = _base_splits(rows, capacity, block_n, sms, stat,
                        resident_programs(block_n, head_dim, elem_size, num_stages, device))
    if FEW_ROWS_SPLITS and stat and head_dim == 64 and block_n == 64 and 1536 <= capacity <= 2048 and base == 2 \
            and rows * base <= 1.25 * sms:
        return 4
    return base


def short_tail(rows: int, group: int, capacity: int) -> int | None:
    """With a statistic in the long tail, rows of at most 1,024 tokens (2,048 from 16 (slot, head) rows up), a
    compressed cache's budget, with at most 4 query heads per KV head or 32 rows and more: splits of 128 tokens,
    at most 8 (16 rows or fewer), 4, or 2 (64 rows and more with over 4 query heads per KV head), finished by the
    last program to arrive at each row (one kernel) instead of the merge kernel. Returns the split count, or None
    where the merge kernel finishes. Session 13's H200 search over 36 shapes (slots 1-8 x 512-2,048 tokens x
    head_dim 128 / 64, groups 2, 4, 8): the rule's picks from it gave a geometric mean of 1.41x SDPA against the
    merge's 1.57x; with 8 query heads per KV head at 8-16 rows, and at one slot of 2,048 tokens, the merge kernel
    was as fast or faster (the last arrival finishes its row alone)."""
    if capacity > 2048 or (group > 4 and rows < 32) or (capacity > 1024 and rows < 16):
        return None
    cap = 8 if rows <= 16 else 4 if rows < 64 or group <= 4 else 2
    return max(1, min(capacity // 128, cap))


def tail_block_n(head_dim: int, capacity: int, dtype, device, num_stages: int) -> int | None:
    """The long tail's tile, 128 tokens, for rows of more than 2,048 tokens where its K and V tiles of every
    pipeline stage fit in the device's shared memory (session 13's H200 search: at 8k-32k tokens 128-token tiles
    with longer splits were 1.04-1.14x SDPA where 64-token tiles were 1.15-1.5x; at 2,048 tokens the 64-token tiles
    were as fast or faster). None: keep the usual tile."""
    if capacity <= 2048 or head_dim > 128:
        return None
    need = _kv_tile_bytes(128, head_dim, dtype.itemsize, num_stages) + 16384
    return 128 if need <= block_shared_memory(device) else None


@functools.lru_cache(maxsize=None)
def block_shared_memory(device) -> int:
    """Shared memory one program may opt into on ``device`` (a CUDA device's ``shared_memory_per_block_optin``;
    elsewhere the interpreter, which has no limit: the H100 / H200's 227 KB)."""
    if device is not None and torch.device(device).type == "cuda":
        return getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 0)
    return 227 * 1024


def logit_defaults(few_rows: bool, group: int, nvidia: bool, logit_store=None, logit_discard=None):
    """(logit_store, logit_discard) of a call: "asm" stores and no discard for fewer (slot, head) rows than SMs
    with 2+ query heads per KV head on an NVIDIA GPU (session 18's H100 check of the long tail: 0.89-1.02x the time
    of the late store with discard; with one query head per KV head up to 1.21x slower), else the late store with
    discard (the defaults since session 5). A store given explicitly keeps the discard on unless it is turned off."""
    if logit_store is None:
        fast = few_rows and group > 1 and nvidia
        return ("asm" if fast else "late"), (not fast if logit_discard is None else logit_discard)
    return logit_store, (True if logit_discard is None else logit_discard)


MERGE_WARPS = 4  # the merge kernel's warps (session 36's probe of the long tail's finish)
FINISH_EARLY = True  # False: the finish in the split kernel loads the length again, then its loads in turn (before
#                      session 36; the A/B's "old")
MERGE_APART = True  # False: each merge-kernel program merges a slice and scores a chunk (before session 32)
MERGE_ONE_PASS = True  # False: the merge reads the splits' maxima, then everything again (before session 32)


def merge_apart(rows: int, group: int, capacity: int) -> bool:
    """Whether the merge kernel gives its merge slices and its statistic's chunks to different programs
    (``MERGE_APART``): at most 24 (slot, KV head) rows, not with 8+ query heads per KV head past 8,192 tokens.
    Session 32's H100 check of the long tail with the statistic: one slot (8 rows) at 2k-8k tokens 0.74-0.95x the
    joint merge's time, at 32k 0.94-0.98x (but 1.02x at 8 query heads of head_dim 128), 24 rows (3 slots x 12k)
    0.96x; with 8 query heads per KV head at 32-64 rows 0.99-1.014x and at 2 slots x 16k 0.99x."""
    return MERGE_APART and rows <= 24 and not (group >= 8 and capacity > 8192)


def merge_one_pass(splits: int, merge_sb: int, flat: int, few_rows: bool) -> bool:
    """Whether a merge of ``splits`` splits reads them in one load (``MERGE_ONE_PASS``): every split in one step
    of ``merge_sb``, and a head's (query head, dim) elements ``flat`` under 1,024 (session 32's H100 check of the
    long tail, one pass against two: attention alone at 8 query heads per KV head of head_dim 128 0.7-2.5% longer,
    left out; elsewhere attention alone 0.84-1.01x, the statistic (one pass alone) 0.90-1.03x, and under both rules
    0.74-1.01x), with fewer (slot, head) rows than SMs (``few_rows``): the long tail that was measured."""
    return MERGE_ONE_PASS and few_rows and splits > 1 and max(2, pow2(splits)) <= merge_sb and flat < 1024
