"""A decode layer's kernels as a chain of programmatic dependent launches, its four projections Triton GEMMs.

Inside a decode layer the kernels run back to back, each waiting for the previous one to end: the next kernel's
launch and first loads are latency on the critical path. On Hopper a kernel launched as a programmatic dependent
launch (PDL) may start while the previous one still runs and waits for it in the kernel (``gdc_wait``,
PTX ``griddepcontrol.wait``), once the previous kernel has signalled its dependents (``gdc_launch_dependents``) or
ended. cuBLAS's kernels neither wait nor signal that way, so the chain needs kvroll's own kernels on both sides of
each boundary. With ``linear_pdl`` for the projections (qkv and gate_up whole; o and down as 2 K slices' fp32
partials, ``split_k``'s contract, which ``add_rms_norm`` adds), a chained layer's kernels are kvroll's:

    add_rms_norm -> qkv -> rotary (+ cache write) -> attention -> o -> add_rms_norm -> gate_up (+ SiLU * up) -> down

and each is a PDL launch that waits for its predecessor before it reads or writes anything, in every program, and
lets its successor launch early (the GEMMs right after their wait up to 64 rows, ``gemm_signal_early``, else once
their products are done; the rotary at each program's end where ``rotary_signal_late`` says so, else at once;
``add_rms_norm`` and the decode kernel at once). The decode kernel joins where ``attention_pdl`` says so (else a
plain launch), and o or down stays one cuBLAS call where
``split_k.split_k_parts`` asks for one slice (the last layer's down; o of models wider than 2,560 past 16 rows).
A layer is chained where its joined qkv and gate_up weights take the GEMM (``fused_add_norm._chained``). Each
kernel's wait also covers every earlier kernel: the previous one could not end before its own wait returned. A
kernel outside the chain (cuBLAS, torch) neither signals early nor waits in the kernel: a boundary with one is an
ordinary one.

    chain_applies(x, weight, bias, parts, silu_mul)  # whether linear_pdl takes the projection (shape, dtype, device)
    y = linear_pdl(x, weight)                  # x [..., K] @ weight [N, K]^T, bf16 / fp16, a PDL launch
    partials = linear_pdl(x, weight, parts=2)  # [2, ..., N] fp32 over K's halves (split_k.linear_parts's)
    act = linear_pdl(x, gate_up, silu_mul=True)  # silu_mul.silu_mul(x @ gate_up^T) [..., N / 2], one launch

Numerics: fp32 accumulation over K in 128- or 256-wide steps, one rounding to the input's dtype (or fp32 partials,
summed and rounded once by ``add_rms_norm``), as ``F.linear``; the K reduction's order may differ from cuBLAS's, so
outputs are equal up to a rounding. PDL changes no value: the GPU tests compare it with plain launches bit for bit.

Where (``gemm_config``; session 24 on an H100, ``benchmarks/pdl_gemm_probe.py`` and the engine's A/B,
docs/benchmarks/engine_throughput.md): at most 64 rows, or 128 for the shapes of ``SHAPE_TILES`` (Qwen3-1.7B's,
Qwen3-0.6B's and Llama-3.2-1B's, with the rows in tiles of 64; sessions 27-28), compute capability 9.x (PDL needs
9.0+; other GPUs not measured), half precision, no bias, row-major weights, and only the input widths it was
measured at (``CHAIN_WIDTHS``: Qwen3-1.7B's, Qwen3-0.6B's and Llama-3.2-1B's), or at <= 32 rows the projection
shapes it was measured at (``FEW_ROWS_SHAPES``: Qwen3-4B's and Qwen3-8B's; at 33-64 rows too, ``SHAPE_TILES``);
other models keep cuBLAS.

In the engine (Qwen3-1.7B, budget 1,024) the whole chain against cuBLAS and plain launches: LongFlow's step 7.1%,
1.2%, 2.4%, 2.6%, 4.2% and 3.4% shorter at batches 1, 8, 16, 32, 48 and 64, SnapKV's 3.2% at 64 (session 24).
Session 25 (random weights, LongFlow at batches 1 and 64): Qwen3-0.6B 8.0% and 3.0% shorter, Llama-3.2-1B 5.9%
and 0.5%; Qwen3-4B 3.7% shorter at 1 but 8.8% longer at 64, so its widths are not listed. Session 26: Qwen3-4B's
and 8B's shapes chained at <= 32 rows (1.9-5.1% shorter steps at batches 1-32); SiLU * up in gate_up's epilogue
(``SILU_EPILOGUE``; 8 kernels per chained layer instead of 9): LongFlow's step 1.1%, 1.9%, 1.2% and 0.7% shorter
at batches 1, 8, 32 and 64 (Qwen3-1.7B), 1.1% at 64 on Llama-3.2-1B. The epilogue rounds each product to the
dtype before ``silu_mul``'s math, so its output is ``silu_mul`` of the GEMM's, bit for bit on an H100 (the GPU
test). Session 27: Qwen3-1.7B's projections chained at 65-128 rows too, each with its own tile over row tiles of
64 (``SHAPE_TILES``): LongFlow's step 1.8-2.6% shorter at batches 72-128, SnapKV's 1.9% and Hard-KV's 2.4% at
128; at 256 rows 0.2% longer, so not chained there. Qwen3-4B's at 33-56 rows with their own tiles: 2.4-5.2%
shorter at batches 40-56 (0.7% longer at 64). Session 28: Qwen3-0.6B's and Llama-3.2-1B's at 65-128 rows (2.6-3.9%
shorter at batches 80 and 128), Qwen3-8B's at 33-64 (3.2% at 40; 3.1% at 64 with the decode kernel's PDL launch,
3.0% with the plain launch the group rule took there until session 30); the decode kernel a plain launch at 512-1,023
rows with more than 2 query heads per KV head (``attention_pdl``; since session 30 a PDL launch after the rotary's late
signal there), which takes Qwen3-4B's chain to 64 rows (2.5% shorter than
cuBLAS there) and Llama-3.2-1B's step at batch 64 2.5% shorter. Session 30: the GEMMs' early signal at <= 64 rows
(``gemm_signal_early``: LongFlow's step 1.8-3.3% shorter at batches 1-32 on Qwen3-1.7B, 1.5% on Qwen3-4B at 16) and
the rotary's late signal before a decode kernel launched as PDL where it had been plain (``rotary_signal_late``:
0.6-1.4% shorter at 128-512 rows on four architectures).
"""
from __future__ import annotations

