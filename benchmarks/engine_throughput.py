"""Benchmarks (b) and (c): engine throughput per policy vs HF generate, the decode roofline, KV memory per policy.

    PYTHONPATH=. python benchmarks/engine_throughput.py --out docs/benchmarks   # on a CUDA GPU

Qwen3-1.7B architecture with random weights in bf16 (throughput does not depend on the weights when EOS is
ignored), prompt 512, sampling at temperature 1, EOS ignored, every configuration at the largest batch that fits.

* Compressing policies: one real run of ``--tokens`` new tokens per policy (the cache fills, then evicts or
  compresses periodically); a timeline of (tokens, time) after every host sync gives the decode rate at each
  context length, and the steady-state rate (last quarter of the run) extends it to 16,384 tokens.
* ``full`` (our engine, no eviction): the cache is filled with random K/V to each context length in ``CONTEXTS``
  and a few decode windows are timed there; step time is integrated over the 16k output (trapezoid).
* HF ``generate`` (SDPA, a ``StaticCache`` of 512 + 16,384 slots, ``disable_compile=True`` as TRL sets it): the
  decode rate from two runs of different lengths (the difference cancels prefill).
* Roofline floor of a decode step: (weight bytes + live KV bytes) / copy bandwidth measured in the same run.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time

import torch

from kvroll import CompressionConfig, RolloutEngine, SamplingParams
from kvroll.rollout.engine import Completion, _Run

PROMPT, NEW = 512, 16384
CONTEXTS = (1024, 2048, 4096, 8192, 12288, PROMPT + NEW)
POLICIES = {"longflow": 3200, "rkv": 1024, "lagkv": 1024, "hardkv": 1024, "snapkv": 1024, "h2o": 1024}


def qwen3_1p7b():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                         rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    return model


class Timeline:
    """A ``progress`` object for ``generate``: (steps done, time) at the end of every decode window.

    The engine hands a window's tokens over right after its one host sync, so the marks of one window fall
    within microseconds; they collapse into one mark (the window's last step, the sync's time).
    """

    def __init__(self, batch: int):
        self.batch, self.tokens, self.marks = batch, 0, []

    def update(self, n: int) -> None:
        self.tokens += n
        if self.tokens % self.batch:
            return
        now = time.perf_counter()
        if self.marks and now - self.marks[-1][1] < 2e-3:
            self.marks[-1] = (self.tokens // self.batch, self.marks[-1][1])
        else:
            self.marks.append((self.tokens // self.batch, now))


def copy_bandwidth() -> float:
    src = torch.empty(1 << 31, dtype=torch.int16, device="cuda").random_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / 10
    del src, dst
    return 2 * (1 << 32) / seconds


def kv_bytes_per_token(cfg) -> int:
    return cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 2


def largest_batch(per_seq: float, reserve: float, cap: int = 1024) -> int:
    free, _ = torch.cuda.mem_get_info()
    return max(1, min(cap, int((free - reserve) // per_seq) // 8 * 8 or int((free - reserve) // per_seq)))


def free_memory():
    gc.collect()
    torch.cuda.empty_cache()


def run_compressing(model, policy, budget, tokens, bandwidth, weight_bytes, reserve, batch=None, kwargs=None):
    """One real generate of ``tokens`` new tokens at the largest batch; returns the row (with retries on OOM)."""
    kwargs = kwargs or {}
    probe = RolloutEngine(model, compression=CompressionConfig(policy, budget=budget, **kwargs), max_batch=1)
    per_seq = probe.kv_cache_bytes() + probe.kv_metadata_bytes()
    capacity = probe.cache.capacity
    del probe
    free_memory()
    batch = batch or largest_batch(per_seq, reserve)
    while True:
        try:
            return _compressing_row(model, policy, budget, tokens, batch, per_seq, capacity, bandwidth,
                                    weight_bytes, kwargs)
        except torch.cuda.OutOfMemoryError:
            free_memory()
            batch = batch * 3 // 4 // 8 * 8
            print(f"{policy}: out of memory, retrying at batch {batch}", flush=True)


def _compressing_row(model, policy, budget, tokens, batch, per_seq, capacity, bandwidth, weight_bytes, kwargs):
    engine = RolloutEngine(model, compression=CompressionConfig(policy, budget=budget, **kwargs), max_batch=batch)
    params = SamplingParams(max_new_tokens=tokens, temperature=1.0, ignore_eos=True, seed=0)
    prompt = torch.randint(1, model.config.vocab_size, (PROMPT,)).tolist()
    start = time.perf_counter()
    engine._decode_runner(params)  # capture first, so the timeline holds decode only
    capture = time.perf_counter() - start
    timeline = Timeline(batch)
    start = time.perf_counter()
    results = engine.generate([prompt], params, n=batch, progress=timeline)
    wall = time.perf_counter() - start
    assert all(len(r.token_ids) == tokens for r in results)
    steps, times = zip(*timeline.marks)
    tail = len(steps) * 3 // 4
    step_ss = (times[-1] - times[tail]) / (steps[-1] - steps[tail])
    decode_s = times[-1] - times[0]
    live = float(engine.cache.count.float().mean())  # live tokens per (layer, head) at the end of the run
    floor = (weight_bytes + batch * live * kv_bytes_per_token(model.config)) / bandwidth
    at = {}  # decode rate over the ~128 steps ending at each context length
    for ctx in (1024, 2048, 3072, 4096, tokens + PROMPT):
        i = min(range(len(steps)), key=lambda j: abs(steps[j] + PROMPT - ctx))
        lo = max([j for j in range(i) if steps[j] <= steps[i] - 128] or [0])
        if i > lo:
            at[ctx] = batch * (steps[i] - steps[lo]) / (times[i] - times[lo])
    integrated_s = decode_s + (NEW - steps[-1]) * step_ss
    row = {
        "policy": policy, "policy_kwargs": kwargs, "budget": budget, "capacity": capacity, "batch": batch, "kv_bytes_per_seq": per_seq,
        "tokens": tokens, "wall_s": wall, "capture_s": capture, "e2e_tok_s": batch * tokens / wall,
        "decode_tok_s": batch * (steps[-1] - steps[0]) / decode_s, "steady_tok_s": batch / step_ss,
        "steady_step_ms": step_ss * 1e3, "tok_s_at_context": at, "integrated_16k_tok_s": batch * NEW / integrated_s,
        "mean_live_tokens": live, "floor_step_ms": floor * 1e3, "step_over_floor": step_ss / floor,
        "policy_s": engine.stats.get("policy_seconds", 0.0), "decode_s": decode_s,
    }
    row["policy_frac"] = row["policy_s"] / decode_s  # over the whole run, fill phase (no compression) included
    row.update(periodic_share(list(engine.stats.get("policy_events", ())), steps, times, tail))
    del engine, results
    free_memory()
    return row


def periodic_share(events, steps, times, tail) -> dict:
    """Periodic work in steady state, as a share of the decode time over its interval: ``events`` are
    (decode steps before it, seconds) per compression. The pure decode step is the run's last quarter (marks
    ``tail`` ..) minus the events in it, per step; the share is the median event over (median steps between
    events x that step). (The whole run's ``policy_frac`` is lower: the fill phase decodes with no events.)"""
    if len(events) < 2:
        return {}
    in_tail = [sec for st, sec in events if steps[tail] <= st < steps[-1]]
    step_s = (times[-1] - times[tail] - sum(in_tail)) / (steps[-1] - steps[tail])
    event_s = statistics.median(sec for _, sec in events[1:])  # the first one is at the end of the fill phase
    interval = statistics.median(b[0] - a[0] for a, b in zip(events, events[1:]))
    return {"events": len(events), "event_ms_median": event_s * 1e3, "event_interval_steps": interval,
            "pure_step_ms": step_s * 1e3, "policy_share_of_interval_decode": event_s / (interval * step_s)}


@torch.no_grad()
def run_full(model, bandwidth, weight_bytes, reserve, steps=48):
    cfg = model.config
    per_seq = (PROMPT + NEW) * kv_bytes_per_token(cfg) + cfg.num_hidden_layers * cfg.num_key_value_heads * (
        (PROMPT + NEW) * 4 + 16) + 8
    batch = largest_batch(per_seq, reserve)
    engine = RolloutEngine(model, compression=CompressionConfig("full"), max_batch=batch)
    engine._allocate(PROMPT + NEW)
    cache = engine.cache
    params = SamplingParams(max_new_tokens=NEW, temperature=1.0, ignore_eos=True, seed=0)
    prompt = torch.randint(1, cfg.vocab_size, (PROMPT,)).tolist()
    run = _Run(engine, [prompt], params, 1, engine.generator, set(), None)  # captures the graphs
    cache.k.normal_()
    cache.v.normal_()
    points = {}
    for ctx in CONTEXTS:
        ctx_start = min(ctx, PROMPT + NEW - steps - 1)
        cache.pos.copy_(torch.where(torch.arange(cache.capacity, device="cuda") < ctx_start,
                                    torch.arange(cache.capacity, device="cuda"), -1).to(torch.int32))
        cache.count.fill_(ctx_start)
        cache.write_idx.fill_(ctx_start)
        cache.cur_pos.fill_(ctx_start)
        for timed in (False, True):  # one untimed pass first
            run.owner = [Completion(0, s, prompt, token_ids=[1] * (NEW - steps)) for s in range(batch)]
            run.results = list(run.owner)
            run.tokens.fill_(1)
            cache.count.fill_(ctx_start)
            cache.write_idx.fill_(ctx_start)
            cache.cur_pos.fill_(ctx_start)
            torch.cuda.synchronize()
            start = time.perf_counter()
            run.run()
            seconds = time.perf_counter() - start
        step = seconds / steps
        floor = (weight_bytes + batch * (ctx_start + steps / 2) * kv_bytes_per_token(cfg)) / bandwidth
        points[ctx] = {"step_ms": step * 1e3, "tok_s": batch / step, "floor_ms": floor * 1e3,
                       "over_floor": step / floor}
    ctxs = sorted(points)
    total = 0.0  # trapezoid of step time over contexts PROMPT .. PROMPT + NEW (step time at PROMPT ~ first point)
    grid = [PROMPT] + ctxs
    step_at = [points[ctxs[0]]["step_ms"]] + [points[c]["step_ms"] for c in ctxs]
    for (c0, s0), (c1, s1) in zip(zip(grid, step_at), zip(grid[1:], step_at[1:])):
        total += (c1 - c0) * (s0 + s1) / 2 / 1e3
    row = {"policy": "full", "batch": batch, "kv_bytes_per_seq": per_seq, "capacity": PROMPT + NEW,
           "points": points, "integrated_16k_tok_s": batch * NEW / total}
    del run, engine, cache
    free_memory()
    return row


def run_hf(model, reserve, short=16, long=80):
    from transformers import GenerationConfig, StaticCache

    cfg = model.config
    per_seq = (PROMPT + NEW) * kv_bytes_per_token(cfg)
    batch = largest_batch(per_seq, reserve)
    model.set_attn_implementation("sdpa")
    ids = torch.randint(1, cfg.vocab_size, (batch, PROMPT), device="cuda")
    times = {}
    for n in (short, short, long):
        gen = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=True, temperature=1.0, top_k=0,
                               top_p=1.0, disable_compile=True, pad_token_id=0, eos_token_id=None)
        cache = StaticCache(config=cfg, max_cache_len=PROMPT + NEW)
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen,
                             past_key_values=cache)
        torch.cuda.synchronize()
        times[n] = time.perf_counter() - start
        assert out.shape == (batch, PROMPT + n)
        del cache, out
        free_memory()
    model.set_attn_implementation("kvroll")
    rate = batch * (long - short) / (times[long] - times[short])
    return {"policy": "hf_generate", "batch": batch, "kv_bytes_per_seq": per_seq, "decode_tok_s": rate,
            "integrated_16k_tok_s": rate, "step_ms": batch / rate * 1e3, "times": times}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--tokens", type=int, default=2048, help="new tokens of each compressing policy's run")
    parser.add_argument("--e2e-tokens", type=int, default=4096, help="new tokens of longflow's run")
    parser.add_argument("--reserve-gb", type=float, default=8.0)
    parser.add_argument("--skip", default="", help="comma list among full,hf")
    parser.add_argument("--batches", default="", help="policy=batch overrides (largest batch found earlier)")
    parser.add_argument("--policy-kwargs", type=json.loads, default={},
                        help='JSON {policy: {hyperparameter: value}}, e.g. {"rkv": {"buffer": 256}}')
    args = parser.parse_args()
    start = time.time()
    bandwidth = copy_bandwidth()
    model = qwen3_1p7b()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    reserve = args.reserve_gb * 2**30
    rows, errors = [], {}
    batches = {k: int(v) for k, v in (item.split("=") for item in args.batches.split(",") if item)}
    for name, fn in (("full", lambda: run_full(model, bandwidth, weight_bytes, reserve)),
                     ("hf", lambda: run_hf(model, reserve))):
        if name in args.skip.split(","):
            continue
        try:
            rows.append(fn())
            print(json.dumps(rows[-1]), flush=True)
            dump(args, bandwidth, weight_bytes, rows, errors, start)
        except Exception as err:
            errors[name] = repr(err)[:400]
            print(f"{name} failed: {err!r}", flush=True)
            free_memory()
    for policy in [p for p in args.policies.split(",") if p]:
        tokens = args.e2e_tokens if policy == "longflow" else args.tokens
        try:
            rows.append(run_compressing(model, policy, POLICIES[policy], tokens, bandwidth, weight_bytes, reserve,
                                        batches.get(policy), args.policy_kwargs.get(policy)))
            print(json.dumps(rows[-1]), flush=True)
            dump(args, bandwidth, weight_bytes, rows, errors, start)
        except Exception as err:  # report and continue with the other policies
            errors[policy] = repr(err)[:400]
            print(f"{policy} failed: {err!r}", flush=True)
            free_memory()
    dump(args, bandwidth, weight_bytes, rows, errors, start)
    print(f"done in {time.time() - start:.0f} s")


def write_json(path, obj):
    """``obj`` as indented JSON at ``path``, its folder created if missing (the benchmarks' result files)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)


def dump(args, bandwidth, weight_bytes, rows, errors, start):
    """Write what has finished so far (a run cut short by its time limit keeps its rows)."""
    write_json(os.path.join(args.out, "engine_throughput.json"), {
        "device": torch.cuda.get_device_name(), "bandwidth": bandwidth, "weight_bytes": weight_bytes, "rows": rows,
        "errors": errors, "seconds": time.time() - start, "argv": vars(args)})


if __name__ == "__main__":
    main()
