"""Periodic compression inside a decode window, planned on the host without reading the device.

A periodic policy compresses a slot when its cache is full. When compression always leaves the same number of
tokens (``policy.kept_after_compress(budget)``: R-KV and SnapKV keep ``budget``), the host knows every slot's
fill from what it already knows: a placed prompt holds its kept tokens, each decode step appends one, a
compression leaves ``kept_after_compress``. So the engine's window of ``sync_every`` steps runs straight through
the compressions that fall inside it, each launched between two steps for the slots due there, instead of ending
the window (a host sync) at the next slot's compression. The order of work on the device is unchanged (a slot
is compressed right before the step that would overflow it), so the tokens are the same. LagKV's keep count
varies, but with its compressed region's size only, never with the data (``policy.host_next``): the schedule
keeps that size per slot too, hands it to the event (``cache.event_counts``, slots of equal size adjacent) and
follows the fill as well. Hard-KV keeps a number of tokens that depends on the data (top-p), but it compresses
every ``interval`` steps and its capacity never binds first, so its schedule is known too; its per-slot size says
whether the slot's temperatures are calibrated yet (the event calibrates the new ones, listed first).

    schedule = HostSchedule.for_cache(cache, max_batch)   # None where it does not apply
    schedule.place(slot, kept, length); schedule.move(src, dst)
    due = schedule.due(active)                             # before a step: compress these, then
    due, counts = schedule.order(due)                      # (LagKV, Hard-KV: the slots by size, and the sizes)
    schedule.compressed(due); schedule.step(active)
"""
from __future__ import annotations

import time

import torch


class HostSchedule:
    """Steps until each slot's next compression, kept on the host (see the module docstring)."""

    def __init__(self, capacity: int, kept_after: int | None, slots: int, policy=None):
        self.capacity, self.kept_after = capacity, kept_after
        self.room = [capacity] * slots
        self.policy = policy  # a policy that follows a per-slot size (LagKV, Hard-KV), else None
        self.sizes = [0] * slots

    @classmethod
    def for_cache(cls, cache, slots: int) -> "HostSchedule | None":
        policy = cache.policy
        if not policy.periodic:
            return None
        if hasattr(policy, "host_next"):  # LagKV, Hard-KV: per-slot sizes (policy.host_place / host_next)
            return cls(cache.capacity, None, slots, policy)
        if hasattr(policy, "kept_after_compress") and not hasattr(policy, "steps_until_due"):
            return cls(cache.capacity, policy.kept_after_compress(cache.budget), slots)
        return None

    def place(self, slot: int, kept: int, length: int | None = None) -> None:
        if self.policy is not None:
            self.room[slot], self.sizes[slot] = self.policy.host_place(kept, length, self.capacity)
        else:
            self.room[slot] = self.capacity - kept

    def move(self, src: int, dst: int) -> None:
        self.room[dst], self.sizes[dst] = self.room[src], self.sizes[src]

    def due(self, active: list[int]) -> list[int]:
        """The slots whose cache is full: they must be compressed before the next step."""
        return [s for s in active if self.room[s] <= 0]

    def order(self, due: list[int]) -> tuple[list[int], list[int] | None]:
        """The due slots in the order the event takes them and the per-slot sizes it needs (None: none): slots of
        equal size adjacent, so that the policy selects each size's rows as one range."""
        if self.policy is None:
            return due, None
        due = sorted(due, key=lambda s: (self.sizes[s], s))
        return due, [self.sizes[s] for s in due]

    def compressed(self, slots: list[int]) -> None:
        for s in slots:
            if self.policy is not None:
                self.room[s], self.sizes[s] = self.policy.host_next(self.sizes[s], self.capacity)
            else:
                self.room[s] = self.capacity - self.kept_after

    def step(self, active: list[int]) -> None:
        for s in active:
            self.room[s] -= 1


class EventClock:
    """Times compression events without a host sync: CUDA events on a GPU, read once the window's tokens have been
    (their work precedes the window's last step on the stream); the wall clock on CPU, where work is synchronous."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pending: list[tuple] = []
        self.recorded = 0  # events timed so far (``settle(upto)`` takes those up to a count)

    def time(self, step: int, work) -> None:
        """Run ``work()`` and record its time under ``step`` (decode steps before it)."""
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            work()
            end.record()
            self.pending.append((step, start, end))
        else:
            began = time.perf_counter()
            work()
            self.pending.append((step, time.perf_counter() - began))
        self.recorded += 1

    def settle(self, upto: int) -> list[tuple[int, float]]:
        """(step, seconds) of the events not yet settled, up to the ``upto``-th recorded; call after a host sync
        covering them (a later window's events may still be running)."""
        take = len(self.pending) - (self.recorded - upto)
        done, self.pending = self.pending[:take], self.pending[take:]
        return [(e[0], e[1].elapsed_time(e[2]) / 1e3) if self.cuda else e for e in done]
