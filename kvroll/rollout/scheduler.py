"""The host side of one ``RolloutEngine.generate`` call: which prompt takes which slot, when the waiting prompts are
prefilled (together, ``PREFILL_TOKENS`` padded tokens at most a forward), the decode window of ``sync_every``
steps launched before the last one is read, the periodic policies' compressions between steps, and the finished
rows read back into ``Completion``s in input order.

    run = GenerateRun(engine, prompts, sampling, n, engine.generator, stop_ids, progress=None)
    completions = run.run()    # len(prompts) * n, in order

It drives the engine through its internals (``_prefill_many``, ``_decode_runner``, ``cache``); the engine owns the
model, the cache and the captured graphs.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvroll.kernels.sample import reseed
from kvroll.rollout.cache import PromptKV
from kvroll.rollout.requests import Completion
from kvroll.rollout.sampling import sample
from kvroll.rollout.schedule import EventClock, HostSchedule

if TYPE_CHECKING:
    from kvroll.rollout.engine import RolloutEngine


# padded tokens of one batched prefill (rows x the longest prompt): bounds its activations and the K/V it holds until
# take_prompts copies them (~0.9 GB for Qwen3-1.7B in bf16)
PREFILL_TOKENS = 8192


@dataclass
class _Group:
    """A prefilled prompt waiting for free slots for its remaining samples."""

    prompt_index: int
    prompt: PromptKV
    logits: torch.Tensor  # [vocab] the prompt's last-position logits
    next_sample: int = 0


class GenerateRun:
    """The host-side scheduler of one ``generate`` call (slots, waiting prompts, results).

    Decode runs in windows of up to ``sync_every`` steps with no host synchronisation inside: the step's sampled
    tokens stay on the device and are read once per window, while the next window runs (``run``). A window never
    runs a live sequence past its ``max_new_tokens``; tokens sampled after a stop token are dropped. Periodic
    compression runs inside the window, between two steps, where the host knows the fill of every slot
    (``schedule.py``: R-KV, SnapKV, LagKV, Hard-KV); a periodic policy without a host schedule would end a window at
    the next slot's compression (a device read: the path ``HostSchedule.for_cache`` returning None takes, with no
    window overlap). Between windows: refill free slots, compact live slots to the front (so a smaller captured
    batch replays), run the due periodic work of the read-the-device path.
    """

    def __init__(self, engine: RolloutEngine, prompts, sampling, n, generator, stop, progress):
        self.e, self.prompts, self.sp, self.n = engine, prompts, sampling, n
        self.generator, self.stop, self.progress = generator, stop, progress
        # the stop ids a sampled token can equal, as an array for ``_consume`` (an id past the vocabulary never stops)
        self.stop_ids = np.fromiter((t for t in stop if t < engine.vocab_size), dtype=np.int64)
        self.results: list[Completion | None] = [None] * (len(prompts) * n)
        self.waiting = deque(range(len(prompts)))
        self.groups: deque[_Group] = deque()
        self.owner: list[Completion | None] = [None] * engine.max_batch
        self.runner = engine._decode_runner(sampling)  # captures before any slot is placed (see graphs.py)
        self.tokens, self.seen = self.runner.tokens, self.runner.seen
        if self.runner.rng is not None:  # the fused sampler's noise: a new seed from this call's generator
            reseed(self.runner.rng, generator)
        self.schedule = HostSchedule.for_cache(engine.cache, engine.max_batch)
        self.clock = EventClock(engine.device)

    def run(self) -> list[Completion]:
        """Decode windows until every sequence is done. With ``overlap``, window k + 1 is launched before window k
        is read: the host reads and records window k and compacts while the device runs k + 1, so that between
        windows without refills the device does not wait on the host. A refill does wait: its prefill and first
        token are read on the host, behind the window in flight. The price: a sequence that stops in window k
        runs on through window k + 1 (those tokens are dropped; a host-scheduled policy may compress it there),
        and its slot is refilled one window later. The steps of window k + 1 count window k's as taken, so no
        sequence runs past its ``max_new_tokens``; a slot that reaches them in window k rides along in window
        k + 1 unread. The read-the-device periodic path (no host schedule) reads each window before the next. On a
        CPU, where work is synchronous, the same order runs without the gain."""
        overlap = not (self.e.policy.periodic and self.schedule is None)
        buffers = [_Buffers(self.e.sync_every, self.e.max_batch, self.e.device) for _ in range(1 + overlap)]
        pending, launched = None, 0
        while True:
            self._fill_slots()
            window = self._launch(buffers[launched % len(buffers)], pending)
            launched += window is not None
            if pending is not None:
                self._finish(pending)
            elif window is None:
                break
            pending = window
            if not overlap and pending is not None:
                self._finish(pending)
                pending = None
        assert all(r is not None for r in self.results)
        return self.results  # type: ignore[return-value]

    def _launch(self, buffers: "_Buffers", pending: "_Window | None") -> "_Window | None":
        """Queue the next decode window on the device (no host sync), or return None when no live sequence has a
        step left beyond ``pending``'s (those that do not end their length in ``pending`` do)."""
        active = [s for s, c in enumerate(self.owner) if c is not None]
        ahead = {id(c) for c in pending.comps} if pending is not None else set()
        ahead_steps = pending.steps if pending is not None else 0
        room = [self.sp.max_new_tokens - len(self.owner[s].token_ids) - (ahead_steps if id(self.owner[s]) in ahead
                                                                          else 0) for s in active]
        room = [r for r in room if r > 0]  # the others end by length in ``pending``: they ride along, unread
        if not room:
            return None
        active = self._compact(active)
        batch = self.runner.bucket(len(active))
        steps = min([self.e.sync_every] + room)
        if self.e.policy.periodic and self.schedule is None:
            steps = min(steps, self._periodic_work(active))
        hist = buffers.device
        after_step = getattr(self.progress, "after_step", None)  # a measurement's per-step device sample (bench)
        for i in range(steps):
            if self.schedule is not None:
                self._scheduled_work(active, i)
            self.runner.step(batch)
            hist[i, 0, :batch] = self.runner.tokens[:batch]
            hist[i, 1, :batch] = self.runner.logprobs[:batch]
            hist[i, 2, :batch] = self.runner.finite[:batch]
            if after_step is not None:
                after_step()
        self.e.stats["decode_steps"] += steps
        self.e.stats["decode_windows"] += 1
        window = _Window(active, [self.owner[s] for s in active], steps, buffers.read(steps), self.clock.recorded)
        queued = getattr(self.progress, "kvroll_window_queued", None)  # (kvroll.bench.measure.Timeline's; on a CPU
        if callable(queued):  # the window has run by now)
            queued()
        return window

    def _finish(self, window: "_Window") -> None:
        """Wait for ``window`` (its one host sync), record its tokens and events, free its finished slots."""
        read = window.wait()  # [steps, 3, max_batch]
        if hasattr(self.progress, "synced"):  # (kvroll.bench.measure.Timeline marks the window here)
            self.progress.synced()
        live = [j for j, c in enumerate(window.comps) if c.finish_reason is None]  # (not done in an earlier one)
        cols = [window.slots[j] for j in live]  # the steps wrote each slot's column (slots need not be 0..n-1)
        self._consume(read.transpose(1, 0, 2)[:, :, cols], [window.comps[j] for j in live])
        self._free_finished()
        self._record_events(self.clock.settle(window.events))

    def _free_finished(self) -> None:
        for slot, comp in enumerate(self.owner):
            if comp is not None and comp.finish_reason is not None:
                self.owner[slot] = None

    def _scheduled_work(self, active: list[int], step: int) -> None:
        """Before step ``step`` of a window: compress the slots the host schedule says are full (no device read)."""
        due = self.schedule.due(active)
        if due:
            due, sizes = self.schedule.order(due)
            events, cache = self.runner.events, self.e.cache  # CUDA graphs of the events (they never read back)

            def work():
                cache.event_counts = sizes  # LagKV's / Hard-KV's per-slot sizes, from the host (else None)
                try:
                    events.run(due, sizes) if events is not None else cache.compress_slots(due)
                finally:
                    cache.event_counts = None

            self.clock.time(self.e.stats["decode_steps"] + step, work)
            self.schedule.compressed(due)
        self.schedule.step(active)

    def _periodic_work(self, active: list[int]) -> int:
        """Compress the due live slots; return how many steps every live slot may take before the next."""
        start = time.perf_counter()
        cache = self.e.cache
        due = cache.due_for_compression()
        due[[s for s in range(len(self.owner)) if self.owner[s] is None]] = False
        compressed = bool(due.any())
        if compressed:
            cache.compress_slots(due.nonzero()[:, 0])
        room = cache.steps_until_due()[active]
        steps = max(1, int(room.min()))  # a host sync: the compression's GPU work is done
        if compressed:
            self._record_events([(self.e.stats["decode_steps"], time.perf_counter() - start)])
        return steps

    def _record_events(self, events: list[tuple[int, float]]) -> None:
        for step, seconds in events:
            self.e.stats["policy_seconds"] += seconds
            self.e.stats["policy_events"].append((step, seconds))

    def _compact(self, active: list[int]) -> list[int]:
        """Move live slots at or past the smallest batch that holds them into the free slots below it."""
        batch = self.runner.bucket(len(active))
        movers = [s for s in active if s >= batch]
        if not movers:
            return active
        holes = [s for s in range(batch) if self.owner[s] is None]
        for src, dst in zip(movers, holes):
            self.e.cache.move_slot(src, dst)
            self.runner.move_slots(src, dst)
            if self.schedule is not None:
                self.schedule.move(src, dst)
            self.owner[dst], self.owner[src] = self.owner[src], None
        return [s for s, c in enumerate(self.owner) if c is not None]

    def _fill_slots(self) -> None:
        for slot in range(len(self.owner)):
            while self.owner[slot] is None:  # (a sequence may finish on its first token: the slot takes the next)
                group = self._next_group()
                if group is None:
                    return
                self._start_sample(slot, group)

    def _prefill_ahead(self) -> None:
        """Prefill, in forwards of several rows (``_prefill_many``), the waiting prompts whose samples the free slots
        take now, in their order, while they are short enough to go whole (no prefill compression); a forward's
        padded tokens stay within ``PREFILL_TOKENS``. Called by ``_next_group`` when no prefilled prompt is left, so a
        prompt over the limit goes alone in its turn (the random policy's prefill draws keep their order) and the
        prompts behind it are batched at the next call."""
        free = sum(owner is None for owner in self.owner)
        queued = sum(self.n - group.next_sample for group in self.groups)
        want = -(-(free - queued) // self.n)  # prompts needed to fill the free slots
        limit = self.e.cache.prefill_limit()
        while want >= 2:
            batch, width = [], 0
            while len(batch) < want and self.waiting:
                length = len(self.prompts[self.waiting[0]])
                if length > limit or (len(batch) + 1) * max(width, length) > PREFILL_TOKENS:
                    break
                batch.append(self.waiting.popleft())
                width = max(width, length)
            if len(batch) < 2:  # nothing to batch: the one-by-one path takes it
                self.waiting.extendleft(reversed(batch))
                return
            for index, (prompt, logits) in zip(batch, self.e._prefill_many([self.prompts[i] for i in batch])):
                self._add_group(index, prompt, logits)
            want -= len(batch)

    def _add_group(self, index: int, prompt: PromptKV, logits: torch.Tensor) -> None:
        """Queue prompt ``index``'s prefill for its samples; non-finite logits are refused, naming the prompt."""
        if not torch.isfinite(logits).all():
            raise FloatingPointError(f"non-finite logits at prefill of prompt {index}; refusing to sample.")
        self.groups.append(_Group(index, prompt, logits))

    def _next_group(self) -> _Group | None:
        while self.groups and self.groups[0].next_sample >= self.n:
            self.groups.popleft()
        if not self.groups:
            if not self.waiting:
                return None
            self._prefill_ahead()  # the next prompts together, up to one over the prefill limit (it goes alone)
            if self.groups:
                return self.groups[0]
            index = self.waiting.popleft()
            self._add_group(index, *self.e._prefill(self.prompts[index]))
        return self.groups[0]

    def _start_sample(self, slot: int, group: _Group) -> None:
        sample_index = group.next_sample
        group.next_sample += 1
        ids = self.prompts[group.prompt_index]
        comp = Completion(group.prompt_index, sample_index, list(ids))
        self.results[group.prompt_index * self.n + sample_index] = comp
        self.e.cache.place(slot, group.prompt)
        if self.schedule is not None:
            self.schedule.place(slot, group.prompt.k.shape[2], group.prompt.length)
        seen = None
        if self.seen is not None:
            self.seen[slot] = False
            self.seen[slot, torch.tensor(ids, device=self.seen.device)] = True
            seen = self.seen[slot : slot + 1]
        token, logprob = sample(group.logits[None], self.sp, self.generator, seen)
        self.owner[slot] = comp
        if self._append(slot, comp, int(token[0]), float(logprob[0])):
            self.tokens[slot] = token[0]  # later tokens are written by the decode step itself
            if self.seen is not None:
                self.seen[slot, token[0]] = True

    def _append(self, slot: int, comp: Completion, token: int, logprob: float) -> bool:
        """Record one token; free the slot and return False if the sequence just finished."""
        comp.token_ids.append(token)
        comp.logprobs.append(logprob)
        self.e.stats["generated_tokens"] += 1
        if self.progress is not None:
            self.progress.update(1)
        if token in self.stop:
            comp.finish_reason = "stop"
        elif len(comp.token_ids) >= self.sp.max_new_tokens:
            comp.finish_reason = "length"
        if comp.finish_reason is not None:
            self.owner[slot] = None
            return False
        return True

    def _consume(self, hist: np.ndarray, comps: list[Completion]) -> None:
        """hist [3, steps, len(comps)] float64 (tokens, logprobs, finite): one window's columns of the live
        sequences ``comps``, read from the device in one transfer.

        Array work per window, Python work per sequence (not per token: at batch 256 a per-token loop took ~0.3 ms
        of a 13 ms step, with the device idle). Each sequence takes its tokens up to the first stop token or its
        ``max_new_tokens``, and is marked finished there (the caller frees its slot); a non-finite step among those
        raises, the earliest step first, then the first sequence (before any of the window's tokens is
        recorded)."""
        steps = hist.shape[1]
        if not comps or not steps:
            return
        tokens = hist[0].astype(np.int64)  # [steps, sequences]
        left = np.asarray([self.sp.max_new_tokens - len(c.token_ids) for c in comps])
        assert (left >= steps).all(), (left, steps)  # a window never runs past a live sequence's max_new_tokens
        stops = np.isin(tokens, self.stop_ids)  # all False for no stop ids
        first_stop = np.where(stops.any(axis=0), stops.argmax(axis=0), steps)
        end = np.minimum(first_stop + 1, steps)  # tokens each sequence takes from this window (left >= steps)
        bad = (hist[2] == 0) & (np.arange(steps)[:, None] < end[None, :])
        if bad.any():
            step, j = np.argwhere(bad)[0]  # row-major: the earliest step, then the first sequence
            comp = comps[j]
            raise FloatingPointError(
                f"non-finite logits at decode step {len(comp.token_ids) + int(step)} of prompt {comp.prompt_index} "
                f"sample {comp.sample_index}; refusing to sample from NaN/inf.")
        token_rows, logprob_rows = tokens.T.tolist(), hist[1].T.tolist()  # [sequences][steps] Python lists
        for comp, n, stop, room, toks, lps in zip(comps, end.tolist(), first_stop.tolist(), left.tolist(),
                                                  token_rows, logprob_rows):
            comp.token_ids.extend(toks[:n])
            comp.logprobs.extend(lps[:n])
            if stop < n:
                comp.finish_reason = "stop"
            elif n >= room:
                comp.finish_reason = "length"
        taken = int(end.sum())
        self.e.stats["generated_tokens"] += taken
        if self.progress is not None:
            self.progress.update(taken)


class _Buffers:
    """One decode window's step history on the device [window, 3, max_batch] float64 (token, logprob, finite of
    each step, written by the steps; a window's rows are one contiguous block) and, on a GPU, a pinned host copy
    that ``read`` fills asynchronously."""

    def __init__(self, window: int, max_batch: int, device: torch.device):
        self.device = torch.empty(window, 3, max_batch, dtype=torch.float64, device=device)
        self.host = torch.empty(self.device.shape, dtype=torch.float64, pin_memory=True) \
            if device.type == "cuda" else None

    def read(self, steps: int):
        """Queue the copy of the first ``steps`` rows; returns what ``_Window.wait`` needs."""
        if self.host is None:  # CPU: the work is done (the buffer is written again only after this window is read)
            return self.device[:steps].numpy(), None
        self.host[:steps].copy_(self.device[:steps], non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return self.host[:steps].numpy(), done


@dataclass
class _Window:
    """A queued decode window: its live slots at launch (the history's columns), their sequences, its steps, its
    host read (the array and the CUDA event after which it holds the window), and the number of compression events
    recorded up to its end."""
    slots: list[int]
    comps: list[Completion]
    steps: int
    read: tuple
    events: int

    def wait(self) -> np.ndarray:
        array, done = self.read
        if done is not None:
            done.synchronize()
        return array
