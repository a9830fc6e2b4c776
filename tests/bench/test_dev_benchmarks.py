"""Developer benchmarks on tiny shapes (CPU): they run, and what they compare agrees.

``benchmarks/event_profile.py`` times one compression event read as views (a slot span) and as gathered rows
(a device index, what a captured graph reads): both must keep the same tokens. ``benchmarks/event_keys.py``
counts the graph keys of a rollout's events as ``EventGraphs`` would split and key them.
"""
import os
import types

import pytest

from benchmarks import event_keys, event_profile


@pytest.mark.parametrize("policy", ["hardkv", "rkv", "snapkv"])
def test_event_profile_span_and_index_events_keep_the_same_tokens(policy):
    args = types.SimpleNamespace(layers=2, budget=64, warmup=2, reps=1, top=3)
    row = event_profile.run(policy, 4, args)
    assert row["span_checksum"] == row["index_checksum"]
    assert row["span_checksum"]["live_tokens"] > 0 and row["kernels"] > 0


def test_event_keys_counts_a_small_rollout():
    args = types.SimpleNamespace(budget=512, max_batch=8, prompts=2, group=4, max_new=600, vocab=512)
    row = event_keys.run("hardkv", args, event_keys.tiny_qwen3(args.vocab))
    assert row["events"] >= 4  # 8 rows, one compression every 128 steps
    assert 0 < row["keys"] <= row["events"] and row["graphs"] <= row["keys"]
    assert row["replayed"] <= row["events"] and row["completion_tokens_max"] <= 600


def _triton_runs() -> bool:
    import torch

    from benchmarks.linear_splitk_experiment import triton
    return triton is not None and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")


@pytest.mark.skipif(not _triton_runs(), reason="needs Triton on a GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("m,n,k,prologue,cfg", [
    (5, 96, 256, None, {}),  # the default configuration
    (37, 130, 320, None, dict(split_k=3, block_k=64)),  # ragged rows, columns and K chunks: every mask
    (64, 128, 512, "silu_mul", dict(split_k=2)),
    (3, 64, 200, "silu_mul", dict(split_k=2, block_k=64)),
    (70, 64, 128, None, dict(split_k=1, block_m=32)),  # several row blocks, no split
])
def test_linear_splitk_experiment_is_the_fp32_product(m, n, k, prologue, cfg):
    """``benchmarks/linear_splitk_experiment.py`` (session 18's cuBLAS comparison) under the interpreter: the fp32
    product of the (SiLU·mul'd) input; a second call is bit for bit the first (the partials are summed in split
    order whichever program arrives last: only a GPU, where programs race, can break that)."""
    import torch

    from benchmarks.linear_splitk_experiment import linear_splitk, linear_torch
    gen = torch.Generator().manual_seed(m)
    dev = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
    x = torch.randn(m, 2 * k if prologue else k, generator=gen).to(dev)
    w = torch.randn(n, k, generator=gen).to(dev)
    y = linear_splitk(x, w, prologue, **cfg)
    torch.testing.assert_close(y, linear_torch(x, w, prologue), rtol=1e-5, atol=1e-4)
    assert torch.equal(y, linear_splitk(x, w, prologue, **cfg))
