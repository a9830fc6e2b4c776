"""Periodic compression inside decode windows, planned on the host (``kvroll/rollout/schedule.py``).

The host schedule must compress exactly the slots the device finds full, at the same steps, so the tokens equal
the read-the-device path's (a window ending at each compression) and a greedy replay's; and a window must run
through the compressions instead of ending at each.
"""
import random

import pytest
import torch

from kvroll import CompressionConfig, RolloutEngine, SamplingParams
from kvroll.kernels.rkv_redundancy import slot_ordered
from kvroll.rollout import scheduler as scheduler_module
from kvroll.rollout.replay import greedy_reference
from kvroll.rollout.schedule import EventClock, HostSchedule
from tests.conftest import tiny_model

CONFIGS = [("rkv", dict(budget=20, buffer=8, window=4)), ("snapkv", dict(budget=20, buffer=6, window=4)),
           ("lagkv", dict(budget=28, lag=4, sink_tokens=4)),
           ("hardkv", dict(budget=24, interval=8, window=4, sink_tokens=2, min_keep=2, p=0.6))]


def prompts_of(count, seed, low=3, high=30):
    rng = random.Random(seed)
    return [[rng.randrange(1, 256) for _ in range(rng.randint(low, high))] for _ in range(count)]


def test_schedule_applies_to_the_periodic_policies(tiny_llama):
    kinds = {}
    for policy, kwargs in [*CONFIGS, ("longflow", dict(budget=40)), ("h2o", dict(budget=40))]:
        cache = RolloutEngine(tiny_llama, CompressionConfig(policy, **kwargs), max_batch=2).cache
        kinds[policy] = HostSchedule.for_cache(cache, 2) is not None
    assert kinds == {"rkv": True, "snapkv": True, "lagkv": True, "hardkv": True, "longflow": False, "h2o": False}


@pytest.mark.parametrize("policy, kwargs", CONFIGS)
def test_host_schedule_compresses_exactly_the_full_slots(tiny_llama, policy, kwargs):
    """Every event compresses the slots whose cache the device finds full (no other), rows in time order (but
    Hard-KV's attention base's, compacted by filling holes); the greedy tokens equal a step-by-step replay that
    reads the device's fill before every step."""
    prompts = prompts_of(5, seed=4)  # different lengths: the slots fill up out of phase
    engine = RolloutEngine(tiny_llama, CompressionConfig(policy, **kwargs), max_batch=5, sync_every=16)
    cache = engine.cache
    compress, events, ordered = cache.compress_slots, [], []

    def checked(slots):
        full = cache.due_for_compression().nonzero()[:, 0].tolist()
        assert sorted(slots) == full, (slots, full)  # LagKV's events take the slots by region size
        pos = cache.pos[:, list(slots)]
        ordered.append(slot_ordered(pos >= 0, pos))  # what cache.time_ordered promises R-KV's kernel
        assert ordered[-1] or not cache.time_ordered
        events.append(list(slots))
        compress(slots)

    cache.compress_slots = checked
    sampling = SamplingParams(max_new_tokens=60, temperature=0.0, ignore_eos=True)
    got = [r.token_ids for r in engine.generate(prompts, sampling)]
    assert {slot for event in events for slot in event} == set(range(5))
    # Hard-KV's attention base compacts by filling holes: its rows leave time order after the first event
    assert cache.time_ordered == (policy != "hardkv") and all(ordered) == cache.time_ordered
    if policy == "hardkv":  # every 8 steps whatever the fill: 59 decode steps, events before steps 9, 17, ..., 57
        assert events == [list(range(5))] * 7
    else:
        assert any(len(event) == 1 for event in events)  # out of phase: slots compressed alone, between two steps
    tokens, _ = greedy_reference(RolloutEngine(tiny_llama, CompressionConfig(policy, **kwargs), max_batch=5),
                                 prompts, 60)
    assert got == tokens.tolist()


