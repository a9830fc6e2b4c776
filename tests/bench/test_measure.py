"""The bench's timeline and step curve: a point stands on decode windows, never on the host loop that hands a
window's tokens over; and the commit a report records is the measured code's, or none."""
import subprocess

import pytest
import torch

from kvroll.bench import sweep
from kvroll.bench.measure import Timeline, step_curve


class FakeBench:
    prompt_length = 100

    def floor_ms(self, batch, live_tokens):
        return 0.5


class Clock:
    """A clock the test advances: decode windows and the host loop that hands their tokens over."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _run(timeline: Timeline, clock: Clock, windows: int, window: int, batch: int, decode_s: float,
         host_s: float) -> None:
    """``windows`` decode windows of ``decode_s`` each, their tokens handed over one by one over ``host_s``."""
    for _ in range(windows):
        clock.now += decode_s
        for _ in range(window * batch):
            timeline.update(1)
            clock.now += host_s / (window * batch)


def test_a_window_handed_over_slowly_is_one_mark_at_its_sync():
    clock = Clock()
    timeline = Timeline(batch=4, clock=clock)
    _run(timeline, clock, windows=6, window=5, batch=4, decode_s=0.02, host_s=0.012)  # a burst 6x the 2 ms gap
    steps, times = zip(*timeline.marks)
    assert steps == (5, 10, 15, 20, 25, 30)
    assert [round(b - a, 6) for a, b in zip(times, times[1:])] == [0.032] * 5  # the previous burst + decode


def test_windows_shorter_than_the_gap_are_marked_at_each_sync():
    """A tiny model on a CPU decodes a window in less than the 2 ms gap: the engine's ``synced`` call still marks
    each window (the gap's guess alone merged them into one mark)."""
    marks = {}
    for synced in (False, True):
        clock = Clock()
        timeline = Timeline(batch=2, clock=clock)
        for _ in range(5):
            clock.now += 0.0005  # a window of 3 steps decoded in 0.5 ms
            if synced:
                timeline.synced()
            for _ in range(3 * 2):
                timeline.update(1)
                clock.now += 1e-5
        marks[synced] = timeline.marks
    assert len(marks[False]) == 1
    assert [m[0] for m in marks[True]] == [3, 6, 9, 12, 15]
    assert [round(b[1] - a[1], 6) for a, b in zip(marks[True], marks[True][1:])] == [0.00056] * 4


def test_step_curve_points_span_whole_windows_and_the_remainder_joins_the_last():
    clock = Clock()
    timeline = Timeline(batch=2, clock=clock)
    _run(timeline, clock, windows=9, window=4, batch=2, decode_s=0.02, host_s=0.008)
    steps, times = zip(*timeline.marks)
    assert steps == (4, 8, 12, 16, 20, 24, 28, 32, 36)
    curve = step_curve(FakeBench(), steps, times, batch=2, capacity=64, points=3)  # span 10 steps
    # stretches 4..16 and 16..36: the 8 steps after 28 are shorter than the span and join the last stretch
    assert [c[0] for c in curve] == [100 + (4 + 16) / 2, 100 + (16 + 36) / 2]
    assert [c[1] for c in curve] == pytest.approx([7.0, 7.0])  # (20 + 8) ms a window of 4 steps
    assert [c[2] for c in curve] == [0.5, 0.5]
    # with the live tokens of each stretch's decode steps (a periodic policy's LiveCounts.mean): their floor
    class LiveBench(FakeBench):
        def floor_ms(self, batch, live_tokens):
            return live_tokens / 100

    spans = []
    assert [c[2] for c in step_curve(LiveBench(), steps, times, batch=2, capacity=64, points=3)] == [0.64] * 2
    curve = step_curve(LiveBench(), steps, times, batch=2, capacity=64, points=3,
                       live=lambda first, stop: spans.append((first, stop)) or 32.0 + first)
    assert spans == [(3, 15), (15, 35)] and [c[2] for c in curve] == [0.35, 0.47]


@pytest.mark.parametrize("case", ["env", "clean", "changed", "not_top"])
def test_git_commit_is_the_measured_code_or_none(case, tmp_path, monkeypatch):
    root = tmp_path / "repo"
    (root / "kvroll" / "bench").mkdir(parents=True)
    (root / "kvroll" / "bench" / "sweep.py").write_text("x = 1\n")
    git = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git[:3] + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "."], check=True)
    subprocess.run(git + ["commit", "-qm", "c"], check=True)
    head = subprocess.run(git[:3] + ["rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    where = root / "kvroll" / "bench" / "sweep.py"
    monkeypatch.delenv("KVROLL_GIT_COMMIT", raising=False)
    if case == "env":
        monkeypatch.setenv("KVROLL_GIT_COMMIT", "abc123")
    if case == "changed":  # a stale .git under newer files, as a copy of the tree made on another machine
        where.write_text("x = 2\n")
    if case == "not_top":  # kvroll copied into a folder of some other repository
        where = root / "copy" / "kvroll" / "bench" / "sweep.py"
        where.parent.mkdir(parents=True)
        where.write_text("x = 1\n")
    monkeypatch.setattr(sweep, "__file__", str(where))
    expected = {"env": "abc123", "clean": head, "changed": None, "not_top": None}[case]
    assert sweep._git_commit() == expected


def test_live_counts_sample_every_step_and_average_a_span_of_steps():
    """``LiveCounts`` sums the cache's counts after each decode step (the engine's ``after_step`` hook, set by
    ``Timeline(after_step=...)``), and averages a span of steps per (layer, slot, head); a span not wholly sampled
    is None."""
    from kvroll.bench.measure import LiveCounts

    count = torch.zeros(2, 3, 4, dtype=torch.int64)  # [layers, slots, KV heads]
    counts = LiveCounts(count, max_steps=5)
    timeline = Timeline(batch=2, after_step=counts.sample)
    fills = [10, 20, 30, 40, 50, 60]  # the sixth step overflows the buffer: not written
    for fill in fills:
        count.fill_(fill)
        timeline.after_step()
    assert counts.n == 6 and counts.buf.tolist() == [v * 24 for v in fills[:5]]
    assert counts.mean(0, 5) == pytest.approx(30.0) and counts.mean(2, 4) == pytest.approx(35.0)
    assert counts.mean(3, 6) is None and counts.mean(2, 2) is None and counts.mean(-1, 2) is None
    assert not hasattr(Timeline(batch=2), "after_step")  # the engine samples nothing without the hook


def test_a_synchronous_timeline_marks_each_window_when_it_was_queued():
    """On a CPU the engine queues window k + 1 before it reads window k, so at k's sync k + 1 has run too: a
    synchronous timeline marks window k at the time it was queued (``kvroll_window_queued()``), not at its sync."""
    marks = {}
    for synchronous in (False, True):
        clock = Clock()
        timeline = Timeline(batch=1, clock=clock, synchronous=synchronous)
        for k in range(4):  # window k queued, then read after window k + 1 was queued (and, on a CPU, ran)
            clock.now += 0.010
            timeline.kvroll_window_queued()
            if k:
                clock.now += 1e-4
                timeline.synced()
                timeline.update(3)
        marks[synchronous] = timeline.marks
    assert [m[0] for m in marks[True]] == [m[0] for m in marks[False]] == [3, 6, 9]
    assert [round(m[1], 6) for m in marks[True]] == [0.01, 0.02, 0.0301]  # windows 0, 1, 2 when they ran
    assert [round(m[1], 6) for m in marks[False]] == [0.0201, 0.0302, 0.0403]  # a GPU's: at each sync


def test_engine_marks_on_a_cpu_carry_their_own_windows_steps(tiny_llama):
    """Through the engine on a CPU (window overlap on): with a clock that counts the decode steps queued, every
    window's mark (t tokens) carries the t - 1 decode steps that made them (the first token comes from the
    prefill), with a periodic policy's host schedule too."""
    from kvroll import CompressionConfig, RolloutEngine, SamplingParams

    model = tiny_llama
    for compression in (CompressionConfig("full"), CompressionConfig("streaming", budget=24)):
        engine = RolloutEngine(model, compression=compression, max_batch=2, sync_every=4)
        timeline = Timeline(batch=2, clock=lambda: float(engine.stats["decode_steps"]), synchronous=True)
        engine.generate([[1, 2, 3, 4, 5]], SamplingParams(max_new_tokens=19, ignore_eos=True, seed=0), n=2,
                        progress=timeline)
        steps, times = zip(*timeline.marks)
        assert steps[-1] == 19 and len(steps) >= 5
        assert [t - 1 for t in steps[1:]] == [int(x) for x in times[1:]]


def test_full_rate_integrates_every_step_it_counts():
    """``_integrate`` (``full``'s decode seconds): from the prompt to prompt + length, the curve held flat before its
    first point and after its last (which sits at its window's middle, short of the end): a constant step of s ms
    over L tokens is L * s ms, and a linear curve is integrated exactly between its points."""
    from kvroll.bench.measure import _integrate

    flat = [[110.0, 5.0, 1.0], [150.0, 5.0, 1.0]]
    assert _integrate(100, flat, 164) == pytest.approx(64 * 5.0 / 1e3)
    linear = [[100.0 + c, 1.0 + c / 10, 1.0] for c in (8.0, 40.0, 56.0)]  # 1 ms + 0.1 ms per token of context
    want = 8 * 1.8 + (56 - 8) * (1.8 + 6.6) / 2 + 8 * 6.6  # flat 100..108, the line 108..156, flat 156..164
    assert _integrate(100, linear, 164) == pytest.approx(want / 1e3)
    assert _integrate(100, [[164.0, 2.0, 1.0]], 164) == pytest.approx(64 * 2.0 / 1e3)  # a point at the end


def test_a_progress_object_with_its_own_queued_attribute_is_left_alone(tiny_llama):
    """``generate(progress=)`` needs only ``update(n)``: the bench's window hook has a name of its own
    (``kvroll_window_queued``), so a user's progress object with an unrelated ``queued`` counter still runs."""
    from kvroll import CompressionConfig, RolloutEngine, SamplingParams

    class Bar:
        def __init__(self):
            self.queued, self.n = 0, 0  # e.g. a job counter

        def update(self, n):
            self.n += n

    bar = Bar()
    engine = RolloutEngine(tiny_llama, compression=CompressionConfig("full"), max_batch=2, sync_every=4)
    engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=9, ignore_eos=True, seed=0), n=2, progress=bar)
    assert bar.n == 18 and bar.queued == 0


