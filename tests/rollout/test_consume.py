"""The engine's read of a decode window (``GenerateRun._finish``: ``_consume``'s array operations on the live slots'
columns, then the finished slots freed) against a per-token reference loop.

The reference is the rule the engine documents, token by token in Python (as ``_consume`` ran before session 19):
at each step, each live slot's non-finite step raises (naming the sequence and its decode step), else its token
is appended with its logprob; a stop token finishes it ("stop", the token kept), reaching ``max_new_tokens``
finishes it ("length"), and a finished slot takes nothing more from the window. Random windows (slots free and
taken, stop sets empty or not, ids past the vocabulary, non-finite steps) must give the same completions, finish
reasons, freed slots, token count and progress total, or the same error.
"""
import copy
import random

import numpy as np
import pytest
import torch

from kvroll.rollout.requests import Completion
from kvroll.rollout.scheduler import GenerateRun, _Window
from kvroll.rollout.schedule import EventClock


class _Progress:
    def __init__(self):
        self.total = 0

    def update(self, n):
        self.total += n


def _run(owner, stop, max_new, vocab):
    run = GenerateRun.__new__(GenerateRun)
    run.owner, run.stop = owner, set(stop)
    run.stop_ids = np.fromiter((t for t in stop if t < vocab), dtype=np.int64)
    run.sp = type("SP", (), {"max_new_tokens": max_new})()
    run.e = type("E", (), {"stats": {"generated_tokens": 0}})()
    run.progress = _Progress()
    return run


def _reference(run, hist, active):
    """Token by token: the documented rule."""
    live = list(active)
    for step in range(hist.shape[1]):
        for slot in live:
            if not hist[2, step, slot]:
                comp = run.owner[slot]
                raise FloatingPointError(
                    f"non-finite logits at decode step {len(comp.token_ids)} of prompt {comp.prompt_index} "
                    f"sample {comp.sample_index}; refusing to sample from NaN/inf.")
        still = []
        for slot in live:
            comp, token = run.owner[slot], int(hist[0, step, slot])
            comp.token_ids.append(token)
            comp.logprobs.append(float(hist[1, step, slot]))
            run.e.stats["generated_tokens"] += 1
            run.progress.update(1)
            if token in run.stop:
                comp.finish_reason = "stop"
            elif len(comp.token_ids) >= run.sp.max_new_tokens:
                comp.finish_reason = "length"
            if comp.finish_reason is None:
                still.append(slot)
            else:
                run.owner[slot] = None
        live = still


def _engine_read(run, hist, active, comps=None):
    """``GenerateRun._finish`` on a window of these live slots (gaps among them: a column is a slot, not a rank) holding
    ``comps`` (default: the slots' owners), its history as the device holds it ([steps, 3, slots]): the live columns
    read with their sequences, the finished slots freed."""
    run.clock = EventClock(torch.device("cpu"))
    comps = [run.owner[s] for s in active] if comps is None else comps
    window = _Window(list(active), comps, hist.shape[1], (np.ascontiguousarray(hist.transpose(1, 0, 2)), None), 0)
    GenerateRun._finish(run, window)


def _state(run, comps):
    return ([None if c is None else (c.token_ids, c.logprobs, c.finish_reason) for c in comps],
            [o is None for o in run.owner], run.e.stats["generated_tokens"], run.progress.total)


