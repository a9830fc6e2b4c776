"""The host schedule, the engine's step loop and the replay at their edges: a moved or compacted slot keeps its size,
the next window is launched before the last is read, only live slots compress, and the replay checks its input."""
import pytest
import torch

from kvroll import CompressionConfig, RolloutEngine, SamplingParams
from kvroll.rollout.replay import replay
from kvroll.rollout.schedule import HostSchedule
from tests.conftest import tiny_model
from tests.rollout.test_schedule import prompts_of

LAGKV = CompressionConfig("lagkv", budget=28, lag=4, sink_tokens=4)
LAGKV_ODD = CompressionConfig("lagkv", budget=29, lag=5, sink_tokens=3)
HARDKV = CompressionConfig("hardkv", budget=24, interval=8, window=4, sink_tokens=2, min_keep=2, p=0.6)


def test_a_moved_slot_keeps_its_size():
    """``move`` carries a slot's size (LagKV's compressed region) with its room (mutant: the size reset to 0)."""
    schedule = HostSchedule(capacity=28, kept_after=None, slots=3, policy=LAGKV.build())
    schedule.place(2, 27, 40)  # a prompt compressed at prefill: a compressed region already
    size, room = schedule.sizes[2], schedule.room[2]
    assert size > 0
    schedule.move(2, 0)
    assert schedule.order([0]) == ([0], [size]) and schedule.room[0] == room


def device_sizes(cache, slots):
    """What the host schedule's per-slot sizes stand for, read from the device: LagKV's compressed count, Hard-KV's
    calibrated flag (a temperature set)."""
    if cache.policy.name == "lagkv":
        return cache.state["compressed"][0, slots].tolist()
    return [int(bool((cache.state["temp"][0, s] > 0).any())) for s in slots]


@pytest.mark.parametrize("config", [LAGKV_ODD, HARDKV], ids=["lagkv", "hardkv"])
def test_compacted_slots_hand_their_events_the_devices_sizes(config):
    """The long tail: sequences 0 and 1 stop early, so the live slots 2 and 3 move down to 0 and 1 (a smaller
    batch); every later event must take slots the device finds due, each with its own size (mutants:
    ``HostSchedule.move`` dropping the size; ``GenerateRun._compact`` not moving the schedule with the slot)."""
    model = tiny_model("llama")
    prompts = prompts_of(4, seed=0, low=8, high=20)  # the moved slots' sizes differ from the freed ones
    free = RolloutEngine(model, config, max_batch=4).generate(
        prompts, SamplingParams(max_new_tokens=70, temperature=0.0, ignore_eos=True))
    late = [set(r.token_ids) for r in free[2:]]
    # a stop token for each of sequences 0 and 1, after a compression (step 30), that 2 and 3 never sample
    stops = [next(t for t in free[i].token_ids[30:] if t not in free[i].token_ids[:30] and not any(t in s for s in late))
             for i in (0, 1)]
    engine = RolloutEngine(model, config, max_batch=4, sync_every=4)
    cache, moves, events = engine.cache, [], []
    move, compress = cache.move_slot, cache.compress_slots

    def moved(src, dst):
        moves.append((src, dst))
        move(src, dst)

    def checked(slots):
        events.append((list(slots), cache.event_counts))
        assert cache.event_counts == device_sizes(cache, list(slots)), (slots, cache.event_counts)
        assert cache.due_for_compression()[list(slots)].all(), slots  # each one full (or due) on the device
        compress(slots)

    cache.move_slot, cache.compress_slots = moved, checked
    got = engine.generate(prompts, SamplingParams(max_new_tokens=70, temperature=0.0, stop_token_ids=stops))
    assert [r.finish_reason for r in got] == ["stop", "stop", "length", "length"]
    assert moves and any(s in (0, 1) for slots, _ in events[-2:] for s in slots)  # events after the moves
    assert [r.token_ids for r in got[2:]] == [r.token_ids for r in free[2:]]


@pytest.mark.parametrize("policy", ["rkv", "full"])
def test_replay_refuses_a_closed_engine(policy):
    """generate refuses a closed engine; replay raised AttributeError ('NoneType' ... 'generator') under a
    compressing policy and, under full, silently allocated a new cache (undoing close())."""
    kwargs = dict(budget=20, buffer=4, window=2) if policy == "rkv" else {}
    engine = RolloutEngine(tiny_model(), CompressionConfig(policy, **kwargs), max_batch=2)
    engine.close()
    with pytest.raises(RuntimeError, match=r"replay: this engine was closed"):
        list(replay(engine, [[1, 2, 3]], num_steps=3))
    assert engine.cache is None


@pytest.mark.parametrize("targets, match", [
    (torch.zeros(1, 4, dtype=torch.long), r"targets=\(1, 4\) torch.int64 is invalid: .*one row per prompt \(B = 2\)"),
    (torch.zeros(3, 4, dtype=torch.long), r"targets=\(3, 4\) torch.int64 is invalid"),
    (torch.zeros(2, 4), r"targets=\(2, 4\) torch.float32 is invalid: pass an integer tensor"),
    (torch.full((2, 4), 300), r"targets holds token id 300, outside the model's vocabulary \[0, 256\)"),
    (torch.full((2, 4), -1), r"targets holds token id -1, outside"),
])
def test_replay_checks_its_targets(targets, match):
    """A [1, T] row was broadcast to every prompt and float ids truncated, silently; a wrong batch or an id past
    the vocabulary failed deep in torch (a shape error, an embedding IndexError) after the prefills."""
    engine = RolloutEngine(tiny_model(), CompressionConfig("rkv", budget=20, buffer=4, window=2), max_batch=2)
    with pytest.raises(ValueError, match=match):
        list(replay(engine, [[1, 2, 3], [4, 5]], targets))
    assert engine.stats["prefills"] == 0  # refused before any work