@pytest.mark.parametrize("policy, kwargs", CONFIGS)
def test_windows_run_through_compressions(policy, kwargs):
    """Greedy tokens and logprobs equal the read-the-device path's, with refills, stop tokens and compaction;
    the host schedule reads the device once per window, the other path once per compression as well. (Sampled
    tokens may differ: a slot freed mid-window is refilled at the window's end, so the paths' random draws fall
    on different rows.)"""
    model = tiny_model("qwen3")
    prompts = prompts_of(9, seed=7)
    config = CompressionConfig(policy, **kwargs)
    greedy = RolloutEngine(model, config, max_batch=4).generate(prompts, SamplingParams(max_new_tokens=40,
                                                                                         temperature=0.0))
    stop = greedy[0].token_ids[10]
    sampling = SamplingParams(max_new_tokens=40, temperature=0.0, stop_token_ids=(stop,))
    scheduled = RolloutEngine(model, config, max_batch=4, sync_every=16)
    got = scheduled.generate(prompts, sampling, n=2)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(scheduler_module.HostSchedule, "for_cache", classmethod(lambda cls, cache, slots: None))
        reading = RolloutEngine(model, config, max_batch=4, sync_every=16)
        want = reading.generate(prompts, sampling, n=2)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert [r.finish_reason for r in got] == [r.finish_reason for r in want]
    assert {r.finish_reason for r in got} == {"stop", "length"}
    for a, b in zip(got, want):
        assert a.logprobs == pytest.approx(b.logprobs, rel=1e-5, abs=1e-6)
    s, r = scheduled.stats, reading.stats
    # the reading path's windows end at its compressions (24 events here); the scheduled path's only at lengths
    # and refills (with its window overlap a slot is refilled a window later than without: a few more windows)
    assert s["decode_windows"] < r["decode_windows"] - len(r["policy_events"]) // 3


def test_host_schedule_bookkeeping():
    schedule = HostSchedule(capacity=10, kept_after=6, slots=3)
    schedule.place(0, 7)
    schedule.place(2, 9)
    assert schedule.due([0, 2]) == []
    schedule.step([0, 2])
    assert schedule.due([0, 2]) == [2]
    schedule.compressed([2])
    schedule.move(2, 1)
    assert schedule.room[1] == 4 and schedule.room[0] == 2
    for _ in range(2):
        schedule.step([0, 1])
    assert schedule.due([0, 1]) == [0]


def test_event_clock_settles_only_the_events_up_to_the_count():
    """``settle(upto)`` returns the events recorded up to the ``upto``-th, in order, and keeps a later window's
    (still running on a GPU) for the next call; each is settled once."""
    clock = EventClock(torch.device("cpu"))
    for step in (3, 5, 9):
        clock.time(step, lambda: None)
    first = clock.settle(2)
    assert [step for step, _ in first] == [3, 5] and all(seconds >= 0 for _, seconds in first)
    clock.time(12, lambda: None)
    assert [step for step, _ in clock.settle(3)] == [9]
    assert [step for step, _ in clock.settle(4)] == [12] and clock.settle(4) == []


@pytest.mark.parametrize("policy, kwargs", CONFIGS)
def test_a_reused_slot_decodes_as_a_fresh_engine(tiny_llama, policy, kwargs):
    """More prompts than slots, each slot reused: every completion (tokens and logprobs) equals a fresh one-slot
    engine's on that prompt alone, so nothing of a slot's previous sequence (e.g. Hard-KV's calibrated
    temperatures, LagKV's compressed count) leaks into the next."""
    prompts = prompts_of(3, seed=9, low=20, high=30)
    sampling = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    config = CompressionConfig(policy, **kwargs)
    engine = RolloutEngine(tiny_llama, config, max_batch=1)
    shared = engine.generate(prompts, sampling)
    assert len(engine.stats["policy_events"]) >= 3  # every sequence compressed
    for prompt, result in zip(prompts, shared):
        fresh = RolloutEngine(tiny_llama, config, max_batch=1)
        alone = fresh.generate([prompt], sampling)[0]
        assert alone.token_ids == result.token_ids
        assert alone.logprobs == pytest.approx(result.logprobs, rel=1e-5, abs=1e-6)
    # the slot's policy state after the last sequence (Hard-KV's temperatures, which a tiny model's tokens may not
    # reveal) is the fresh engine's
    assert fresh.cache.state.keys() == engine.cache.state.keys()
    for name, value in fresh.cache.state.items():
        torch.testing.assert_close(engine.cache.state[name][:, 0], value[:, 0], rtol=0, atol=0, msg=name)
