"""The measurements of ``kvroll bench``: engine throughput, HF ``generate``, steady decode step, roofline floor,
periodic policy work. Each ``measure_*`` returns one flat row (a dict of numbers and short lists).

    bench = Bench(model, prompt_length=512, reserve_gb=8, max_batch_cap=1024, temperature=1.0, seed=0)
    row = measure_policy(bench, "rkv", 1024, batch="max", length=16384, steady_steps=1024)

* A compressing policy runs one real ``generate`` of ``min(length, fill + steady_steps)`` new tokens (the cache
  fills, then evicts or compresses); a timeline of (steps, time) at every host sync gives the step time at each
  context length, and the rate to ``length`` extends the run at the steady step (the last quarter of the run).
* ``full`` has its cache filled with random K/V to a few context lengths up to prompt + ``length``; ``full_steps``
  decode steps are timed at each, and the step time is integrated over the output (trapezoid).
* HF ``generate`` (SDPA, a ``StaticCache`` of prompt + ``length`` slots, ``disable_compile=True`` as TRL sets it):
  the decode rate is the difference of two runs of ``hf_new_tokens`` lengths (prefill cancels).
* Roofline floor of a step: (weight bytes + live KV bytes) / the copy bandwidth measured in the same run; a
  periodic policy's live tokens are averaged over the steady window's decode steps (``LiveCounts``; before
  session 22, the fill at the run's last step: the top of SnapKV's and R-KV's cycle, a floor ~3.7% too high at
  batch 64 and ~4.7% at 256, budget 1,024). ``live_tokens_end`` keeps the last step's fill.
* Periodic work: each compression event's time and the steps between events; R-KV's and SnapKV's event graph for
  the row's batch is captured before the timed run (as the decode graphs are), so their events are replays.
* Kernels per decode step (CUDA only, else None): one eager step profiled after the run, every slot's cache
  holding the steady window's mean live tokens (``kernel_live_tokens``; a step policy's capacity; before session
  23 the capacity for every policy, so a periodic policy's kernel times were those of a fuller cache than its
  average step's) (``kvroll.bench.kernel_count``), in total and for the layer that launches the most.
"""
from __future__ import annotations

import gc
import statistics
import time
from collections import deque

import torch