def test_full_integral_clips_and_sorts_its_points():
    """Points past the output's end or before the prompt count at those edges, and their order does not matter."""
    from kvroll.bench.measure import _integrate

    flat = [[150.0, 5.0, 1.0], [90.0, 5.0, 1.0], [170.0, 5.0, 1.0]]  # unsorted, one below the prompt, one past the end
    assert _integrate(100, flat, 164) == pytest.approx(64 * 5.0 / 1e3)


def test_bench_config_refuses_full_steps_past_an_output_length():
    from kvroll.bench.config import BenchConfig

    with pytest.raises(ValueError, match=r"full_steps=48 must be below every output length \(the shortest, 16\)"):
        BenchConfig(model="smollm2", policies=["full", "rkv"], budgets=[16], batch_sizes=[1], output_lengths=[16, 64],
                    full_steps=48)
    BenchConfig(model="smollm2", policies=["rkv"], budgets=[16], batch_sizes=[1], output_lengths=[16], full_steps=48,
                hf_generate=False)  # (HF generate's default 80 tokens would run past the 16-token output)


def test_roofline_floor_is_weights_and_every_sequences_live_kv_over_the_bandwidth(tiny_llama):
    """``floor_ms`` by hand: (weight bytes + batch x live tokens x K/V bytes per token) / bandwidth; the per-token
    bytes are K and V of every layer and KV head (fp32 here), the weights every parameter once but an untied input
    embedding table."""
    from types import SimpleNamespace

    from kvroll.bench.measure import Bench
    from kvroll.bench.models import kv_bytes_per_token, weight_bytes

    cfg = tiny_llama.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    assert kv_bytes_per_token(tiny_llama) == cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * 4
    unique = {p.data_ptr(): p.numel() * 4 for p in tiny_llama.parameters()}
    embed = tiny_llama.model.embed_tokens.weight  # untied: a step reads only its rows' entries, not counted
    assert tiny_llama.lm_head.weight is not embed
    assert weight_bytes(tiny_llama) == sum(unique.values()) - embed.numel() * 4
    from transformers import LlamaConfig, LlamaForCausalLM
    tied = LlamaForCausalLM(LlamaConfig(**{**tiny_llama.config.to_dict(), "tie_word_embeddings": True}))
    assert tied.lm_head.weight is tied.model.embed_tokens.weight  # the head reads it whole: counted, once
    assert weight_bytes(tied) == sum({p.data_ptr(): p.numel() * 4 for p in tied.parameters()}.values())
    bench = SimpleNamespace(weight_bytes=3_000_000, kv_per_token=256, bandwidth=2e9)
    assert Bench.floor_ms(bench, 8, 100.5) == pytest.approx(1e3 * (3_000_000 + 8 * 100.5 * 256) / 2e9)


