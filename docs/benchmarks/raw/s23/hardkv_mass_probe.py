"""Session 23: Hard-KV's decode call (the mass added into its votes, bf16, dense) under the stat launch knobs, CUDA-graph
medians of 3 interleaved rounds (timing only). PYTHONPATH=.:benchmarks python docs/benchmarks/raw/s23/hardkv_mass_probe.py"""
import sys, torch
sys.path[:0] = [".", "benchmarks"]
from kernel_decode import Case, graph_time_ms, interleaved
import kvroll.kernels.decode_attention as da
for spec in ["256x16x8x128x1152", "128x16x8x128x1152", "192x16x8x128x1152", "64x16x8x128x1152", "352x16x8x128x1152"]:
    shape = tuple(int(x) for x in spec.split("x"))
    case = Case(shape)
    buf = torch.zeros(case.pos.shape, device="cuda")
    def call(**cfg):
        return da.decode_attention(case.q, case.k, case.v, case.pos, case.cur, case.scale, stat="mass", length=case.count,
                                   dense=True, stat_into=buf, **cfg)
    fns = {"default": lambda: call(), "old3": lambda: call(num_stages=3, logit_store="late"),
           "st2_asm": lambda: call(num_stages=2, logit_store="asm"), "st2": lambda: call(num_stages=2),
           "asm": lambda: call(logit_store="asm"), "attn": lambda: case.attention(dense=True)}
    med = interleaved(fns, 3)
    b = med["old3"]
    print(spec, " ".join(f"{k} {v*1e3:.1f} ({v/b:.3f})" for k, v in med.items()), flush=True)
