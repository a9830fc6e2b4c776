"""Does prefetching the o projection's weight into L2 from the decode kernel shorten a decode layer? A chain of
``--layers`` decoder layers at a decode step's shapes (Qwen3-1.7B by default: hidden 2,048, 16 / 8 heads of 128,
MLP 6,144), each its own weights and cache: RMSNorm, qkv (cuBLAS), the decode kernel (the engine's call: LongFlow's
statistic with cached norms, dense, the argmin into the write index; or attention alone), o, RMSNorm, gate_up, SiLU
* up, down. One CUDA graph of the chain per variant, timed interleaved (medians of rounds), with the decode kernel's
``l2_prefetch`` off and on (the layer's o weight, or o and the next layer's qkv, which sit side by side in one
buffer), at the programs' start or end, with or without the evict-last priority. Outputs are compared to the
variant without a prefetch (bit for bit: a prefetch changes no value). Session 24 (developer probe).

    git apply docs/benchmarks/raw/s24/l2_prefetch.patch  # the kernel's l2_prefetch (not in kvroll)
    PYTHONPATH=.:benchmarks python docs/benchmarks/raw/s24/l2_prefetch_probe.py --out OUT [--shapes 64x1024xstat,...]
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F

try:
    from kernel_decode import graph_time_ms
except ImportError:  # imported as benchmarks.l2_prefetch_probe
    from benchmarks.kernel_decode import graph_time_ms

import kvroll.kernels.decode_attention as da
from kvroll.bench.measure import copy_bandwidth

SHAPES = "64x1024xstat,64x1152xattn,128x1024xstat,256x1024xstat,8x1024xstat,1x1024xstat,32x1024xattn"
VARIANTS = {"off": None, "o_start": dict(what="o", at="start"), "o_end": dict(what="o", at="end"),
            "o_start_normal": dict(what="o", at="start", last=False),
            "oqkv_start": dict(what="oqkv", at="start"), "oqkv_end": dict(what="oqkv", at="end")}


class Chain:
    """``layers`` decoder layers' weights and caches; ``run(variant)`` is one decode step through all of them."""

    def __init__(self, slots, tokens, stat, layers, hidden=2048, heads=16, kv_heads=8, head_dim=128, inter=6144):
        dev, dt = torch.device("cuda"), torch.bfloat16
        gen = torch.Generator(device=dev).manual_seed(0)
        rnd = lambda *shape, s=0.02: (torch.randn(*shape, generator=gen, device=dev) * s).to(dt)  # noqa: E731
        self.stat, self.slots, self.heads, self.kv_heads, self.head_dim = stat, slots, heads, kv_heads, head_dim
        nqkv = (heads + 2 * kv_heads) * head_dim
        o_numel, qkv_numel = hidden * heads * head_dim, nqkv * hidden
        # buffer l: o of layer l, then qkv of layer l + 1 (the first layer's qkv in its own buffer)
        self.arena = [rnd(o_numel + qkv_numel) for _ in range(layers)]
        self.w_o = [a[:o_numel].view(hidden, heads * head_dim) for a in self.arena]
        self.w_qkv = [rnd(nqkv, hidden)] + [a[o_numel:].view(nqkv, hidden) for a in self.arena[:-1]]
        self.w_gu = [rnd(2 * inter, hidden) for _ in range(layers)]
        self.w_d = [rnd(hidden, inter) for _ in range(layers)]
        self.norm = torch.ones(hidden, device=dev, dtype=dt)
        shape = (slots, kv_heads, tokens, head_dim)
        self.k = [rnd(*shape, s=1.0) for _ in range(layers)]
        self.v = [rnd(*shape, s=1.0) for _ in range(layers)]
        self.vnorm = [v.float().abs().sum(-1) for v in self.v]
        self.pos = torch.arange(tokens, device=dev, dtype=torch.int32).expand(slots, kv_heads, tokens).contiguous()
        self.count = torch.full((slots, kv_heads), tokens, device=dev, dtype=torch.int32)
        self.cur = torch.full((slots,), tokens, device=dev, dtype=torch.int64)
        self.write_idx = torch.zeros(slots, kv_heads, device=dev, dtype=torch.int64)
        self.x0 = rnd(slots, hidden, s=1.0)
        self.x = self.x0.clone()
        self.o_numel = o_numel

    def run(self, variant):
        x = self.x0
        for layer in range(len(self.arena)):
            h = F.rms_norm(x, (x.shape[-1],), self.norm)
            qkv = F.linear(h, self.w_qkv[layer])
            q = qkv[:, :self.heads * self.head_dim].view(self.slots, self.heads, self.head_dim)
            pf = {}
            if variant is not None:
                span = self.arena[layer][:self.o_numel] if variant["what"] == "o" else self.arena[layer]
                pf = dict(l2_prefetch=span, l2_prefetch_at=variant["at"],
                          l2_prefetch_evict_last=variant.get("last", True))
            if self.stat:
                out = da.decode_attention(q, self.k[layer], self.v[layer], self.pos, self.cur, self.head_dim ** -0.5,
                                          stat="contrib", argmin=True, sinks=4, window=32, length=self.count,
                                          return_stat=False, vnorm=self.vnorm[layer], dense=True,
                                          write_idx=self.write_idx, **pf)[0]
            else:
                out = da.decode_attention(q, self.k[layer], self.v[layer], self.pos, self.cur, self.head_dim ** -0.5,
                                          length=self.count, dense=True, **pf)[0]
            x = x + F.linear(out.view(self.slots, -1), self.w_o[layer])
            h = F.rms_norm(x, (x.shape[-1],), self.norm)
            gate, up = F.linear(h, self.w_gu[layer]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, self.w_d[layer])
        self.x.copy_(x)
        return self.x


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--shapes", default=os.environ.get("SHAPES", SHAPES))
    ap.add_argument("--variants", default=os.environ.get("VARIANTS", ",".join(VARIANTS)))
    ap.add_argument("--layers", type=int, default=int(os.environ.get("LAYERS", 8)))
    ap.add_argument("--rounds", type=int, default=int(os.environ.get("ROUNDS", 5)))
    args = ap.parse_args()
    bw = copy_bandwidth(torch.device("cuda"))
    names = [n for n in args.variants.split(",") if n]
    rows = []
    for spec in args.shapes.split(","):
        slots, tokens, kind = spec.split("x")
        chain = Chain(int(slots), int(tokens), kind == "stat", args.layers)
        ref = chain.run(None).clone()
        ok = {}
        for name in names:
            got = chain.run(VARIANTS[name])
            ok[name] = bool(torch.equal(got, ref))
        times = {name: [] for name in names}
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                times[name].append(graph_time_ms(lambda n=name: chain.run(VARIANTS[n]), calls=2, reps=9))
        med = {name: sorted(ts)[len(ts) // 2] * 1e3 / args.layers for name, ts in times.items()}  # us per layer
        base = med[names[0]]
        kv = 2 * chain.k[0].numel() * 2
        weights = sum(t.numel() * 2 for t in (chain.w_o[0], chain.w_qkv[0], chain.w_gu[0], chain.w_d[0]))
        floor_us = (kv + weights) / bw * 1e6
        row = dict(shape=spec, layers=args.layers, floor_us=floor_us, us_per_layer=med, same=ok,
                   ratio={n: med[n] / base for n in names})
        rows.append(row)
        print(spec, f"floor {floor_us:.1f}", " ".join(f"{n} {med[n]:.1f} ({med[n] / base:.3f}){'' if ok[n] else ' DIFF'}"
                                                      for n in names), flush=True)
        del chain
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "l2_prefetch_probe.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), bandwidth=bw, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