import functools
import re

import torch

from kvroll.kernels.decode_launch import pdl_ok

try:  # Triton is optional on CPU-only installs
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - the chain then never applies
    gdc_launch_dependents = gdc_wait = None

PDL_CHAIN = True  # False: cuBLAS for qkv / gate_up and plain launches (before session 24; the engine A/B's "old")
PDL_LAUNCH = True  # False: the chain's kernels launched plainly (the GPU test's reference)
ATTN_PDL = True  # False: the decode kernel stays a plain launch inside the chain (an A/B switch)
GEMM_SIGNAL_EARLY = True  # False: the chain's GEMM lets its successor launch after its K loop (sessions 24-29)
ROTARY_LATE = True  # False: session 28's rule (the rotary signals at once; the decode kernel plain where that lost)
# the K (input widths) per slice count the chain was measured at and gained: Qwen3-1.7B (hidden 2,048, MLP 6,144;
# session 24), Qwen3-0.6B (hidden 1,024, attention 2,048, MLP 3,072) and Llama-3.2-1B (hidden 2,048, MLP 8,192;
# session 25). Not Qwen3-4B's (2,560 / 4,096 / 9,728): its step at batch 64 took 8.8% longer with the chain (its
# projections' tiles make 1.15-1.45 waves of programs); it takes the chain at few rows (FEW_ROWS_SHAPES below). A
# model of other widths keeps cuBLAS until measured.
CHAIN_WIDTHS = {1: (1024, 2048), 2: (2048, 3072, 6144, 8192)}
# the weight shapes [N, K] per slice count chained at <= FEW_ROWS rows only (session 26, LongFlow's step with the
# chain against without at batches 1, 8, 16 and 32): Qwen3-4B's qkv, gate_up, o and down (-4.6%, -1.9%, -2.4%,
# -3.1%) and Qwen3-8B's (-5.1%, -2.2%, -3.2%, -2.3%); at 64 rows Qwen3-4B's tiles lost (session 25: +8.8%). Shapes,
# not widths: a projection of another model takes it only where its shape is one of these. Llama-3-8B's qkv and o
# are Qwen3-8B's, its MLP's are not: since session 28 such a layer is not chained at all (fused_add_norm._chained
# asks for the gate_up too), as a mixed layer was never measured.
FEW_ROWS_SHAPES = {1: ((6144, 2560), (19456, 2560), (6144, 4096), (24576, 4096)),
                   2: ((2560, 4096), (2560, 9728), (4096, 4096), (4096, 12288))}
