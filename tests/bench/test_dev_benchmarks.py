"""Developer benchmarks on tiny shapes (CPU): they run, and what they compare agrees.

``benchmarks/event_profile.py`` times one compression event read as views (a slot span) and as gathered rows
(a device index, what a captured graph reads): both must keep the same tokens. ``benchmarks/event_keys.py``
counts the graph keys of a rollout's events as ``EventGraphs`` would split and key them.
"""
import types

import pytest

from benchmarks import event_keys, event_profile
from tests.conftest import needs_interpreter


@pytest.mark.parametrize("policy,budget,slots", [("hardkv", 64, 4), ("rkv", 64, 4), ("snapkv", 64, 4),
                                                ("lagkv", 512, 2)])  # LagKV: the host's compressed counts
def test_event_profile_span_and_index_events_keep_the_same_tokens(policy, budget, slots):
    args = types.SimpleNamespace(layers=2, budget=budget, warmup=2, reps=1, top=3)
    row = event_profile.run(policy, slots, args)
    assert row["span_checksum"] == row["index_checksum"]
    assert row["span_checksum"]["live_tokens"] > 0 and row["kernels"] > 0


def test_event_keys_counts_a_small_rollout():
    args = types.SimpleNamespace(budget=512, max_batch=8, prompts=2, group=4, max_new=600, vocab=512)
    row = event_keys.run("hardkv", args, event_keys.tiny_qwen3(args.vocab))
    assert row["events"] >= 4  # 8 rows, one compression every 128 steps
    assert 0 < row["keys"] <= row["events"] and row["graphs"] <= row["keys"]
    assert row["replayed"] <= row["events"] and row["completion_tokens_max"] <= 600


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=needs_interpreter),
                                    pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("m,n,k,prologue,cfg", [
    (5, 96, 256, None, {}),  # the default configuration
    (37, 130, 320, None, dict(split_k=3, block_k=64)),  # ragged rows, columns and K chunks: every mask
    (64, 128, 512, "silu_mul", dict(split_k=2)),
    (3, 64, 200, "silu_mul", dict(split_k=2, block_k=64)),
    (70, 64, 128, None, dict(split_k=1, block_m=32)),  # several row blocks, no split
])
def test_linear_splitk_experiment_is_the_fp32_product(m, n, k, prologue, cfg, device):
    """``benchmarks/linear_splitk_experiment.py`` (session 18's cuBLAS comparison), under the interpreter and on a
    GPU: the fp32 product of the (SiLU·mul'd) input; a second call is bit for bit the first (the partials are
    summed in split order whichever program arrives last: only a GPU, where programs race, can break that)."""
    import torch

    from benchmarks.linear_splitk_experiment import linear_splitk, linear_torch
    if device == "cuda" and prologue and m == 64:
        pytest.skip("its default tiles with the prologue need more shared memory than a Hopper SM has "
                    "(227 KB on an H100 or H200; session 28)")
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, 2 * k if prologue else k, generator=gen).to(device)
    w = torch.randn(n, k, generator=gen).to(device)
    y = linear_splitk(x, w, prologue, **cfg)
    torch.testing.assert_close(y, linear_torch(x, w, prologue), rtol=1e-5, atol=1e-4)
    assert torch.equal(y, linear_splitk(x, w, prologue, **cfg))


