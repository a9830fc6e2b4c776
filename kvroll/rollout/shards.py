"""One ``RolloutPool.submit``: prompts cut into shards (whole groups, one per worker), gathered in input order.

    request = pool.submit(prompt_ids, sampling, n=8)   # shards launched on the workers (Ray object refs)
    completions = request.result()                      # waits; recovers from dead or hung workers

A shard keeps its seed when it runs again on a replacement worker, so recovered rows equal a fault-free run's.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from kvroll.rollout.engine import Completion
from kvroll.rollout.sampling import SamplingParams
from kvroll.rollout.worker import StaleWeightsError


class RefreshError(RuntimeError):
    """A replaced worker cannot be given the verified weights: the pool's source is gone or no longer holds them."""


@dataclass
class Shard:
    """A contiguous run of a request's prompts and the state of its current attempt on a worker."""

    start: int  # index of its first prompt
    prompts: list[list[int]]
    seed: int | None
    attempts: int = 0
    worker: int = -1
    ref: object = None
    deadline: float = 0.0
    actor: object = None  # the actor this attempt runs on (a slot may have been given a new one since)


class RolloutRequest:
    """Shards in flight; ``result()`` gathers them in input order, recovering from dead or hung workers."""

    def __init__(self, pool, shards: list[Shard], sampling: SamplingParams, n: int, num_prompts: int):
        self.pool, self.shards, self.sampling, self.n = pool, shards, sampling, n
        self.results: list[Completion | None] = [None] * (num_prompts * n)
        self.recoveries: list[str] = []

    def launch(self, shard: Shard, worker: int) -> None:
        """Start ``shard``'s next attempt on ``worker``, its deadline counted from the calls queued ahead of it."""
        slot = self.pool.slots[worker]
        sampling = dataclasses.replace(self.sampling, seed=shard.seed)
        shard.worker, shard.attempts = worker, shard.attempts + 1
        # An actor runs one call at a time: a shard queued behind calls still running or waiting on it (another
        # request's) starts when they end, so its deadline counts from theirs, not from now (bounded: one timeout
        # per call ahead of it). Calls that have ended, collected or not, no longer count.
        ahead = _in_flight(slot.queued)
        shard.actor, shard.ref = slot.actor, slot.actor.generate.remote(shard.prompts, sampling, self.n,
                                                                        self.pool.version)
        shard.deadline = max([time.monotonic(), *ahead.values()]) + self.pool.timeout_s
        slot.queued = {**ahead, shard.ref: shard.deadline}

    def done(self) -> bool:
        """Whether every shard has its rows (none in flight)."""
        return all(s.ref is None for s in self.shards)

    def result(self) -> list[Completion]:
        """Wait for every shard, relaunching those whose worker died or passed its deadline; the rows in input
        order, or a ``RuntimeError`` once a shard has failed ``max_task_retries`` + 1 times."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        while not self.done():
            pending = {s.ref: s for s in self.shards if s.ref is not None}
            wait = max(0.0, min(s.deadline for s in pending.values()) - time.monotonic())
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=wait)
            for ref in ready:
                shard = pending[ref]
                try:
                    completions = ray.get(ref)
                except (RayActorError, GetTimeoutError) as err:
                    self._recover(shard, f"worker died mid-rollout ({type(err).__name__})")
                    continue
                except StaleWeightsError:
                    self._recover(shard, "stale weights", kill=False)
                    continue
                self._place(shard, completions)
            now = time.monotonic()
            for shard in pending.values():
                if shard.ref is not None and shard.ref not in ready and now >= shard.deadline:
                    self._recover(shard, f"the shard took longer than worker_timeout_s={self.pool.timeout_s:g}s, "
                                         "the longest one shard may take", timed_out=True)
        missing = [i for i, row in enumerate(self.results) if row is None]
        if missing:  # a worker returned fewer rows than asked: never hand the caller holes
            raise RuntimeError(f"rollout: rows {missing[:8]} of {len(self.results)} never came back from the workers.")
        return self.results  # type: ignore[return-value]

    def _place(self, shard: Shard, completions: list[Completion]) -> None:
        asked = len(shard.prompts) * self.n
        if len(completions) > asked:  # the extra rows would land on the next shard's, under its prompts' indices
            raise RuntimeError(f"rollout: the worker of prompts {shard.start}..{shard.start + len(shard.prompts) - 1} "
                               f"returned {len(completions)} rows for {asked}.")
        shard.ref = None
        base = shard.start * self.n
        for offset, completion in enumerate(completions):
            completion.prompt_index = shard.start + offset // self.n
            self.results[base + offset] = completion

    def _recover(self, shard: Shard, reason: str, kill: bool = True, timed_out: bool = False) -> None:
        pool = self.pool
        self.recoveries.append(f"shard at prompt {shard.start} on worker {shard.worker}: {reason}")
        # A deadline per shard, not a heartbeat: a healthy shard longer than it is killed all the same.
        hint = (" If the rollouts are simply long, raise kvroll_worker_timeout_s (RolloutPool's worker_timeout_s)."
                if timed_out else "")
        if shard.attempts > pool.max_task_retries:
            raise RuntimeError(f"prompts {shard.start}..{shard.start + len(shard.prompts) - 1} failed "
                               f"{shard.attempts} times (last: {reason}); giving up.{hint}")
        current = pool.slots[shard.worker].actor is shard.actor  # not yet replaced by another request's recovery
        # shard.ref keeps the failed call until the shard is launched again: if the recovery itself fails, a later
        # result() meets the failure again instead of returning without the shard's rows
        if kill and current:
            pool.replace(shard.worker, f"{reason}; its shard runs again.{hint}" if timed_out else reason)
        worker = shard.worker
        if pool.slots[worker].version != pool.version:
            try:
                pool.refresh(worker)
            except RefreshError as err:  # run it on a worker that holds the verified weights, if one does
                holders = [i for i, slot in enumerate(pool.slots) if slot.version == pool.version]
                if not holders:
                    raise RefreshError(f"prompts {shard.start}..{shard.start + len(shard.prompts) - 1}: no rollout "
                                       f"worker holds weight version {pool.version} any more and {err}") from None
                worker = holders[shard.start % len(holders)]
        self.launch(shard, worker)


def _in_flight(queued: dict) -> dict:
    """The entries of ``queued`` ({generate call's object ref: its deadline}) whose calls have not ended."""
    if not queued:
        return {}
    import ray

    ended, _ = ray.wait(list(queued), num_returns=len(queued), timeout=0)
    ended = set(ended)
    return {ref: deadline for ref, deadline in queued.items() if ref not in ended}


def split_prompts(count: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous (start, end) ranges of ``count`` prompts over at most ``parts`` shards, sizes within one."""
    parts = max(1, min(parts, count))
    bounds = [count * k // parts for k in range(parts + 1)]
    return [(bounds[k], bounds[k + 1]) for k in range(parts)]


def shard_seed(seed: int | None, shard: int) -> int | None:
    return None if seed is None else (seed * 1_000_003 + shard * 7_919 + 1) % (1 << 62)