FEW_ROWS = 32
WIDTH_ROWS = 64  # the width rule's (CHAIN_WIDTHS) rows; past them only SHAPE_TILES' shapes
MAX_ROWS = 128  # past 64 rows only the shapes of SHAPE_TILES (session 27); 256 rows measured slower (+0.2%)
SHAPE_CHAIN = True  # False: no SHAPE_TILES (the chain of session 26: <= 64 rows; the A/B's "old" of session 27)
# tiles per projection shape and range of rows: {((first row, last row), N, K, parts, silu_mul): (BLOCK_N, BLOCK_K,
# num_warps, num_stages, BLOCK_M)}, the rows in tiles of BLOCK_M. Session 27's H100 probe
# (benchmarks/chain_tiles_probe.py --wide: each product alone, 20 tiles, against cuBLAS) chose the tiles, the
# engine's A/B (LongFlow, SHAPE_CHAIN = False the old) the ranges.
# - Qwen3-1.7B at 65-128 rows (c2, at 128): qkv 9.78 us (cuBLAS 9.43), o in 2 K slices 6.83 (6.81), gate_up with
#   SiLU * up 23.25 (cuBLAS's gate_up and silu_mul 24.89), down in 2 K slices 13.39 (13.00). The chain then took
#   LongFlow's step 1.8-2.6% shorter at batches 72-128, SnapKV's 1.9% and Hard-KV's 2.4% at 128 (c2, c3). At 256 rows
#   the best tiles were 1.0-1.25x cuBLAS's time and the step 0.2% longer: not chained.
# - Qwen3-4B at 33-64 rows (c3, at 64 rows: qkv 14.01 (14.89), o 10.88 (10.92), gate_up with SiLU * up 39.52
#   (42.32), down 22.10 (21.58); o, gate_up and down equal to cuBLAS's products, c4): LongFlow's step 4.6%, 5.2%
#   and 2.4% shorter at batches 40, 48 and 56, but 0.7% longer at 64 (c4, c5), where the range ended. Session 28
#   (c6, c8): that loss was the decode kernel's PDL launch at 512 rows; with it a plain launch (attention_pdl's
#   group rule) the chain took the step at 64 2.5% shorter than cuBLAS (7.194-7.198 ms against 7.379).
# - Session 28 (the same probe, at 128 rows for the first two, 48 and 64 for Qwen3-8B; LongFlow's step against
#   SHAPE_CHAIN = False in one call each, c2-c4):
#   - Qwen3-0.6B at 65-128 rows: qkv 6.35 (6.35), o 4.88 (5.32), gate_up with SiLU * up 9.46 (9.48), down 6.22
#     (6.25); the step 3.9% and 2.9% shorter at batches 80 and 128.
#   - Llama-3.2-1B at 65-128 rows (its o is Qwen3-1.7B's shape and entry): qkv 8.75 (8.18), o 6.79 (6.77), gate_up
#     with SiLU * up 28.45 (32.08), down 16.73 (16.16); the step 3.4% and 2.6% shorter at batches 80 and 128. Its
#     gate_up takes Qwen3-1.7B's 128 x 64 tile over rows of 64, not the probe's best 128 x 128 over rows of 128
#     (28.22): 0.8% apart at 128 rows, and at 65-96 rows a 128-row tile would compute up to twice the rows.
#   - Qwen3-8B at 33-64 rows (at 64: qkv 20.71 (20.55), o 15.02 (15.58), gate_up with SiLU * up 72.92 (77.69),
#     down 38.74 (39.12)); the step 3.2% and 3.1% shorter at batches 40 and 64 (at 64 with the decode kernel's PDL
#     launch, which session 28's group rule left out there: 0.3% longer, c8; since session 30 a PDL launch after the
#     rotary's late signal, rotary_signal_late). Its plain gate_up keeps 4
#     stages, the best at 48 rows (5 stages 0.5% faster at 64).
# A plain gate_up entry (silu_mul False) serves only SILU_EPILOGUE = False, the A/B switch; alone its GEMM is not
# faster than cuBLAS's at Qwen3-1.7B's, Qwen3-0.6B's and Llama-3.2-1B's shapes (23.32 / 9.26 / 29.06 us against
# 22.15 / 7.82 / 28.72 at 128 rows). Other shapes keep the width rule (CHAIN_WIDTHS, FEW_ROWS_SHAPES) or cuBLAS.
_R65, _R33 = (65, 128), (FEW_ROWS + 1, 64)
SHAPE_TILES = {(_R65, 4096, 2048, 1, False): (64, 128, 4, 5, 64), (_R65, 2048, 2048, 2, False): (64, 128, 4, 5, 64),
               (_R65, 12288, 2048, 1, False): (128, 64, 4, 4, 64), (_R65, 12288, 2048, 1, True): (128, 64, 4, 4, 64),
               (_R65, 2048, 6144, 2, False): (64, 128, 4, 5, 64),
               (_R33, 6144, 2560, 1, False): (64, 128, 4, 5, 64), (_R33, 2560, 4096, 2, False): (64, 128, 4, 5, 64),
               (_R33, 19456, 2560, 1, False): (128, 64, 4, 4, 64), (_R33, 19456, 2560, 1, True): (128, 64, 4, 4, 64),
               (_R33, 2560, 9728, 2, False): (64, 128, 4, 5, 64),
               (_R65, 4096, 1024, 1, False): (64, 128, 4, 5, 64), (_R65, 1024, 2048, 2, False): (32, 128, 4, 5, 64),
               (_R65, 6144, 1024, 1, False): (128, 128, 4, 3, 64), (_R65, 6144, 1024, 1, True): (128, 128, 4, 3, 64),
               (_R65, 1024, 3072, 2, False): (32, 128, 4, 5, 64),
               (_R65, 3072, 2048, 1, False): (64, 128, 4, 5, 64),
               (_R65, 16384, 2048, 1, False): (128, 64, 4, 4, 64), (_R65, 16384, 2048, 1, True): (128, 64, 4, 4, 64),
               (_R65, 2048, 8192, 2, False): (64, 128, 4, 5, 64),
               (_R33, 6144, 4096, 1, False): (64, 128, 4, 5, 64), (_R33, 4096, 4096, 2, False): (64, 128, 4, 5, 64),
               (_R33, 24576, 4096, 1, False): (64, 128, 4, 4, 64), (_R33, 24576, 4096, 1, True): (64, 128, 4, 5, 64),
               (_R33, 4096, 12288, 2, False): (64, 128, 4, 5, 64)}