@needs_interpreter
@pytest.mark.parametrize("rows, n_q, n_k, head_dim, hidden, dtype, bias, norm, ring, config", [
    (5, 4, 2, 64, 96, "float32", False, True, True, None),  # K not a whole tile: the K mask
    (3, 2, 1, 128, 64, "float16", True, False, False, None),
    (20, 4, 2, 64, 128, "float16", False, True, False, (16, 32, 4, 4, 2)),  # split K, two row blocks
    (40, 2, 2, 64, 128, "float32", True, True, True, (32, 64, 2, 4, 2)),
])
def test_qkv_rotary_experiment_is_the_matmul_then_rotary(rows, n_q, n_k, head_dim, hidden, dtype, bias, norm, ring,
                                                         config, monkeypatch):
    """``benchmarks/qkv_rotary_experiment.py`` (session 21's comparison) under the interpreter: q, the K / V cache
    rows, ||v||_1 and the metadata of ``F.linear`` then ``rotary(..., write=)`` on the same inputs (q and the cache
    to a rounding of the matmul's output, the metadata exactly)."""
    import torch
    import torch.nn.functional as F

    from benchmarks import qkv_rotary_experiment as qr
    from kvroll.kernels.rotary import CacheWrite, rotary
    monkeypatch.setattr(qr, "CONFIG", None if config is None else {1: config})
    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(rows)
    cap, width = 8, (n_q + 2 * n_k) * head_dim
    x = torch.randn(rows, hidden, generator=gen).to(dt)
    w = (torch.randn(width, hidden, generator=gen) / hidden ** 0.5).to(dt)
    b = torch.randn(width, generator=gen).to(dt) if bias else None
    ang = torch.rand(rows, head_dim // 2, generator=gen) * 50
    cos, sin = torch.cat([ang, ang], -1).cos().to(dt), torch.cat([ang, ang], -1).sin().to(dt)
    norms = dict(q_norm=((torch.rand(head_dim, generator=gen) + 0.5).to(dt), 1e-6),
                 k_norm=((torch.rand(head_dim, generator=gen) + 0.5).to(dt), 1e-6)) if norm else {}
    state = [torch.randn(rows, n_k, cap, head_dim, generator=gen).to(dt),
             torch.randn(rows, n_k, cap, head_dim, generator=gen).to(dt), torch.rand(rows, n_k, cap, generator=gen),
             torch.randint(0, 50, (rows, n_k, cap), generator=gen, dtype=torch.int32),
             torch.randint(0, cap, (rows, n_k), generator=gen), torch.randint(0, cap, (rows, n_k), generator=gen),
             torch.randint(0, 100, (rows,), generator=gen),
             torch.randn(rows, 3, n_q, head_dim, generator=gen).to(dt) if ring else None]
    copy = [t.clone() if t is not None else None for t in state]
    q, k, v = (t.view(rows, -1, head_dim) for t in F.linear(x, w, b).split([n_q * head_dim, n_k * head_dim,
                                                                           n_k * head_dim], -1))
    want = rotary(q, k, cos, sin, write=CacheWrite(v, *state[:7], cap, True, state[7]), **norms)[0]
    got = qr.qkv_rotary(x, w, b, cos, sin, n_q, n_k, CacheWrite(v, *copy[:7], cap, True, copy[7]), **norms)
    tol = dict(rtol=1e-5, atol=1e-5) if dt == torch.float32 else dict(rtol=0, atol=4e-3)  # an ulp of ~4
    torch.testing.assert_close(got, want, **tol)
    for name, a, e in zip(("k_cache", "v_cache", "vnorm", "pos", "count", "write_idx", "cur_pos", "ring"), copy,
                          state):
        if e is None:
            continue
        if name in ("pos", "count", "write_idx", "cur_pos"):
            assert torch.equal(a, e), name
        else:
            torch.testing.assert_close(a, e, **(tol if name != "vnorm" else dict(rtol=1e-3, atol=1e-3)), msg=name)


@needs_interpreter
@pytest.mark.parametrize("m, inter, k, programs", [
    (4, 64, 128, 5),  # 2 tiles x 4 K steps over 5 programs: shared tiles, program counts that do not divide
    (7, 128, 256, 11),  # 4 tiles x 8 steps, up to 3 contributors a tile
    (3, 64, 128, 7),  # 7 programs on 8 units: up to 4 contributors
    (16, 64, 256, 2),  # each program whole tiles: no shared tile
])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_streamk_gate_up_probe_is_silu_mul_of_the_product(m, inter, k, programs, dtype):
    """``benchmarks/streamk_gate_up_probe.py`` (session 40's stream-K gate_up, not taken) under the interpreter:
    silu_mul of the fp32 product (each half rounded to the dtype, as the chain's epilogue), a second call bit for bit
    the first (the partials added in the contributors' order), and the arrival counters back at zero after each call.
    (The interpreter runs the programs one after another: which program arrives last is decided on a GPU only.)"""
    import torch

    from benchmarks.streamk_gate_up_probe import StreamK, reference
    gen = torch.Generator().manual_seed(m + programs)
    x = torch.randn(m, k, generator=gen).to(getattr(torch, dtype))
    w = (torch.randn(2 * inter, k, generator=gen) * 0.1).to(x.dtype)
    sk = StreamK(m, 2 * inter, k, programs, block_n=64, block_k=32, warps=4, stages=2, device="cpu")
    out = sk(x, w)
    assert int(sk.cnt.abs().sum()) == 0
    again = sk(x, w)
    assert torch.equal(out, again) and int(sk.cnt.abs().sum()) == 0
    ref = reference(x, w).float()
    tol = 1e-5 if dtype == "float32" else 2 ** -9
    assert ((out.float() - ref).abs() <= tol * ref.abs().max() + tol).all()