@pytest.mark.parametrize("config", [CompressionConfig("full"), LAGKV], ids=["full", "lagkv"])
def test_the_next_window_is_launched_before_the_last_is_read(monkeypatch, config):
    """``GenerateRun.run``'s overlap: window k + 1 is queued before window k is read (mutant: ``overlap = False``, which
    gives the same tokens on a CPU but a host sync between every two windows on a GPU)."""
    from kvroll.rollout import scheduler as scheduler_module

    order = []
    launch, finish = scheduler_module.GenerateRun._launch, scheduler_module.GenerateRun._finish

    def launched(self, buffers, pending):
        window = launch(self, buffers, pending)
        order.append("launch" if window is not None else "none")
        return window

    def finished(self, window):
        order.append("finish")
        finish(self, window)

    monkeypatch.setattr(scheduler_module.GenerateRun, "_launch", launched)
    monkeypatch.setattr(scheduler_module.GenerateRun, "_finish", finished)
    engine = RolloutEngine(tiny_model(), config, max_batch=2, sync_every=4)
    engine.generate(prompts_of(2, seed=1), SamplingParams(max_new_tokens=13, temperature=0.0, ignore_eos=True))
    # 12 decode steps in windows of 4: each window read after the next is queued
    assert order == ["launch", "launch", "finish", "launch", "finish", "none", "finish", "none"]


def test_the_read_the_device_path_compresses_only_live_slots(monkeypatch):
    """Without a host schedule (a periodic policy the schedule does not cover) a full slot is found on the device;
    a freed slot inside the batch is still decoded (garbage) and fills up, and must not be compressed (mutant:
    ``_periodic_work`` not masking the free slots: an event's work on nobody's sequence)."""
    from kvroll.rollout import scheduler as scheduler_module

    monkeypatch.setattr(scheduler_module.HostSchedule, "for_cache", classmethod(lambda cls, cache, slots: None))
    model = tiny_model("llama")
    config = CompressionConfig("rkv", budget=20, buffer=8, window=4)
    prompts = prompts_of(4, seed=5, low=8, high=20)  # 3 live of 4 slots: a hole in the batch
    free = RolloutEngine(model, config, max_batch=4).generate(
        prompts, SamplingParams(max_new_tokens=60, temperature=0.0, ignore_eos=True))
    stop = next(t for t in free[0].token_ids[1:8] if not any(t in r.token_ids for r in free[1:]))
    engine = RolloutEngine(model, config, max_batch=4)
    runs, compressed = [], []
    periodic, compress = scheduler_module.GenerateRun._periodic_work, engine.cache.compress_slots

    def tracked(self, active):
        runs.append(self)
        return periodic(self, active)

    def checked(slots):
        compressed.append([(int(s), runs[-1].owner[int(s)] is not None) for s in slots])
        compress(slots)

    monkeypatch.setattr(scheduler_module.GenerateRun, "_periodic_work", tracked)
    engine.cache.compress_slots = checked
    got = engine.generate(prompts, SamplingParams(max_new_tokens=60, temperature=0.0, stop_token_ids=[stop]))
    assert got[0].finish_reason == "stop" and [r.finish_reason for r in got[1:]] == ["length"] * 3
    assert compressed and all(live for event in compressed for _, live in event), compressed


def test_replay_compresses_only_the_replayed_slots():
    """Replay decodes every slot of the engine; the slots past its prompts fill up with garbage and must not be
    compressed (mutant: replay's ``due[batch:] = False`` dropped)."""
    from kvroll.rollout.replay import greedy_reference

    engine = RolloutEngine(tiny_model(), CompressionConfig("rkv", budget=20, buffer=4, window=2), max_batch=3)
    compressed, compress = [], engine.cache.compress_slots

    def recorded(slots):
        compressed.extend(int(s) for s in slots)
        compress(slots)

    engine.cache.compress_slots = recorded
    greedy_reference(engine, [[1, 2, 3, 4]], 40)
    assert compressed and set(compressed) == {0}, compressed



def test_steps_until_due_is_the_room_left_in_a_placed_slot():
    """The read-the-device path's window length: a placed slot may take capacity - kept steps before it is full
    (mutant: ``steps_until_due`` one short, which ends that path's windows a step early)."""
    engine = RolloutEngine(tiny_model(), CompressionConfig("rkv", budget=20, buffer=8, window=4), max_batch=2)
    prompt, _ = engine._prefill(list(range(1, 12)))
    engine.cache.place(1, prompt)
    assert int(engine.cache.steps_until_due()[1]) == engine.cache.capacity - 11 == 17



def test_a_compaction_keeping_all_but_one_slot_writes_next_into_the_free_one():
    """R-KV with buffer=1 keeps capacity - 1 tokens per event: the next token goes to the one free slot, not over a
    kept token (mutant: ``compact`` clamping ``write_idx`` to capacity - 2)."""
    engine = RolloutEngine(tiny_model(), CompressionConfig("rkv", budget=23, buffer=1, window=1), max_batch=1)
    # the prompt kept at 23 tokens, one decode step: the slot is full (24)
    engine.generate([list(range(1, 30))], SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True))
    cache = engine.cache
    assert cache.capacity == 24 and (cache.count[:, 0] == 24).all()
    cache.compress_slots([0])
    assert (cache.count[:, 0] == 23).all() and (cache.write_idx[:, 0] == 23).all()