# Deeper pipelines on an H200 (``H200_TILES`` on; ``device_tiles``): {((first row, last row), N, K, parts, silu_mul):
# (BLOCK_N, BLOCK_K, num_warps, num_stages)}, replacing the rule's tile on that GPU only. Session 40's H200 probe
# (benchmarks/chain_tiles_probe.py --deep, each product alone, weights streamed; docs/benchmarks/engine_throughput.md):
# an H200 streams ~1.4x an H100's bytes a second on the same 132 SMs, so a program needs more bytes in flight.
# Qwen3-1.7B's gate_up with SiLU * up in 128 x 128 tiles at 4 stages, not 3: 15.96 / 15.21 us against 17.38 / 16.63
# at 64 / 32 rows; its down (2 K slices) in 32 x 128 tiles at 8 stages: 9.55 us against the rule's 10.10 at 64 rows
# (at 32 rows no gain: 10.76 against 10.52). The deeper tiles were not measured on an H100, which keeps the rule's.
H200_TILES = {((17, 64), 12288, 2048, 1, True): (128, 128, 4, 4),
              ((33, 64), 2048, 6144, 2, False): (32, 128, 4, 8)}
DEVICE_TILES = True  # False: an H200 takes the H100's tiles (the A/B's "old" of session 40)
SPLIT_CHAIN = True  # False: o and down stay cuBLAS's batched products (the A/B's "old" of the split GEMMs)
SILU_EPILOGUE = True  # False: the chained MLP's SiLU * up its own kernel (silu_mul) after gate_up's GEMM


def chain_rows(rows: int) -> bool:
    """Whether a decode step of ``rows`` rows may run its layers as the chain (``PDL_CHAIN`` on, 1 to ``MAX_ROWS``
    rows, 64 with ``SHAPE_CHAIN`` off; a layer is chained where ``chain_applies`` takes its qkv weight too:
    ``FEW_ROWS_SHAPES``' models at <= ``FEW_ROWS`` rows, ``SHAPE_TILES``' shapes in their ranges). The
    non-GEMM kernels (``add_rms_norm``, the decode kernel) are PDL launches only in a chained layer: at 128 rows,
    with cuBLAS's projections on either side, their PDL launches alone made LongFlow's step 0.55% longer (session
    24, c6)."""
    return PDL_CHAIN and 1 <= rows <= (MAX_ROWS if SHAPE_CHAIN else WIDTH_ROWS)


def early_signal(slots: int, kv_heads: int, group: int) -> bool:
    """Where the decode kernel's PDL launch gained with the rotary kernel signalling it at once (session 28's rule):
    its (slot, KV head) rows number at most 64, or at least 512 with at most 2 query heads per KV head (``group``),
    or at least 1,024. Elsewhere (65-511 rows, and 512-1,023 with more groups) that launch lost (the measurements:
    ``attention_pdl``); there the rotary signals at each program's end (``rotary_signal_late``)."""
    rows = slots * kv_heads
    return rows <= 64 or rows >= 1024 or (rows >= 512 and group <= 2)


def rotary_signal_late(slots: int, kv_heads: int, group: int) -> bool:
    """Whether a chained layer's rotary kernel (a PDL launch) lets the decode kernel launch only at each of its
    programs' end instead of at once (``ROTARY_LATE`` and ``ATTN_PDL`` on, ``chain_rows``): where ``early_signal``
    does not hold. Session 30's H100 A/B (LongFlow, the decode kernel a PDL launch after the late signal against
    session 28's rule, a plain launch there; one call each, raw/s29/c9 and raw/s30/c1): Qwen3-1.7B's step 1.2%,
    1.2% and 0.7% shorter at batches 16, 32 and 48 (128-384 rows), Llama-3.2-1B's 0.8% and Qwen3-4B's 0.6% at 64
    (512 rows, 4 query heads per KV head). Where ``early_signal`` holds the early signal stays: at Qwen3-1.7B's
    batch 64 the late one took 0.7% more (c9)."""
    return ATTN_PDL and ROTARY_LATE and chain_rows(slots) and not early_signal(slots, kv_heads, group)