from kvroll.bench.kernel_count import step_kernel_counts
from kvroll.bench.models import kv_bytes_per_token, weight_bytes
from kvroll.config import CompressionConfig
from kvroll.hf_compat import CACHE_KW
from kvroll.rollout.engine import Completion, RolloutEngine
from kvroll.rollout.scheduler import GenerateRun
from kvroll.rollout.sampling import SamplingParams


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def copy_bandwidth(device: torch.device | str = "cuda", nbytes: int | None = None) -> float:
    """Bytes/s of a large device-to-device copy (read + write bytes), the median of 10 eager copies."""
    device = torch.device(device)
    nbytes = nbytes or (1 << 32 if device.type == "cuda" else 1 << 28)
    src = torch.empty(nbytes // 2, dtype=torch.int16, device=device).random_()
    dst = torch.empty_like(src)
    dst.copy_(src)  # eager: a copy captured in a graph becomes a memcpy node, measured slower (2.78 vs 4.28 TB/s)
    times = []
    for _ in range(10):
        times.append(_seconds(lambda: dst.copy_(src), device))
    del src, dst
    return 2 * nbytes / statistics.median(times)


def _seconds(fn, device: torch.device) -> float:
    """Seconds of one call: CUDA events on a GPU (no host latency), a synced wall clock elsewhere."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def free_bytes(device: torch.device) -> int:
    """Free memory of the device (CUDA) or available system memory (CPU)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return int(info["MemAvailable"].split()[0]) * 1024


class Bench:
    """What every measurement of one run shares: the model, its byte counts, the bandwidth, the prompt."""

    def __init__(self, model, prompt_length: int, reserve_gb: float, max_batch_cap: int, temperature: float,
                 seed: int, switches: dict | None = None):
        self.model, self.prompt_length, self.seed = model, prompt_length, seed
        self.engine_switches = dict(switches or {})  # RolloutEngine fusion keywords; absent ones keep its defaults
        self.device = next(model.parameters()).device
        self.reserve, self.cap, self.temperature = reserve_gb * 2**30, max_batch_cap, temperature
        self.weight_bytes, self.kv_per_token = weight_bytes(model), kv_bytes_per_token(model)
        self.bandwidth = copy_bandwidth(self.device)
        gen = torch.Generator().manual_seed(seed)
        self.prompt = torch.randint(1, model.config.vocab_size, (prompt_length,), generator=gen).tolist()

    def switches(self) -> dict:
        """The engine switches every engine of the run is built with (``RolloutEngine`` keywords)."""
        return dict(self.engine_switches)

    def largest_batch(self, per_seq: float) -> int:
        """The most sequences whose KV cache fits in free memory minus the reserve (a multiple of 8 past 8)."""
        fit = int((free_bytes(self.device) - self.reserve) // per_seq)
        return max(1, min(self.cap, fit // 8 * 8 or fit))

    def floor_ms(self, batch: int, live_tokens: float) -> float:
        """The roofline floor of one decode step: (weights + live KV bytes) / bandwidth, in ms."""
        return 1e3 * (self.weight_bytes + batch * live_tokens * self.kv_per_token) / self.bandwidth

    def sampling(self, tokens: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=tokens, temperature=self.temperature, ignore_eos=True, seed=self.seed)


class Timeline:
    """A ``progress`` object for ``generate``: (steps done, time) at every host sync.

    The engine calls ``synced()`` at each decode window's one host sync, then hands the window's tokens over in
    one ``update`` (the first token of each new sequence comes alone, from its prefill): a burst is one mark, the
    window's last step at the time of its sync. For a caller that never calls ``synced``, a gap of
    ``gap_s`` between two calls starts a new burst (a mark taken inside a burst would time the host loop, not
    the decode) — a guess that merges windows shorter than the gap (a tiny model on a CPU: session 16).

    ``synchronous`` (a CPU, whose work runs as it is queued): the engine queues window k + 1 before it reads window
    k (``GenerateRun.run``'s overlap), so at window k's sync window k + 1 has run too; the mark then takes the time the
    engine finished queueing window k (``kvroll_window_queued()``, called once per window, in the order the windows
    are read; a name no other progress object has by chance).
    Before session 40 each CPU mark carried the next window's end: the steady step came out one window short over
    the run's last quarter (a ~25% lower step on the CPU config's 16-token runs, and rates extrapolated from it).
    """

    def __init__(self, batch: int, gap_s: float = 2e-3, clock=time.perf_counter, after_step=None,
                 synchronous: bool = False):
        self.batch, self.gap_s, self.clock, self.tokens, self.marks = batch, gap_s, clock, 0, []
        self.last = self.burst = float("-inf")
        self.by_sync, self.synchronous, self.windows = False, synchronous, deque()
        if after_step is not None:  # the engine calls it after each decode step it queues (LiveCounts.sample)
            self.after_step = after_step

    def kvroll_window_queued(self) -> None:
        """The engine has queued a decode window (on a synchronous device, run it)."""
        if self.synchronous:  # (elsewhere the sync's own time is the window's end)
            self.windows.append(self.clock())

    def synced(self) -> None:
        """A decode window's host sync: the tokens handed over next are its burst."""
        self.by_sync = True
        self.burst = self.last = self.clock()
        if self.windows:
            self.burst = self.windows.popleft()

    def update(self, n: int) -> None:
        now = self.clock()
        if now - self.last > self.gap_s and not self.by_sync:
            self.burst = now
        self.last = now
        self.tokens += n
        if self.tokens % self.batch:
            return
        if self.marks and self.marks[-1][1] == self.burst:
            self.marks[-1] = (self.tokens // self.batch, self.burst)
        else:
            self.marks.append((self.tokens // self.batch, self.burst))


class LiveCounts:
    """The cache's live tokens after every decode step, without a host sync: ``sample`` (the engine calls it after
    queueing each decode step, through ``Timeline(after_step=...)``) enqueues one sum of ``cache.count`` [layers,
    slots, KV heads] into a device buffer; ``mean`` reads the buffer once, after the run.

    A periodic policy's cache fills and empties in cycles (SnapKV at budget 1,024: 1,024 to 1,152 tokens, then an
    event), so the floor of a step averaged over a window of steps is that of the live tokens averaged over the
    same steps, not of the fill at the run's last step (what the bench used before session 22: the top of the
    cycle for SnapKV and R-KV). One reduction of ~14k integers per decode step (Qwen3-1.7B at batch 64): ~2-3 µs
    of a 5 ms step; taken for periodic policies, and for a step policy whose cache fills after the run's middle
    (the others' caches stay full over the steady window)."""

    def __init__(self, count: torch.Tensor, max_steps: int):
        self.count, self.per_sample = count, count.numel()
        self.buf = torch.zeros(max(1, max_steps), dtype=torch.float64, device=count.device)
        self.n = 0  # decode steps sampled (in launch order: the run's decode steps 1, 2, ...)

    def sample(self) -> None:
        if self.n < self.buf.numel():
            torch.sum(self.count, dim=tuple(range(self.count.dim())), dtype=torch.float64, out=self.buf[self.n])
        self.n += 1

    def mean(self, first: int, stop: int) -> float | None:
        """Mean live tokens per (layer, slot, KV head) after decode steps ``first`` .. ``stop`` - 1 (0-based: the
        sample after the run's decode step ``first`` + 1); None if any of them was not sampled."""
        if not 0 <= first < stop <= min(self.n, self.buf.numel()):
            return None
        return float(self.buf[first:stop].mean()) / self.per_sample


def measure_policy(bench: Bench, policy: str, budget: int, batch, length: int, steady_steps: int,
                   kwargs: dict | None = None) -> dict:
    """One real ``generate`` of a compressing policy at ``batch`` ('max': the largest that fits); see module doc.

    Out of memory at 'max' retries at 3/4 of the batch."""
    compression = CompressionConfig(policy, budget=budget, **(kwargs or {}))
    probe = RolloutEngine(bench.model, compression=compression, max_batch=1, **bench.switches())
    per_seq, capacity = probe.kv_cache_bytes() + probe.kv_metadata_bytes(), probe.cache.capacity
    del probe
    free_memory()
    largest = bench.largest_batch(per_seq)
    size = largest if batch == "max" else batch
    tokens = min(length, max(0, capacity - bench.prompt_length) + steady_steps)
    while True:
        try:
            row = _policy_run(bench, compression, size, tokens, length, capacity)
            break
        except torch.cuda.OutOfMemoryError:
            if batch != "max" or size <= 8:
                raise
        free_memory()  # outside the except block: the failed run's frames (and its cache) are released by now
        size = size * 3 // 4 // 8 * 8 or size * 3 // 4  # (a cap of 9 or 10 rows: 7, not 0)
    return {"policy_kwargs": kwargs or {}, "kv_bytes_per_seq": per_seq, "largest_batch": largest, **row}


def _policy_run(bench: Bench, compression: CompressionConfig, batch: int, tokens: int, length: int,
                capacity: int) -> dict:
    engine = RolloutEngine(bench.model, compression=compression, max_batch=batch, **bench.switches())
    params = bench.sampling(tokens)
    start = time.perf_counter()
    runner = engine._decode_runner(params)  # capture first, so the timeline holds decode only
    if runner.events is not None:  # and the event graphs of this batch: an in-phase run's events all hold every
        warm_events(engine, runner.events, batch, bench.prompt)  # slot, so a short run's 2-3 events were its
    capture = time.perf_counter() - start  # eager first run and its capture, not replays
    # a step policy's cache is full from its fill on: the last step's fill is the window's only when the cache is
    # full by the run's middle (the steady window starts at or after it); else the window's mean, as a periodic one
    settled = bench.prompt_length + tokens // 2 > capacity
    counts = LiveCounts(engine.cache.count, tokens) if engine.policy.periodic or not settled else None
    timeline = Timeline(batch, after_step=counts.sample if counts is not None else None,
                        synchronous=bench.device.type != "cuda")
    start = time.perf_counter()
    results = engine.generate([bench.prompt], params, n=batch, progress=timeline)
    wall = time.perf_counter() - start
    if any(len(r.token_ids) != tokens for r in results):
        raise RuntimeError(f"{compression.policy}: a sequence ended before {tokens} tokens with EOS ignored")
    steps, times = zip(*timeline.marks)
    if len(steps) < 4:
        raise RuntimeError(f"{compression.policy}: {len(steps)} decode windows; raise the output length")
    tail = min(len(steps) * 3 // 4, len(steps) - 2)  # (4 marks: 3 // 4 of them is the last one, an empty window)
    step_s = (times[-1] - times[tail]) / (steps[-1] - steps[tail])
    decode_s = times[-1] - times[0]
    live_end = float(engine.cache.count.float().mean())  # live tokens per (layer, slot, head) at the run's end
    # ... averaged over the steady window's decode steps: tokens steps[tail] + 1 .. steps[-1] of each sequence
    # (token t is the output of decode step t - 1, the first coming from the prefill; sample index = step - 1)
    live = counts.mean(steps[tail] - 1, steps[-1] - 1) if counts is not None else None
    live = live_end if live is None else live
    floor = bench.floor_ms(batch, live)
    kernel_live = min(capacity, round(live))  # one step profiled at the steady window's mean fill (a step policy's:
    kernels = kernel_columns(engine, params, batch, kernel_live)  # its capacity), the cache's contents left as they are
    rate = batch * (length - steps[0]) / (decode_s + (length - steps[-1]) * step_s)
    row = {"capacity": capacity, "batch": batch, "run_tokens": tokens, "extrapolated": tokens < length,
           "wall_s": wall, "capture_s": capture, "e2e_tok_s": batch * tokens / wall,
           "decode_tok_s": batch * (steps[-1] - steps[0]) / decode_s, "tok_s": rate,
           "steady_step_ms": step_s * 1e3, "floor_step_ms": floor, "step_over_floor": step_s * 1e3 / floor,
           "mean_live_tokens": live, "live_tokens_end": live_end, "kernel_live_tokens": kernel_live,
           "step_curve": step_curve(bench, steps, times, batch, capacity,
                                    live=counts.mean if counts is not None else None),
           "policy_s": engine.stats.get("policy_seconds", 0.0), "decode_s": decode_s, **kernels}
    row["policy_frac"] = row["policy_s"] / decode_s  # whole run, fill phase (no compression) included
    row.update(periodic_share(list(engine.stats.get("policy_events", ())), steps, times, tail))
    del engine, results
    free_memory()
    return row


def warm_events(engine: RolloutEngine, events, batch: int, prompt: list[int]) -> None:
    """Run each event graph the timed run will replay twice (eager, then captured) on the junk cache (``generate``
    places its prompts anew): one per batch; LagKV's and Hard-KV's also per size, the sizes its slots go
    through from the prompt on (``policy.host_place`` / ``host_next``, until they repeat; at most 8; Hard-KV's: not
    calibrated, then calibrated)."""
    policy, cache = engine.policy, engine.cache
    sizes_seq: list = [None]
    if hasattr(policy, "host_next"):
        placed, _ = engine._prefill(prompt)
        size, sizes_seq = policy.host_place(placed.k.shape[2], placed.length, cache.capacity)[1], []
        while size not in sizes_seq and len(sizes_seq) < 8:
            sizes_seq.append(size)
            size = policy.host_next(size, cache.capacity)[1]
    for size in sizes_seq:
        sizes = None if size is None else [size] * batch
        for _ in range(2):
            cache.event_counts = sizes
            try:
                events.run(list(range(batch)), sizes)
            finally:
                cache.event_counts = None


def kernel_columns(engine: RolloutEngine, params: SamplingParams, batch: int, live: int) -> dict:
    """The row's kernel counts and device times of one decode step with ``live`` tokens per head (None off
    CUDA); see ``kernel_count``."""
    counts = step_kernel_counts(engine, params, batch, live=live)
    if counts is None:
        return {"kernels_per_step": None, "kernels_per_layer": None}
    return {key: value for key, value in counts.items() if key != "kernels_outside_layers"}


def step_curve(bench: Bench, steps, times, batch: int, capacity: int, points: int = 24,
               live=None) -> list[list[float]]:
    """[context, step ms, floor ms] along the run, over ~``points`` stretches of at least ``span`` decode steps
    between marks; the run's short remainder joins the last stretch, so no point stands on a few steps.

    The floor counts the stretch's mean live tokens where ``live(first, stop)`` gives them (``LiveCounts.mean``
    over its decode steps), else min(context, capacity): what the cache holds once it is full."""
    span = max(1, (steps[-1] - steps[0]) // points)
    ends = [0]
    for hi in range(1, len(steps)):
        if steps[hi] - steps[ends[-1]] >= span:
            ends.append(hi)
    if ends[-1] != len(steps) - 1:  # a remainder shorter than span: it joins the last stretch
        if len(ends) > 1:
            ends[-1] = len(steps) - 1
        else:
            ends.append(len(steps) - 1)
    out = []
    for lo, hi in zip(ends, ends[1:]):
        ctx = bench.prompt_length + (steps[lo] + steps[hi]) / 2
        step_ms = 1e3 * (times[hi] - times[lo]) / (steps[hi] - steps[lo])
        tokens = live(steps[lo] - 1, steps[hi] - 1) if live is not None else None
        out.append([ctx, step_ms, bench.floor_ms(batch, min(ctx, capacity) if tokens is None else tokens)])
    return out


def periodic_share(events, steps, times, tail) -> dict:
    """Periodic work in steady state, as a share of the decode time over its interval: ``events`` are
    (decode steps before it, seconds) per compression. The pure decode step is the run's last quarter (marks
    ``tail`` ..) minus the events in it, per step; the share is the median event over (median steps between
    events x that step). (The whole run's ``policy_frac`` is lower: the fill phase decodes with no events.)"""
    if len(events) < 2:
        return {"events": len(events)}
    # an event after st decode steps runs before decode step st + 1, whose token st + 2 closes its mark interval:
    # the marks steps[tail] .. steps[-1] span the events of st = steps[tail] - 1 .. steps[-1] - 2
    in_tail = [sec for st, sec in events if steps[tail] - 1 <= st < steps[-1] - 1]
    step_s = (times[-1] - times[tail] - sum(in_tail)) / (steps[-1] - steps[tail])
    event_s = statistics.median(sec for _, sec in events[1:])  # the first one is at the end of the fill phase
    interval = statistics.median(b[0] - a[0] for a, b in zip(events, events[1:]))
    return {"events": len(events), "event_ms_median": event_s * 1e3, "event_interval_steps": interval,
            "pure_step_ms": step_s * 1e3, "policy_share": event_s / (interval * step_s)}


def full_contexts(prompt: int, length: int) -> list[int]:
    """Context lengths ``full`` is timed at: 1/16 .. all of the output, past the prompt."""
    return sorted({round(prompt + length * f) for f in (1 / 16, 1 / 8, 1 / 4, 1 / 2, 3 / 4, 1)})


@torch.no_grad()
def measure_full(bench: Bench, batch, length: int, steps: int) -> dict:
    """``full`` (no eviction): the cache filled to each context length, ``steps`` decode steps timed there."""
    total = bench.prompt_length + length
    probe = RolloutEngine(bench.model, compression=CompressionConfig("full"), max_batch=1,
                          **bench.switches())
    probe._allocate(total)
    per_seq = probe.kv_cache_bytes() + probe.kv_metadata_bytes()
    del probe
    free_memory()
    largest = bench.largest_batch(per_seq)
    size = largest if batch == "max" else batch
    engine = RolloutEngine(bench.model, compression=CompressionConfig("full"), max_batch=size,
                           **bench.switches())
    engine._allocate(total)
    cache = engine.cache
    cache.generator = engine.generator
    params = bench.sampling(length)
    run = GenerateRun(engine, [bench.prompt], params, 1, engine.generator, set(), None)  # captures the graphs
    kernels = kernel_columns(engine, params, size, total - steps - 1)  # at the sweep's longest context
    run.waiting.clear()  # no prefill: the slots below are placed by hand, already at each context
    cache.k.normal_()
    cache.v.normal_()
    slots = torch.arange(cache.capacity, device=bench.device)
    curve = []
    contexts = full_contexts(bench.prompt_length, length)
    for i, ctx in enumerate(contexts):
        start_ctx = max(1, min(ctx, total - steps - 1))
        cache.pos.copy_(torch.where(slots < start_ctx, slots, -1).to(cache.pos.dtype))
        for _ in range(2 if i == 0 else 1):  # one untimed pass first
            run.owner = [Completion(0, s, bench.prompt, token_ids=[1] * (length - steps)) for s in range(size)]
            run.results = list(run.owner)
            run.tokens.fill_(1)
            for buf in (cache.count, cache.write_idx, cache.cur_pos):
                buf.fill_(start_ctx)
            sync(bench.device)
            start = time.perf_counter()
            run.run()
            seconds = time.perf_counter() - start
        step_ms = 1e3 * seconds / steps
        curve.append([start_ctx + steps / 2, step_ms, bench.floor_ms(size, start_ctx + steps / 2)])
    del run, engine, cache
    free_memory()
    decode_s = _integrate(bench.prompt_length, curve, total)
    last = curve[-1]
    return {"capacity": total, "batch": size, "kv_bytes_per_seq": per_seq, "largest_batch": largest,
            "run_tokens": steps * len(curve), "extrapolated": True, "tok_s": size * length / decode_s,
            "steady_step_ms": last[1], "floor_step_ms": last[2], "step_over_floor": last[1] / last[2],
            "mean_live_tokens": last[0], "step_curve": curve, "events": 0, **kernels}


def _integrate(prompt: int, curve, end: int) -> float:
    """Seconds of decode from context ``prompt`` to ``end`` (prompt + the tokens the rate counts): the trapezoid
    through the curve's (context, step ms) points, flat before the first point and after the last. (The last point
    sits at its window's middle, short of the end: until session 40 the integral stopped there, so ``full``'s rate
    counted ``end - prompt`` tokens over fewer steps' time: 6.7% too high on the CPU config, ~0.15% on the H100's.)"""
    points = sorted((min(max(c, prompt), end), s) for c, s, _ in curve)  # (a point outside [prompt, end]: its edge)
    grid = [(prompt, points[0][1])] + points + [(end, points[-1][1])]
    return sum((c1 - c0) * (s0 + s1) / 2e3 for (c0, s0), (c1, s1) in zip(grid, grid[1:]))


@torch.no_grad()
def measure_hf(bench: Bench, batch, length: int, new_tokens: list[int]) -> dict:
    """HF ``generate`` with a static cache of prompt + ``length`` slots; the rate from two run lengths."""
    from transformers import GenerationConfig, StaticCache

    model, cfg = bench.model, bench.model.config
    total = bench.prompt_length + length
    per_seq = total * bench.kv_per_token
    largest = bench.largest_batch(per_seq)
    size = largest if batch == "max" else batch
    previous = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    ids = torch.tensor([bench.prompt] * size, device=bench.device)
    times = {}
    try:
        for n in (new_tokens[0], new_tokens[0], new_tokens[1]):  # the first run warms up
            gen = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=bench.temperature > 0,
                                   temperature=bench.temperature or 1.0, top_k=0, top_p=1.0, disable_compile=True,
                                   pad_token_id=0, eos_token_id=None)
            cache = StaticCache(config=cfg, max_cache_len=total)
            sync(bench.device)
            start = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen,
                                 **{CACHE_KW: cache})
            sync(bench.device)
            times[n] = time.perf_counter() - start
            if out.shape != (size, bench.prompt_length + n):
                raise RuntimeError(f"HF generate returned shape {tuple(out.shape)}")
            del cache, out
            free_memory()
    finally:
        model.set_attn_implementation(previous)
    short, long = new_tokens
    if times[long] <= times[short]:  # timing noise larger than the extra steps: no rate, not a negative one
        raise RuntimeError(f"hf_new_tokens={list(new_tokens)}: the {long}-token run took {times[long]:.4f} s, no "
                           f"longer than the {short}-token run's {times[short]:.4f} s, so their difference is no decode "
                           "rate; widen hf_new_tokens (e.g. [16, 80]).")
    rate = size * (long - short) / (times[long] - times[short])
    step_ms = 1e3 * size / rate
    floor = bench.floor_ms(size, total)  # SDPA over the whole static cache, every step
    return {"capacity": total, "batch": size, "kv_bytes_per_seq": per_seq, "largest_batch": largest,
            "run_tokens": long, "extrapolated": long < length, "tok_s": rate, "decode_tok_s": rate,
            "steady_step_ms": step_ms, "floor_step_ms": floor, "step_over_floor": step_ms / floor,
            "mean_live_tokens": total, "hf_seconds": {str(k): v for k, v in times.items()}, "events": 0}
