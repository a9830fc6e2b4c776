"""Rank 0's side of the ZeRO-3 gather protocol in ``RayRollouts.sync``, against a scripted pool: each attempt's
bucket list reaches the other ranks with the attempt's first gather (an attempt that fails before gathering tells
them nothing), the gathers follow the told order, ``[]`` releases them exactly once whatever fails, and the sync's
stats carry the sender's phase seconds."""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from kvroll.trainers.ray_rollouts import RayRollouts


class ScriptedPool:
    """Runs ``script(agree, fetch)`` as its update_weights; its fetcher records the gathers rank 0 enters."""

    def __init__(self, script):
        self.script, self.gathered, self.source = script, [], "model"
        self.plan = SimpleNamespace(fetcher=lambda model: self._fetch)

    def take_send_times(self):
        return {"gather_seconds": 0.5, "buckets": 3}

    def _fetch(self, index):
        self.gathered.append(index)
        return contextlib.nullcontext({})

    def update_weights(self, model, agree=None, fetch=None):
        self.script(agree, fetch)
        return {"version": 1, "seconds": 1.0}


def rollouts_with(script, monkeypatch, world=2):
    model = torch.nn.Linear(2, 2)
    model.weight.ds_id = 0  # what ZeRO-3 partitioning leaves on a parameter
    accelerator = SimpleNamespace(process_index=0, num_processes=world, unwrap_model=lambda m: m)
    rollouts = RayRollouts(SimpleNamespace(args=None, accelerator=accelerator, model=model), compression=None)
    rollouts.pool, told = ScriptedPool(script), []
    monkeypatch.setattr(rollouts, "_broadcast_indices", lambda indices: told.append(list(indices)))
    return rollouts, told


def gather(fetch, indices):
    for index in indices:
        with fetch(index):
            pass


def test_an_attempt_that_fails_before_gathering_tells_the_other_ranks_nothing(monkeypatch):
    def script(agree, fetch):
        agree([0, 1, 2])  # a worker is found dead before the first gather: the pool re-forms and starts over
        agree([0, 1, 2])
        gather(fetch, [0, 1, 2])
        agree([1])  # bucket 1 did not verify: resent alone
        gather(fetch, [1])
        agree([])

    rollouts, told = rollouts_with(script, monkeypatch)
    stats = rollouts.sync()
    assert told == [[0, 1, 2], [1], []] and rollouts.pool.gathered == [0, 1, 2, 1]
    assert stats == {"version": 1, "seconds": 1.0, "gather_seconds": 0.5, "buckets": 3}
    assert rollouts.pool.source is None  # no refresh through a gather on rank 0 alone


@pytest.mark.parametrize("pool_released", [True, False], ids=["resends-exhausted", "sync-failed"])
def test_the_other_ranks_are_released_once_whatever_fails(monkeypatch, pool_released):
    def script(agree, fetch):
        agree([0, 1])
        gather(fetch, [0, 1])
        if pool_released:
            agree([])  # the pool's own release before its WeightSyncError
        raise RuntimeError("weight sync failed")

    rollouts, told = rollouts_with(script, monkeypatch)
    with pytest.raises(RuntimeError, match="weight sync failed"):
        rollouts.sync()
    assert told == [[0, 1], []]


def test_a_gather_out_of_the_told_order_is_refused(monkeypatch):
    def script(agree, fetch):
        agree([0, 1])
        gather(fetch, [1])

    rollouts, told = rollouts_with(script, monkeypatch)
    with pytest.raises(RuntimeError, match="out of the order"):
        rollouts.sync()
    assert told == [[0, 1], []] and rollouts.pool.gathered == []


def test_one_rank_or_no_zero3_leaves_the_pool_its_own_fetch(monkeypatch):
    calls = []
    rollouts, told = rollouts_with(lambda agree, fetch: calls.append((agree, fetch)), monkeypatch, world=1)
    rollouts.sync()
    assert calls == [(None, None)] and told == [] and rollouts.pool.source == "model"


class EchoPool:
    """A pool whose ``submit(prompts, sampling, n)`` answers as ``RolloutPool`` does: ``len(prompts) * n``
    completions in input order (each prompt's n samples adjacent), token ids = (the prompt's ids, sample index)."""

    def __init__(self):
        self.calls = []

    def submit(self, prompts, sampling, n):
        self.calls.append((len(prompts), sampling, n))
        rows = [SimpleNamespace(token_ids=[*prompt, j], logprobs=[float(j)]) for prompt in prompts for j in range(n)]
        return SimpleNamespace(result=lambda: rows)


def test_run_puts_every_completion_on_its_own_row():
    """Chunks of several sizes (each size and sampling one request, n = the size) come back keyed by their global
    row: row start + j of a chunk gets its prompt's j-th sample, whatever the order the chunks were listed in. A chunk
    whose sampling differs (under 'full', fewer new tokens for a prompt near the positions) is a request of its own."""
    all_rows = [[1]] * 3 + [[2]] * 2 + [[3]] * 3 + [[4]] + [[5]] * 2 + [[6, 6]] * 3
    chunks = [(0, 3), (3, 2), (5, 3), (8, 1), (9, 2), (11, 3)]
    rollouts = RayRollouts.__new__(RayRollouts)
    rollouts.pool = EchoPool()

    def sampling_for(size, length):
        return SimpleNamespace(name=f"sampling{size}", max_new_tokens=8 if length == 1 else 4)

    out = rollouts.run(all_rows, chunks, sampling_for)
    want = {start + j: ([*all_rows[start], j], [float(j)]) for start, size in chunks for j in range(size)}
    assert out == want and sorted(out) == list(range(len(all_rows)))
    calls = sorted((rows, sampling.name, sampling.max_new_tokens, n) for rows, sampling, n in rollouts.pool.calls)
    assert calls == [(1, "sampling1", 8, 1), (1, "sampling3", 4, 3), (2, "sampling2", 8, 2), (2, "sampling3", 8, 3)]