def attention_pdl(slots: int, kv_heads: int, group: int) -> bool:
    """Whether the decode kernel of a chained step (``chain_rows``; the cache asks only after a chained layer's
    rotary, ``rotary_pdl``) is a PDL launch too (``ATTN_PDL`` on): everywhere with ``ROTARY_LATE`` (session 30:
    where ``early_signal`` does not hold, after the rotary's late signal, ``rotary_signal_late``); with it off,
    session 28's rule, ``early_signal``: where its (slot, KV head) rows number at most 64,
    or at least 512 with at most 2 query heads per KV head (``group``), or at least 1,024. Session 24's H100 A/B
    (LongFlow, Qwen3-1.7B, 8 KV heads; ``ATTN_PDL`` False the old, c9): at 512 rows (batch 64) the step took 1.5%
    less; at 128 and 256 rows (batches 16, 32) 6.1% and 8.2% more, where the kernel's programs make about one wave
    (the early programs of its neighbours then take its SMs); at 384 rows (batch 48) the chain with it took 0.45%
    more than no chain, without it 2.3% less (c10); at 8 and 64 rows (batches 1, 8) the whole chain with it took
    7.1% and 1.2% less (c8). Session 28 (c7, c8; LongFlow, 8 KV heads): with 2 query heads per KV head it took the
    step 0.96% / 0.59% less at 512 / 1,024 rows on Qwen3-1.7B, 1.13% / 0.73% on Qwen3-0.6B; with 4, at 512 rows
    3.6% more on Qwen3-4B (head_dim 128) and 2.5% more on Llama-3.2-1B (head_dim 64), 0.3% less on Qwen3-8B (the
    same attention shape as Qwen3-4B's, twice each in alternating order), and 0.85% less on Llama-3.2-1B at 1,024
    rows. At 513-1,023 rows with 4 only the PDL launch was measured (Llama-3.2-1B at batch 80, c4, the chain against
    cuBLAS); the plain launch there follows the 512 rows' result. Session 29's timeline of a graph replay at batch 64
    (benchmarks/pdl_timeline_probe.py, c7): as a PDL launch Qwen3-4B's decode kernel took 108.9 us a layer against
    98.9 plain, Qwen3-8B's 98.7 against 99.0. Qwen3-8B's o is cuBLAS's (split_k: one slice past 16 rows), Qwen3-4B's
    the chain's GEMM, launched with the decode kernel; but with o signalled only at each decode program's end the
    PDL launch still lost as much (c8: Qwen3-4B +3.3%; Qwen3-1.7B +6.6% at 128 and 256 rows), so the decode kernel's
    own early start is what costs. With the rotary signalling it only at each of its programs' end, Qwen3-1.7B at
    batch 16 took 1.2% less than plain, at 64 0.7% more than the early signal (c9); session 30 finished that A/B
    and took the late signal where the early one lost (``rotary_signal_late``)."""
    return ATTN_PDL and chain_rows(slots) and (ROTARY_LATE or early_signal(slots, kv_heads, group))


def gemm_signal_early(rows: int) -> bool:
    """Whether the chain's GEMM (``linear_pdl``, a PDL launch) lets its successor launch right after its own wait
    instead of after its K loop, its products done (``GEMM_SIGNAL_EARLY`` on): at most ``WIDTH_ROWS`` (64) rows.
    The successor (the rotary, ``add_rms_norm``, the next GEMM, or ``silu_mul`` with ``SILU_EPILOGUE`` off) still
    waits for the GEMM's end before it reads; a plain launch after it (cuBLAS's last down, a torch op) waits for it
    to end anyway. So no value changes. Session 30's H100 A/B (LongFlow, Qwen3-1.7B unless named; one call each,
    raw/s30 c3-c5): the step 1.8%, 3.3%, 3.1%, 2.1%, 0.5% and 0.1% shorter at batches 1, 8, 16, 32, 48 and 64,
    Qwen3-4B's and Qwen3-8B's 1.5% at 16, Hard-KV's 0.5% at 64, Llama-3.2-1B's unchanged at 16 (1.452 ms both); at
    128 rows (``SHAPE_TILES``' row tiles) 0.3% longer, so not there."""
    return GEMM_SIGNAL_EARLY and rows <= WIDTH_ROWS


