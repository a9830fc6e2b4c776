"""The decode step (model forward + fused kernel + sampling with logprobs) and its CUDA graphs.

The step runs on the first ``batch`` slots of the static cache, reading and writing static buffers only:
``tokens`` (the input tokens, overwritten by the sampled ones), ``logprobs``, ``finite`` (the step's logits were
finite) and ``seen`` (repetition penalty). On CUDA it is captured once per batch size of ``batch_sizes`` (as vLLM
pads to a few captured sizes); when sequences finish, the engine compacts the live slots to the front and
replays the smallest graph that holds them. In-place weight updates (``param.copy_``) keep the graphs valid.

    runner = DecodeRunner(engine, sampling, generator, use_graphs=True)
    runner.step(runner.bucket(live))   # one decode step; read runner.tokens / logprobs / finite
"""
from __future__ import annotations

import torch

from kvroll.hf_compat import CACHE_KW
from kvroll.kernels.sample import fused_sample, head_config, head_sample, new_rng_state, plain
from kvroll.rollout import attention
from kvroll.rollout.sampling import SamplingParams, sample
from kvroll.rollout.schedule import HostSchedule


def batch_sizes(max_batch: int) -> list[int]:
    """Captured batch sizes: powers of two below ``max_batch`` (from 1), and ``max_batch`` itself."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch]


def graph_key(sampling: SamplingParams) -> tuple:
    """The sampling fields a captured step bakes in (seed, lengths and stop ids stay free)."""
    return (sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p, sampling.repetition_penalty,
            sampling.logprobs_mode)


def _decode_inputs(tokens: torch.Tensor, cache) -> dict:
    return dict(input_ids=tokens[:, None], position_ids=cache.cur_pos[:, None], **{CACHE_KW: cache},
                kvroll_cache=cache, attention_mask=attention.dummy_mask(cache.slots, tokens.device), use_cache=True)


def forward_decode(model, tokens: torch.Tensor, cache, fp32: bool = True) -> torch.Tensor:
    """One decode step of ``model`` for the cache's slots: tokens [slots] -> logits [slots, vocab], fp32 (or the
    model's dtype when not ``fp32``). No host sync."""
    out = model(**_decode_inputs(tokens, cache), logits_to_keep=1)
    cache.cur_pos += 1
    return out.logits[:, -1].float() if fp32 else out.logits[:, -1]


def forward_hidden(model, tokens: torch.Tensor, cache) -> torch.Tensor:
    """``forward_decode`` without the output head: tokens [slots] -> the final hidden states [slots, hidden] in the
    model's dtype (its base model's output, after the final norm). For a model with ``plain_head``."""
    out = model.model(**_decode_inputs(tokens, cache))
    cache.cur_pos += 1
    return out.last_hidden_state[:, -1]


def plain_head(model) -> torch.Tensor | None:
    """The output head's weight [vocab, hidden] where the model's logits are exactly its base model's output times
    that weight (``forward_hidden`` then ``head_sample``): transformers' Llama, Qwen2, Qwen3 and Mistral causal LMs,
    whose head is a bias-free ``Linear`` with no scale or soft-capping, with no hook on the model or its head (a
    hook, e.g. one casting the head to fp32, would be skipped), a plain weight tensor (not a quantized subclass) in
    the model's dtype, and on a GPU a half-precision one (an fp32 head stays with cuBLAS). None for any other."""
    from transformers import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

    head, base = getattr(model, "lm_head", None), getattr(model, "model", None)
    if not isinstance(model, (LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM)) \
            or base is None or type(head) is not torch.nn.Linear or head.bias is not None:
        return None
    if any(m._forward_hooks or m._forward_pre_hooks for m in (model, head)):
        return None
    weight = head.weight
    if type(weight.data) is not torch.Tensor or weight.dtype != model.dtype or weight.dim() != 2:
        return None
    if weight.is_cuda and weight.dtype == torch.float32:
        return None
    return weight