def _random_window(rng):
    """(owner, active, stop, max_new, vocab, hist) of a random window, or None when no slot is live."""
    batch, window, max_new, vocab = rng.randint(1, 7), rng.randint(1, 6), rng.randint(1, 9), rng.randint(2, 7)
    owner = [None] * batch
    for slot in range(batch):
        if rng.random() < 0.75:
            done = rng.randint(0, max_new - 1)  # tokens so far: at least one left to take
            owner[slot] = Completion(slot, rng.randint(0, 3), [1, 2], [0] * done, [-0.5] * done)
    active = [s for s, c in enumerate(owner) if c is not None]
    if not active:
        return None
    steps = min([window] + [max_new - len(owner[s].token_ids) for s in active])  # as ``GenerateRun._launch``
    stop = rng.sample(range(vocab), rng.randint(0, 2)) + ([vocab, 2**64] if rng.random() < 0.3 else [])
    hist = np.zeros((3, steps, batch))
    hist[0] = [[rng.randrange(vocab) for _ in range(batch)] for _ in range(steps)]
    hist[1] = [[-rng.random() * 5 for _ in range(batch)] for _ in range(steps)]
    hist[2] = [[rng.random() > 0.03 for _ in range(batch)] for _ in range(steps)]
    return owner, active, stop, max_new, vocab, hist


@pytest.mark.parametrize("seed", range(4))
def test_the_window_read_is_the_per_token_rule(seed):
    rng = random.Random(seed)
    outcomes_seen = {"ok": 0, "error": 0, "stop": 0, "length": 0}
    for _ in range(400):
        case = _random_window(rng)
        if case is None:
            continue
        owner, active, stop, max_new, vocab, hist = case
        outcomes = []
        for read in (_reference, _engine_read):
            comps = copy.deepcopy(owner)
            run = _run(list(comps), stop, max_new, vocab)
            try:
                read(run, hist, list(active))
                outcomes.append(("ok", _state(run, comps)))
            except FloatingPointError as err:
                outcomes.append(("error", str(err)))
        assert outcomes[1] == outcomes[0], (hist, active, stop, max_new)
        outcomes_seen[outcomes[0][0]] += 1
        if outcomes[0][0] == "ok":
            for reason in ("stop", "length"):
                outcomes_seen[reason] += any(c is not None and c[2] == reason for c in outcomes[0][1][0])
    assert min(outcomes_seen.values()) >= 10, outcomes_seen  # every branch was reached


@pytest.mark.parametrize("seed", range(2))
def test_columns_of_sequences_finished_in_an_earlier_window_are_skipped(seed):
    """With windows overlapped, a window holds columns of sequences that finished in the window before it (their
    slots since freed, or refilled by a new sequence that is not in this window). Reading it must give the per-token
    rule on the other columns alone: the finished sequences and the slots' new occupants untouched, no error from
    their columns (non-finite steps there included)."""
    rng = random.Random(100 + seed)
    checked = {"ok": 0, "error": 0, "refilled": 0, "freed": 0}
    for _ in range(400):
        case = _random_window(rng)
        if case is None or len(case[1]) < 2:
            continue
        owner, active, stop, max_new, vocab, hist = case
        stale = [s for s in active if rng.random() < 0.4][: len(active) - 1]
        if not stale:
            continue
        newcomers = {s: (Completion(50 + s, 0, [3], [], []) if rng.random() < 0.5 else None) for s in stale}
        live = [s for s in active if s not in stale]
        outcomes = []
        for side in ("reference", "engine"):
            comps = copy.deepcopy(owner)
            finished = {s: comps[s] for s in stale}
            for comp in finished.values():
                comp.finish_reason = "stop"  # in the window before this one
            slots_now = [copy.deepcopy(newcomers[s]) if s in stale else comps[s] for s in range(len(comps))]
            run = _run(list(slots_now), stop, max_new, vocab)
            try:
                if side == "reference":
                    _reference(run, hist, live)
                else:
                    _engine_read(run, hist, active, [comps[s] for s in active])
                outcomes.append(("ok", _state(run, comps), _state(run, slots_now)))
            except FloatingPointError as err:
                outcomes.append(("error", str(err)))
        assert outcomes[1] == outcomes[0], (hist, active, stale, stop, max_new)
        checked[outcomes[0][0]] += 1
        checked["refilled"] += any(c is not None for c in newcomers.values())
        checked["freed"] += any(c is None for c in newcomers.values())
    assert min(checked.values()) >= 10, checked