def gemm_config(m: int, n: int, k: int, parts: int = 1, silu_mul: bool = False,
                device=None) -> tuple[int, ...] | None:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) of ``linear_pdl`` for [m, k] @ [n, k]^T in ``parts`` K slices,
    or None where it does not apply (more rows than ``chain_rows`` takes, shapes the tiles do not divide, fewer than
    64 programs); ``shape_tiles`` where it has the shape (a fifth entry, BLOCK_M: measured tiles, whose divisibility
    and program counts a test checks), else None past 64 rows.
    Session 24's H100 sweeps (Qwen3-1.7B's projections at 1, 8 and 64 rows, each product timed alone with its
    weight streamed from memory, against cuBLAS): qkv (N = 4,096) best at 32 x 256 tiles, 4 stages, 8.2-8.7 us
    against cuBLAS's 8.6-8.7; gate_up (N = 12,288) at 32 x 128 and 4 stages at <= 8 rows, 128 x 128 and 3 stages at
    64 (19.1-20.9 us against 19.6-20.9); in 2 K slices o (K/2 = 1,024) at 32 x 128 and 5 stages (5.8-6.0 us against
    cuBLAS's batched 5.9-6.5), down (K/2 = 3,072) at 32 x 256 and 5 stages, 4 at 64 rows (11.5-12.3 against
    11.6-12.3).

    ``silu_mul`` (gate_up with SiLU * up in its epilogue; each program two accumulators of BLOCK_N / 2 columns):
    128 x 128 tiles and 3 stages past 16 rows where they make at least 64 programs, else 64 x 128 (session 26's
    probe, ``benchmarks/mlp_chain_probe.py``: the MLP's chain per layer at 1-64 rows, Qwen3-1.7B, 31.6-34.4 us
    against 31.9-35.5 with ``silu_mul`` its own kernel; the plain rule's 32-wide tiles lost at <= 16 rows, and
    its 32 x 256 tiles need more shared memory than an H100 has at 64 rows).

    ``device``: on an H200, ``device_tiles``' deeper pipelines where it has the shape (session 40); None or another
    GPU: the rule above."""
    if not chain_rows(m) or parts not in (1, 2) or (silu_mul and parts != 1):
        return None
    tiles = device_tiles(m, n, k, parts, silu_mul, device) or shape_tiles(m, n, k, parts, silu_mul)
    if tiles is not None or m > WIDTH_ROWS:  # a measured shape's own tiles (the rows in tiles of BLOCK_M), or cuBLAS
        return tiles
    if silu_mul:
        cfg = (128, 128, 4, 3) if m > 16 and n // 128 >= 64 else (64, 128, 4, 3)
    elif parts == 2:  # o and down as 2 K slices' fp32 partials (split_k.py's contract)
        cfg = (32, 128, 4, 5) if k // 2 <= 1024 else (32, 256, 4, 5 if m <= 16 else 4)
    elif n <= 6144:
        cfg = (32, 256, 4, 4)
    else:
        cfg = (32, 128, 4, 4) if m <= 16 else (128, 128, 4, 3)
    block_n, block_k = cfg[:2]
    return cfg if n % block_n == 0 and k % (parts * block_k) == 0 and parts * n // block_n >= 64 else None


def shape_tiles(m: int, n: int, k: int, parts: int = 1, silu_mul: bool = False) -> tuple[int, ...] | None:
    """``SHAPE_TILES``' tile for [m, k] @ [n, k]^T in ``parts`` K slices where its range holds m rows
    (``SHAPE_CHAIN`` on), or None."""
    return _table_tile(SHAPE_TILES, m, n, k, parts, silu_mul) if SHAPE_CHAIN else None


def _table_tile(table: dict, m: int, n: int, k: int, parts: int, silu_mul: bool) -> tuple[int, ...] | None:
    """The entry of a {((first row, last row), N, K, parts, silu_mul): tile} table whose range holds m rows."""
    return next((cfg for (rng, *key), cfg in table.items()
                 if rng[0] <= m <= rng[1] and tuple(key) == (n, k, parts, silu_mul)), None)


def device_tiles(m: int, n: int, k: int, parts: int, silu_mul: bool, device) -> tuple[int, ...] | None:
    """``H200_TILES``' tile for [m, k] @ [n, k]^T where ``device`` is an H200 (its name says so) and the entry's range
    holds m rows (``DEVICE_TILES`` on), else None."""
    if not DEVICE_TILES or not on_h200(device):
        return None
    return _table_tile(H200_TILES, m, n, k, parts, silu_mul)


def on_h200(device) -> bool:
    """Whether ``device`` is a CUDA device named as an H200 (``h200_name``); None or a CPU: no."""
    return device is not None and torch.device(device).type == "cuda" and _is_h200(_index(device))


def _index(device) -> int:
    """A CUDA device's index (the current device's for a bare 'cuda')."""
    device = torch.device(device)
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _is_h200(index: int) -> bool:
    return h200_name(torch.cuda.get_device_properties(index).name)


def h200_name(name: str) -> bool:
    """Whether a CUDA device name is an H200's ("NVIDIA H200", "NVIDIA H200 NVL"), not a GH200's (a Grace Hopper
    superchip, whose memory and clocks differ; not measured)."""
    return re.search(r"(?<![A-Za-z0-9])H200(?![0-9])", name) is not None


def gemm_available(device) -> bool:
    """Where ``linear_pdl`` serves the chain: an NVIDIA GPU of compute capability 9.x (where it was measured, an
    H100), Triton with ``gdc_wait`` and ``launch_pdl``, not the interpreter."""
    device = torch.device(device)
    if triton is None or device.type != "cuda":
        return False
    return _hopper(_index(device))


@functools.lru_cache(maxsize=None)
def _hopper(index: int) -> bool:
    # pdl_ok: NVIDIA (not ROCm), not the interpreter, Triton's gdc_wait and launcher's ``launch_pdl``, 9.0+
    device = torch.device("cuda", index)
    return pdl_ok(device) and torch.cuda.get_device_capability(device)[0] == 9


def pdl_available(device) -> bool:
    """Whether the chain's kernels are launched as programmatic dependent launches on ``device``: ``PDL_CHAIN``
    and ``PDL_LAUNCH`` on, and ``gemm_available``. (``PDL_LAUNCH = False`` keeps the chain's kernels but launches
    them plainly: the same values, the tests' check of the launches' ordering.)"""
    return PDL_CHAIN and PDL_LAUNCH and gemm_available(device)


def chain_applies(x: torch.Tensor, weight: torch.Tensor, bias=None, parts: int = 1, silu_mul: bool = False) -> bool:
    """Whether the projection x [..., K] @ weight^T (in ``parts`` K slices; ``silu_mul``: with SiLU * up in its
    epilogue, ``SILU_EPILOGUE`` on) takes ``linear_pdl``: ``PDL_CHAIN`` on (and ``SPLIT_CHAIN`` for slices),
    ``gemm_available``, half precision, no bias, a row-major weight, a K the chain was measured at
    (``CHAIN_WIDTHS``; ``FEW_ROWS_SHAPES`` at <= ``FEW_ROWS`` rows; ``SHAPE_TILES``' shapes in their ranges), rows
    and shape ``gemm_config`` covers."""
    if not PDL_CHAIN or (parts > 1 and not SPLIT_CHAIN) or (silu_mul and not SILU_EPILOGUE) or bias is not None \
            or x.dtype not in (torch.float16, torch.bfloat16) \
            or weight.dtype != x.dtype or weight.dim() != 2 or weight.stride(1) != 1 \
            or weight.stride(0) != weight.shape[1] or x.shape[-1] != weight.shape[1] or x.stride(-1) != 1:
        return False
    rows = x.numel() // max(1, x.shape[-1])
    k = weight.shape[-1]
    if k not in CHAIN_WIDTHS.get(parts, ()) \
            and not (rows <= FEW_ROWS and tuple(weight.shape) in FEW_ROWS_SHAPES.get(parts, ())) \
            and shape_tiles(rows, weight.shape[0], k, parts, silu_mul) is None:
        return False
    return gemm_config(rows, weight.shape[0], weight.shape[1], parts, silu_mul, x.device) is not None \
        and gemm_available(x.device)


def launch_options(pdl: bool) -> dict:
    """Triton launch keywords of a kernel in the chain: a PDL launch where ``pdl``."""
    return {"launch_pdl": True} if pdl else {}


if triton is not None:

    @triton.jit
    def _gemm_kernel(x_ptr, w_ptr, y_ptr, M, N, K, k_part, stride_x, stride_w, stride_y, stride_part,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
                     SWIGLU: tl.constexpr = False, ROW_TILES: tl.constexpr = 1, EARLY: tl.constexpr = False):
        # SWIGLU: w is [gate; up] [2I, K] (N = 2I); the program's BLOCK_N weight rows are gate's and up's rows
        # [pid * BLOCK_N / 2, (pid + 1) * BLOCK_N / 2), two accumulators, and it writes silu_mul's [M, I] columns.
        # ROW_TILES > 1: the rows in tiles of BLOCK_M, the programs of one weight tile adjacent in the grid (so they
        # run together and the weight tile comes from memory once, then from L2).
        pid, part = tl.program_id(0), tl.program_id(1)  # part: the K slice [part * k_part, (part + 1) * k_part)
        HALF: tl.constexpr = BLOCK_N // 2
        if ROW_TILES > 1:
            offs_m = (pid % ROW_TILES) * BLOCK_M + tl.arange(0, BLOCK_M)
            pid = pid // ROW_TILES
        else:
            offs_m = tl.arange(0, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        m_mask = offs_m < M
        k_lo = part * k_part
        if SWIGLU:
            offs_n = pid * HALF + tl.arange(0, HALF)  # gate's rows; up's are N / 2 further
        else:
            offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_w
        if SWIGLU:
            u_rows = w_rows + (N // 2).to(tl.int64) * stride_w
        if PDL:  # x comes from the previous kernel: wait for its end (and every earlier kernel's) first
            gdc_wait()
            if EARLY:  # the next kernel may launch now; it waits for this grid's end before it reads y
                gdc_launch_dependents()
        acc = tl.zeros([BLOCK_M, HALF if SWIGLU else BLOCK_N], tl.float32)
        if SWIGLU:
            acc_u = tl.zeros([BLOCK_M, HALF], tl.float32)
        for k0 in range(k_lo, k_lo + k_part, BLOCK_K):
            x = tl.load(x_ptr + offs_m[:, None] * stride_x + (k0 + offs_k)[None, :], mask=m_mask[:, None], other=0.0)
            w = tl.load(w_rows + (k0 + offs_k)[None, :])
            acc += tl.dot(x, tl.trans(w))
            if SWIGLU:
                u = tl.load(u_rows + (k0 + offs_k)[None, :])
                acc_u += tl.dot(x, tl.trans(u))
        if PDL and not EARLY:  # the next kernel may launch; it waits for this grid's end before it reads y
            gdc_launch_dependents()
        if SWIGLU:  # silu_mul's rounding: each product rounded to the dtype, silu in fp32 rounded, one product
            g = acc.to(y_ptr.dtype.element_ty).to(tl.float32)
            act = (g / (1.0 + tl.exp(-g))).to(y_ptr.dtype.element_ty).to(tl.float32)
            out = act * acc_u.to(y_ptr.dtype.element_ty).to(tl.float32)
            tl.store(y_ptr + offs_m[:, None] * stride_y + offs_n[None, :], out.to(y_ptr.dtype.element_ty),
                     mask=m_mask[:, None])
        else:
            tl.store(y_ptr + part * stride_part + offs_m[:, None] * stride_y + offs_n[None, :],
                     acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None])


def linear_pdl(x: torch.Tensor, weight: torch.Tensor, pdl: bool | None = None, parts: int = 1,
               config: tuple[int, ...] | None = None, silu_mul: bool = False) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T -> [..., N] in x's dtype, one Triton launch (a PDL launch where ``pdl``; None:
    ``pdl_available``). Rows and shape must be ``gemm_config``'s (``chain_applies`` says so). ``parts`` > 1: the
    fp32 partial products over that many K slices, [parts, ..., N], as ``split_k.linear_parts`` returns them (for
    ``add_rms_norm`` to add). ``config``: (BLOCK_N, BLOCK_K, num_warps, num_stages[, BLOCK_M]) instead of the
    rule's (BLOCK_M: the rows in tiles of that many; else one tile of all rows).
    ``silu_mul``: weight is the fused MLP's [gate; up] (N = 2I) and the result ``silu_mul.silu_mul`` of the
    product, [..., I], in the same launch (rounded as ``silu_mul`` rounds the product's bf16 / fp16 values)."""
    assert triton is not None, "linear_pdl needs Triton"
    k = x.shape[-1]
    n = weight.shape[0]
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    cfg = config or gemm_config(m, n, k, parts, silu_mul, x.device)
    assert cfg is not None, f"linear_pdl: [{m}, {k}] @ [{n}, {k}]^T in {parts} K slices: not a shape gemm_config covers"
    assert weight.shape[1] == k and weight.stride(1) == 1 and weight.stride(0) == k, "weight: row-major [N, K]"
    assert rows.stride(-1) == 1 and x.dtype == weight.dtype, (rows.stride(), x.dtype, weight.dtype)
    assert not silu_mul or parts == 1, "silu_mul: the whole product only"
    pdl = pdl_available(x.device) if pdl is None else pdl
    block_n, block_k, warps, stages = cfg[:4]
    block_m = cfg[4] if len(cfg) > 4 else max(16, triton.next_power_of_2(m))  # the rows' tile (default: all rows)
    assert block_m >= 16 and block_m & (block_m - 1) == 0, f"linear_pdl: BLOCK_M {block_m} (a power of two >= 16)"
    row_tiles = triton.cdiv(m, block_m)
    assert n % block_n == 0 and k % (parts * block_k) == 0, (n, k, parts, cfg)
    assert block_n >= (32 if silu_mul else 16), f"linear_pdl: BLOCK_N {block_n} (silu_mul: two halves of >= 16)"
    width = n // 2 if silu_mul else n
    out = torch.empty(parts, m, width, dtype=x.dtype if parts == 1 else torch.float32, device=x.device)
    _gemm_kernel[(row_tiles * n // block_n, parts)](
        rows, weight, out, m, n, k, k // parts, rows.stride(0), weight.stride(0), out.stride(1), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PDL=pdl, SWIGLU=silu_mul, ROW_TILES=row_tiles,
        EARLY=pdl and gemm_signal_early(m), num_warps=warps, num_stages=stages, **launch_options(pdl))
    return out.view(*x.shape[:-1], width) if parts == 1 else out.view(parts, *x.shape[:-1], n)