class DecodeRunner:
    """Static decode buffers + one decode step per batch size, eager or replayed from a CUDA graph.

    It holds the engine's model and cache, never the engine itself: the engine holds the runner, and a cycle
    would keep the cache's device memory alive after ``del engine`` until the next ``gc.collect()``.
    """

    @torch.no_grad()
    def __init__(self, engine, sampling: SamplingParams, generator: torch.Generator, use_graphs: bool):
        slots, dev = engine.max_batch, engine.device
        self.model, self.sampling, self.generator = engine.model, sampling, generator
        self.fused_sampling = engine.fused_sampling and plain(sampling)  # kvroll/kernels/sample.py
        # the fused sampler's batches of up to HEAD_MAX_ROWS rows take the output head in its kernel (head_sample)
        self.head = plain_head(engine.model) if self.fused_sampling else None
        # the fused sampler's Philox state [seed, step], drawn anew from the generator by each generate (reseed)
        self.rng = new_rng_state(dev, generator) if self.fused_sampling and not sampling.greedy else None
        self.cache = engine.cache
        self.key = (graph_key(sampling), id(engine.cache))
        self.sizes = batch_sizes(slots)
        self.tokens = torch.zeros(slots, dtype=torch.int64, device=dev)  # [slots] in: this step, out: next
        self.logprobs = torch.zeros(slots, dtype=torch.float32, device=dev)  # [slots]
        self.finite = torch.ones(slots, dtype=torch.bool, device=dev)  # [slots]
        self.seen = torch.zeros(slots, engine.vocab_size, dtype=torch.bool, device=dev) \
            if sampling.repetition_penalty != 1 else None  # [slots, vocab]
        self.views = {b: engine.cache.slot_view(b) for b in self.sizes}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.capture_seconds = 0.0
        # compression events of the host-scheduled policies, replayed from graphs too (None: run eagerly)
        scheduled = HostSchedule.for_cache(engine.cache, slots) is not None
        self.events = EventGraphs(engine.cache) if use_graphs and scheduled else None
        if use_graphs:
            self.capture()

    def bucket(self, live: int) -> int:
        """The smallest captured batch size holding ``live`` slots."""
        return next(b for b in self.sizes if b >= live)

    @torch.no_grad()
    def step(self, batch: int) -> None:
        """One decode step over the first ``batch`` rows of the static buffers: the captured graph when there is
        one for that batch size, else the same step run eagerly."""
        graph = self.graphs.get(batch)
        if graph is not None:
            graph.replay()
        else:
            self._step(batch)

    def move_slots(self, src: int, dst: int) -> None:
        """Move the per-slot decode buffers of slot ``src`` to ``dst`` (live-slot compaction)."""
        for buf in (self.tokens, self.logprobs, self.finite, self.seen):
            if buf is not None:
                buf[dst] = buf[src]

    def _step(self, batch: int) -> None:
        cache = self.views[batch]
        seen = self.seen[:batch] if self.seen is not None else None  # None whenever the fused sampler serves
        head = self.head is not None and head_config(batch, self.head.dtype, self.head.device) is not None
        if self.fused_sampling and head:  # the output head in the sampler's kernel: no logits in memory
            hidden = forward_hidden(self.model, self.tokens[:batch], cache)  # [batch, hidden]
            tokens, logprobs, finite = head_sample(hidden, self.head, self.sampling.temperature, rng=self.rng)
        elif self.fused_sampling:  # the logits stay in the model's dtype (kvroll/kernels/sample.py)
            logits = forward_decode(self.model, self.tokens[:batch], cache, fp32=False)  # [batch, vocab]
            tokens, logprobs, finite = self._fused_sample(logits)
        else:
            logits = forward_decode(self.model, self.tokens[:batch], cache)  # [batch, vocab] fp32
            tokens, logprobs = sample(logits, self.sampling, self.generator, seen)
            finite = torch.isfinite(logits).all(dim=-1)
        self.finite[:batch].copy_(finite)
        self.tokens[:batch].copy_(tokens)
        self.logprobs[:batch].copy_(logprobs)
        if seen is not None:
            seen.scatter_(1, tokens[:, None], True)

    def _fused_sample(self, logits: torch.Tensor):
        """``sample`` through the fused kernels, the inverse CDF at a uniform per row drawn inside them (Philox,
        from ``self.rng``): the torch sampler's distribution, not its draws (``fused_sampling=False`` takes those)."""
        return fused_sample(logits, None, self.sampling.temperature, rng=self.rng)

    def capture(self) -> None:
        """Warm up and capture every batch size, largest first, in one memory pool.

        The warm-up steps write junk into the cache; the engine captures before it places any sequence.
        """
        import time

        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for batch in sorted(self.sizes, reverse=True):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # compiles the Triton kernels, initialises cuBLAS handles
                    self._step(batch)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            if hasattr(graph, "register_generator_state") and self.generator.device.type == "cuda":
                graph.register_generator_state(self.generator)
            with torch.cuda.graph(graph, pool=pool):
                self._step(batch)
            self.graphs[batch] = graph
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start


