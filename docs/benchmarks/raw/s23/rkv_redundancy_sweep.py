"""Session 23: R-KV's redundancy kernel ("ordered", the engine's) under its launch knobs on this GPU, at an event's
shape (n rows x 8 KV heads x 1,152 slots x head_dim 128, bf16, every slot live, positions in slot order); CUDA-graph
medians of 3 interleaved rounds, each config first checked against the default's output.
    PYTHONPATH=.:benchmarks python docs/benchmarks/raw/s23/rkv_redundancy_sweep.py"""
import itertools
import sys

import torch

sys.path[:0] = [".", "benchmarks"]
from kernel_decode import interleaved  # noqa: E402

from kvroll.kernels.rkv_redundancy import rkv_redundancy_triton  # noqa: E402

for n in (64, 256):
    g = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(n, 8, 1152, 128, device="cuda", generator=g).to(torch.bfloat16)
    k = k + 0.8 * k[:, :, :1]  # correlated keys, so that the threshold (0.5) is crossed
    live = torch.ones(n, 8, 1152, dtype=torch.bool, device="cuda")
    pos = torch.arange(1152, dtype=torch.int32, device="cuda").expand(n, 8, -1).contiguous()
    ref = rkv_redundancy_triton(k, live, pos, 0.5, 1, time_ordered=True)
    fns = {}
    for bu, bv, w, st in itertools.product((32, 64, 128), (64, 128), (4, 8), (2, 3)):
        cfg = dict(block_u=bu, block_v=bv, num_warps=w, num_stages=st)
        try:
            out = rkv_redundancy_triton(k, live, pos, 0.5, 1, time_ordered=True, **cfg)
        except Exception as err:  # out of shared memory or registers
            print(n, cfg, "error", str(err).splitlines()[0][:80])
            continue
        assert torch.allclose(out, ref, rtol=1e-4, atol=1e-9), cfg
        fns[f"u{bu}_v{bv}_w{w}_s{st}"] = lambda c=cfg: rkv_redundancy_triton(k, live, pos, 0.5, 1, time_ordered=True, **c)
    med = interleaved(fns, 3)
    base = med["u64_v128_w4_s2"]
    for name, ms in sorted(med.items(), key=lambda kv: kv[1]):
        print(n, name, f"{ms * 1e3:.1f} us per layer ({ms / base:.3f})", flush=True)