def test_copy_bandwidth_counts_the_bytes_read_and_written(monkeypatch):
    """The copy moves ``nbytes`` (read) into ``nbytes`` (written): 2 x nbytes over the median time of the copies."""
    from kvroll.bench import measure

    copied, times = [], iter([3e-3, 1e-3, 2e-3, 2e-3, 9e-3, 2e-3, 1e-3, 2e-3, 5e-3, 2e-3])

    def seconds(fn, device):
        out = fn()
        copied.append(out.numel() * out.element_size())
        return next(times)

    monkeypatch.setattr(measure, "_seconds", seconds)
    assert measure.copy_bandwidth("cpu", nbytes=1 << 16) == pytest.approx(2 * (1 << 16) / 2e-3)
    assert copied == [1 << 16] * 10


def test_periodic_share_by_hand():
    """Events (decode steps before it, seconds) every 10 steps: the share is the median event after the first (the
    fill phase's end) over (median steps between events x the pure step of the last quarter, its events taken out)."""
    from kvroll.bench.measure import periodic_share

    events = [(10, 0.100), (20, 0.004), (30, 0.006), (40, 0.005)]
    steps, times = [0, 10, 20, 30, 40, 50], [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    share = periodic_share(events, steps, times, tail=3)  # marks 3 .. 5: steps 30 .. 50, events at 30 and 40 in it
    pure = (5.0 - 3.0 - 0.006 - 0.005) / 20
    assert share["events"] == 4 and share["event_interval_steps"] == 10
    assert share["event_ms_median"] == pytest.approx(5.0) and share["pure_step_ms"] == pytest.approx(1e3 * pure)
    assert share["policy_share"] == pytest.approx(0.005 / (10 * pure))


def test_bench_memory_table_is_in_mib():
    """The KV memory column is bytes / 2**20 (MiB), one row per (policy, output)."""
    from kvroll.bench.report import _memory

    rows = [{"policy": "rkv", "budget": 40, "length": 48, "capacity": 48, "kv_bytes_per_seq": 3 * 2**20,
             "largest_batch": 16},
            {"policy": "rkv", "budget": 40, "length": 48, "capacity": 48, "kv_bytes_per_seq": 3 * 2**20,
             "largest_batch": 16}]
    lines = _memory(rows, {"device": "cpu"}, {"reserve_gb": 1, "max_batch_cap": 64})
    assert [line for line in lines if line.startswith("| rkv")] == ["| rkv 40 | 48 | 48 | 3.00 MiB | 16 |"]


def test_full_floor_counts_each_windows_mean_context(tiny_llama):
    """``full``'s curve: each point's floor is that of its timed window's middle context (start + steps / 2), the
    context the point stands at; the row's live tokens are the last point's."""
    from types import SimpleNamespace

    from kvroll.bench.measure import measure_full
    from kvroll.rollout.sampling import SamplingParams

    seen = []
    bench = SimpleNamespace(model=tiny_llama, prompt_length=8, device=torch.device("cpu"), prompt=[1] * 8,
                            switches=dict, largest_batch=lambda per_seq: 2,
                            sampling=lambda n: SamplingParams(max_new_tokens=n, temperature=1.0, ignore_eos=True,
                                                              seed=0),
                            floor_ms=lambda batch, live: seen.append((batch, live)) or live / 10)
    row = measure_full(bench, "max", length=32, steps=4)
    starts = [max(1, min(c, 8 + 32 - 4 - 1)) for c in (10, 12, 16, 24, 32, 40)]  # contexts 8 + 32 x 1/16 .. 1
    assert [c[0] for c in row["step_curve"]] == [s + 2 for s in starts]
    assert [c[2] for c in row["step_curve"]] == pytest.approx([(s + 2) / 10 for s in starts])
    assert seen == [(2, s + 2) for s in starts] and row["mean_live_tokens"] == starts[-1] + 2


def test_periodic_share_takes_out_the_event_at_the_tails_first_step():
    """An event after st decode steps runs before decode step st + 1, inside the mark interval (st + 1, st + 2)
    (the engine on a CPU: a 50 ms sleep in each compression lands there); the tail's marks 7 .. 9 hold the events of
    st = 6 and 7, so the pure step over them is the step alone."""
    from kvroll.bench.measure import periodic_share

    steps = list(range(1, 10))  # a mark per token (a CPU), token t from decode step t - 1
    events = [(2, 0.5), (6, 0.5)]  # each in the interval of marks (st + 1, st + 2)
    times, now = [0.0], 0.0
    for a in steps[1:]:
        now += 1.0 + sum(sec for st, sec in events if st + 2 == a)
        times.append(now)
    share = periodic_share(events, steps, times, tail=len(steps) * 3 // 4)  # marks 7 .. 9
    assert share["pure_step_ms"] == pytest.approx(1e3)
    assert share["policy_share"] == pytest.approx(0.5 / (4 * 1.0))


def test_a_run_of_four_marks_has_a_steady_window(tiny_llama):
    """Four marks (4 tokens, a mark per token on a CPU): the steady window is the last two marks, not the last one
    alone (was: a ZeroDivisionError after the model loaded)."""
    from kvroll.bench.measure import Bench, measure_policy

    bench = Bench(tiny_llama, prompt_length=16, reserve_gb=0, max_batch_cap=8, temperature=1.0, seed=0)
    row = measure_policy(bench, "streaming", 24, 2, length=4, steady_steps=24)
    assert row["run_tokens"] == 4 and not row["extrapolated"] and row["steady_step_ms"] > 0
    assert row["tok_s"] == pytest.approx(row["decode_tok_s"])


def test_a_cache_that_never_fills_floors_at_its_steady_windows_mean_fill(tiny_llama):
    """A run shorter than the cache's fill (streaming at budget 256 after a 16-token prompt, 40 tokens): the floor's
    live tokens are the steady window's mean fill (prompt + the decode steps so far), not the last step's."""
    from kvroll.bench.measure import Bench, measure_policy

    bench = Bench(tiny_llama, prompt_length=16, reserve_gb=0, max_batch_cap=8, temperature=1.0, seed=0)
    row = measure_policy(bench, "streaming", 256, 2, length=40, steady_steps=24)
    first = 40 * 3 // 4 + 1  # a mark per token on a CPU: the steady window is decode steps first .. 39
    window = [16 + s for s in range(first, 40)]
    assert row["live_tokens_end"] == 55 and row["mean_live_tokens"] == pytest.approx(sum(window) / len(window))


def test_an_extrapolated_rate_extends_the_run_at_its_steady_step(tiny_llama, monkeypatch):
    """A run shorter than the output: the rate counts the output's tokens after the first mark over the run's decode
    time plus the rest at the steady step (the last quarter of the marks), by hand from the run's own marks."""
    from kvroll.bench import measure

    seen = []

    class Spy(measure.Timeline):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            seen.append(self)

    monkeypatch.setattr(measure, "Timeline", Spy)
    bench = measure.Bench(tiny_llama, prompt_length=16, reserve_gb=0, max_batch_cap=8, temperature=1.0, seed=0)
    row = measure.measure_policy(bench, "streaming", 24, 2, length=64, steady_steps=12)
    steps, times = zip(*seen[0].marks)
    assert row["extrapolated"] and row["run_tokens"] == 24 - 16 + 12 == steps[-1]
    tail = len(steps) * 3 // 4
    step_s = (times[-1] - times[tail]) / (steps[-1] - steps[tail])
    assert row["steady_step_ms"] == pytest.approx(1e3 * step_s)
    assert row["tok_s"] == pytest.approx(2 * (64 - steps[0]) / (times[-1] - times[0] + (64 - steps[-1]) * step_s))


def test_hf_rate_is_the_difference_of_two_runs(tiny_llama, monkeypatch):
    """HF generate's decode rate: the two lengths' extra tokens over their extra time (the prefill cancels): a
    clock that gives each run 0.5 s of prefill and 10 ms a step reads 100 steps/s of every sequence."""
    from kvroll.bench import measure

    bench = measure.Bench(tiny_llama, prompt_length=8, reserve_gb=0, max_batch_cap=8, temperature=1.0, seed=0)
    clock = [0.0]
    monkeypatch.setattr(measure.time, "perf_counter", lambda: clock[0])
    real = tiny_llama.generate

    def generate(*args, generation_config, **kwargs):
        clock[0] += 0.5 + 0.01 * generation_config.max_new_tokens
        return real(*args, generation_config=generation_config, **kwargs)

    monkeypatch.setattr(tiny_llama, "generate", generate)
    row = measure.measure_hf(bench, 2, 32, [4, 16])
    assert row["tok_s"] == pytest.approx(2 * 100) and row["steady_step_ms"] == pytest.approx(10.0)
    assert row["hf_seconds"] == pytest.approx({"4": 0.54, "16": 0.66}) and row["extrapolated"]


def test_roofline_table_rows_are_the_json_columns():
    """The roofline table's columns are the row's numbers, in the header's order."""
    from kvroll.bench.report import _roofline

    row = {"policy": "rkv", "budget": 40, "batch": 2, "length": 48, "mean_live_tokens": 28.8, "steady_step_ms": 3.0,
           "floor_step_ms": 1.5, "step_over_floor": 2.0, "kernels_per_step": None}
    lines = _roofline([row], {"device": "cpu"})
    header = next(line for line in lines if line.startswith("| policy"))
    assert header.startswith("| policy | batch | output | live tokens per head | step (ms) | floor (ms) | step / floor")
    assert "| rkv 40 | 2 | 48 | 29 | 3.00 | 1.50 | 2.00x | - | - |" in lines


def test_periodic_share_takes_the_median_interval():
    """Steps between events: their median (a long gap, e.g. a refill, does not stretch the typical interval)."""
    from kvroll.bench.measure import periodic_share

    events = [(10, 0.1), (20, 0.004), (30, 0.004), (60, 0.004)]
    share = periodic_share(events, [0, 20, 40, 60, 80], [0.0, 1.0, 2.0, 3.0, 4.0], tail=3)
    assert share["event_interval_steps"] == 10