class EventGraphs:
    """Periodic compression events (``cache.compress_index``) replayed from CUDA graphs, one per number of slots
    (and, for LagKV and Hard-KV, per tuple of the slots' sizes: LagKV's region sizes, Hard-KV's calibration
    states, which shape their work; and, for an event on ``span_min`` or more slots of one contiguous range, per
    first slot: see ``span_min``).

    An event launches tens of kernels per layer (R-KV: window logits, softmax, pooling, the redundancy kernel,
    top-k, sort, compaction): on an H200 30-40 ms of host launches per event whatever its GPU work, so a slot
    compressing every few steps turned the decode launch-bound. Replayed, an event costs its GPU time. For the
    host-scheduled policies only (``schedule.py``: their events read nothing back). A slot count seen for the
    first time runs eagerly (compiling its kernels); the second time its graph is captured over a static slot
    buffer, into which the slots are copied (stream-ordered) before every replay. Nothing a captured event
    allocates outlives it, so one memory pool serves every count.
    """

    # LagKV's and Hard-KV's keys are (count, sizes) pairs, far more than the counts an engine sees; past this many
    # graphs a new key runs eagerly (a graph is a few hundred kernel nodes per layer of host memory, and a capture
    # tens of milliseconds), so a long training run cannot grow them without bound
    max_graphs = 256
    max_seen = 4096  # keys seen once and not yet captured, remembered (host memory only)
    # an event on at least this many slots that are one contiguous range is captured over that span (its own key),
    # so that the policies read the rows as views (``kvroll.policies.base.slot_rows``) and not as gathered copies:
    # at 256 slots the copies of K were 12 ms of R-KV's 141 ms event and 13 of SnapKV's 60 (H100, session 17); an
    # in-phase batch (every row started together) compresses all its slots at once. Smaller events gather (their
    # copies are small) and share one graph per count whatever their slots
    span_min = 32

    def __init__(self, cache):
        self.cache = cache
        self.slots = torch.zeros(cache.slots, dtype=torch.int64, device=cache.k.device)
        self.graphs: dict[int | tuple, torch.cuda.CUDAGraph] = {}
        self.eager_counts: set[int | tuple] = set()
        self.pool = None
        self.capture_seconds = 0.0

    @torch.no_grad()
    def run(self, due: list[int], sizes: list[int] | None = None) -> None:
        """Compress ``due``; ``sizes`` (LagKV's / Hard-KV's per-slot sizes, ``cache.event_counts``) shape the event's
        work, so a graph serves one (count, sizes) pair.

        An event on more than ``span_min`` slots runs as two: its first multiple of ``span_min`` slots, then the
        rest (each slot's compression depends on that slot alone). Rows that started together compress together
        while they finish one by one, so the count of an in-phase event drifts down and would be a new key at
        nearly every event (a ragged GRPO batch of 256 rows: 58 keys in 63 Hard-KV events,
        ``benchmarks/event_keys.py``); split so, its keys recur."""
        for part, part_sizes in self.parts(due, sizes):
            self._run_one(part, part_sizes)

    @classmethod
    def parts(cls, due: list[int], sizes: list[int] | None) -> list[tuple[list[int], list[int] | None]]:
        """The events ``run`` runs for ``due``: (slots, sizes) of each (``run``'s docstring)."""
        quantum = cls.span_min
        if len(due) <= quantum or len(due) % quantum == 0:
            return [(due, sizes)]
        cut = len(due) // quantum * quantum
        head, tail = (None, None) if sizes is None else (sizes[:cut], sizes[cut:])
        return [(due[:cut], head), (due[cut:], tail)]

    @classmethod
    def key(cls, due: list[int], sizes: list[int] | None) -> int | tuple:
        """The graph key of one part: its count (and sizes), and its first slot when it is captured over a span."""
        count = len(due)
        key = (count, tuple(sizes)) if sizes is not None else count
        if count >= cls.span_min and due == list(range(due[0], due[0] + count)):
            key = ("span", due[0], key)
        return key

    def _run_one(self, due: list[int], sizes: list[int] | None) -> None:
        saved = getattr(self.cache, "event_counts", None)
        if sizes is not None:  # what the policies read: this part's sizes
            self.cache.event_counts = sizes
        try:
            self._run_key(due, sizes)
        finally:
            if sizes is not None:
                self.cache.event_counts = saved

    def _run_key(self, due: list[int], sizes: list[int] | None) -> None:
        count, key = len(due), self.key(due, sizes)
        first = key[1] if isinstance(key, tuple) and key[0] == "span" else None
        if key not in self.graphs and (key not in self.eager_counts or len(self.graphs) >= self.max_graphs):
            if len(self.graphs) < self.max_graphs:  # past the cap a key is never captured: nothing to remember
                if len(self.eager_counts) >= self.max_seen:  # keys seen once, long ago, are forgotten
                    self.eager_counts.clear()
                self.eager_counts.add(key)
            self.cache.compress_slots(due)
            return
        if first is None:
            self.slots[:count].copy_(torch.tensor(due, dtype=torch.int64).pin_memory(), non_blocking=True)
        graph = self.graphs.get(key)
        if graph is None:
            graph = self.graphs[key] = self._capture(count, first)
        graph.replay()

    def _capture(self, count: int, first: int | None = None) -> "torch.cuda.CUDAGraph":
        """Capture one event over ``slots[:count]`` (or, ``first`` given, over the span of ``count`` slots from
        ``first``) on a side stream (capture runs nothing)."""
        import time

        start = time.perf_counter()
        self.pool = self.pool or torch.cuda.graph_pool_handle()
        graph, side, current = torch.cuda.CUDAGraph(), torch.cuda.Stream(), torch.cuda.current_stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            graph.capture_begin(pool=self.pool)
            try:
                if first is None:
                    self.cache.compress_index(self.slots[:count])
                else:
                    span = slice(first, first + count)
                    self.cache.compress_index(self.cache.slot_ids[span], span)
            finally:
                graph.capture_end()
        current.wait_stream(side)
        self.capture_seconds += time.perf_counter() - start
        return graph
