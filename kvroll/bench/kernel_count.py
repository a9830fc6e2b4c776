"""Kernels per decode step: one eager decode step (``DecodeRunner._step``, no graph) under ``torch.profiler``, its CUDA
kernels counted in total and per decoder layer (issue 16 §4: "kernels per decode step per layer, aim for <= 10").

    counts = step_kernel_counts(engine, SamplingParams(temperature=1.0), batch=64)
    counts["kernels_per_step"], counts["kernels_per_layer"]   # e.g. 905 and 31; None on a CPU engine

A graph replays the same kernels as the eager step it captured, so the eager count is the replay's. Each decoder
layer runs inside a ``record_function`` range (forward hooks, removed afterwards); a kernel belongs to the layer
whose range holds the host op that launched it (the profiler links each kernel to the innermost op or range open at
its launch). Kernels outside every layer (embedding, final norm, LM head, sampling) are ``kernels_outside_layers``.
The step writes into the cache like the graph capture's warm-up steps do: count before placing sequences, or on a
cache whose contents no longer matter. Memcpy / memset nodes are not kernels and are not counted.

Each kernel's device time is summed too: per step (``kernel_us_per_step``), per layer and outside the layers, and by
kernel name (``top_kernels``: the names taking the most time, with their counts), so a step over its floor shows
where its time goes. These are the eager step's kernels, each as long as in the graph; the step's wall time minus
their sum is time the device was idle (launch gaps, host waits) in the eager step, not in the graph.
"""
from __future__ import annotations

import torch

LAYER_RANGE = "kvroll::decoder_layer."  # + the layer index
TOP_KERNELS = 12  # kernel names listed in ``top_kernels``


def step_kernel_counts(engine, sampling, batch: int | None = None, live: int | None = None) -> dict | None:
    """Count the CUDA kernels of one eager decode step of ``engine`` at ``batch`` (default ``max_batch``).

    ``live``: every (slot, head) of the cache holds that many live tokens first (at most its capacity; positions
    0 .. live - 1, the contents as they are), so that the kernels' device times are a step's at that context; the
    cache's counts, positions and write indices are reset to empty afterwards (the sequences placed later set
    their own). Without it the step attends over whatever the cache holds (an empty cache: ~nothing).

    Returns None when the engine is not on CUDA (a CPU step launches no kernels). Otherwise
    ``{"kernels_per_step": int, "kernels_per_layer": int (the most of any layer), "kernels_by_layer": [int, ...],
    "kernels_outside_layers": int}`` and the device times (µs) of ``_Tally.result``. One untimed step runs first
    (Triton compiles, cuBLAS initialises).
    """
    if engine.device.type != "cuda":
        return None
    runner = engine._decode_runner(sampling)
    batch = engine.max_batch if batch is None else batch
    from torch.profiler import ProfilerActivity, profile

    cache = engine.cache
    with torch.no_grad():
        if live is not None:
            _fill(cache, min(live, cache.capacity))
        runner._step(batch)
        torch.cuda.synchronize()
        if live is not None:
            _fill(cache, min(live, cache.capacity))  # the untimed step appended (or evicted) a token
        with _layer_ranges(decoder_layers(engine.model)):
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                runner._step(batch)
                torch.cuda.synchronize()
        if live is not None:
            _fill(cache, 0)
    return count_kernels(prof.events(), len(decoder_layers(engine.model)))


def _fill(cache, live: int) -> None:
    """Every (slot, head) holds ``live`` tokens at positions 0 .. live - 1 and decodes position ``live`` next."""
    slots = torch.arange(cache.capacity, device=cache.pos.device)
    cache.pos.copy_(torch.where(slots < live, slots, -1).to(cache.pos.dtype))
    cache.count.fill_(live)
    cache.write_idx.fill_(min(live, cache.capacity - 1))
    cache.cur_pos.fill_(live)


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers of an HF causal LM of the supported families (``model.model.layers``)."""
    return model.get_decoder().layers


class _layer_ranges:
    """Within the block, each layer's forward runs inside the profiler range ``LAYER_RANGE + index``."""

    def __init__(self, layers):
        self.layers, self.handles, self.open = layers, [], {}

    def __enter__(self):
        for index, layer in enumerate(self.layers):
            self.handles.append(layer.register_forward_pre_hook(self._enter(index)))
            self.handles.append(layer.register_forward_hook(self._exit(index)))
        return self

    def _enter(self, index):
        def hook(module, args):
            self.open[index] = torch.autograd.profiler.record_function(f"{LAYER_RANGE}{index}")
            self.open[index].__enter__()
        return hook

    def _exit(self, index):
        def hook(module, args, output):
            self.open.pop(index).__exit__(None, None, None)
        return hook

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        for rng in self.open.values():  # a forward that raised inside a layer
            rng.__exit__(None, None, None)
        self.open.clear()


def _is_kernel(event) -> bool:
    if event.device_type != torch.autograd.DeviceType.CUDA:
        return False
    activity = getattr(event, "activity_type", None)  # torch >= 2.12
    if activity:  # "kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation", ...
        return activity == "kernel"
    return not event.name.startswith(("Memcpy", "Memset", LAYER_RANGE))


def count_kernels(events, num_layers: int) -> dict:
    """Kernels of a profiled step (``prof.events()``): total, per decoder layer and outside the layers.

    Every kernel is its own device event. Its layer is the ``LAYER_RANGE`` range whose host time interval holds the
    kernel's launch: the runtime call that launched it (``cudaLaunchKernel``, ``cuLaunchKernelEx`` for Triton and
    cuBLAS's nvjet kernels, ...) carries the kernel's correlation id as its own ``id``. Where no launch call was
    recorded, the op the kernel is linked to (``linked_correlation_id``, torch >= 2.12) stands in for it; a kernel
    with neither counts outside the layers. (Until session 12 the kernels were read from the ops they are attached
    to on torch 2.11, which missed every Triton kernel: those are launched under no aten op.)
    """
    events = list(events)
    ranges, launch_start, op_start = {}, {}, {}
    for event in events:
        if event.device_type != torch.autograd.DeviceType.CPU:
            continue
        if event.name.startswith(LAYER_RANGE):
            ranges[int(event.name[len(LAYER_RANGE):])] = (event.time_range.start, event.time_range.end)
        if "Launch" in event.name:  # runtime / driver API launch calls; aten ops may share their id numbers
            launch_start[event.id] = event.time_range.start
        elif not getattr(event, "linked_correlation_id", 0):
            op_start.setdefault(event.id, event.time_range.start)
    tally = _Tally(num_layers)
    for event in events:
        if not _is_kernel(event):
            continue
        start = launch_start.get(event.id)
        if start is None:
            start = op_start.get(getattr(event, "linked_correlation_id", None) or None)
        layer = next((i for i, (lo, hi) in ranges.items() if start is not None and lo <= start <= hi), None)
        tally.add(event.name, event.time_range.end - event.time_range.start, layer)
    return tally.result()


class _Tally:
    """Kernels counted and their device µs summed: per layer (``layer`` None: outside the layers) and by name."""

    def __init__(self, num_layers: int):
        self.count, self.us = [0] * num_layers, [0.0] * num_layers
        self.total, self.total_us, self.names = 0, 0.0, {}

    def add(self, name: str, us: float, layer: int | None) -> None:
        self.total, self.total_us = self.total + 1, self.total_us + us
        count, time = self.names.get(name, (0, 0.0))
        self.names[name] = (count + 1, time + us)
        if layer is not None:
            self.count[layer] += 1
            self.us[layer] += us

    def result(self) -> dict:
        top = sorted(self.names.items(), key=lambda item: -item[1][1])[:TOP_KERNELS]
        return {"kernels_per_step": self.total, "kernels_per_layer": max(self.count, default=0),
                "kernels_by_layer": self.count, "kernels_outside_layers": self.total - sum(self.count),
                "kernel_us_per_step": self.total_us, "kernel_us_by_layer": self.us,
                "kernel_us_outside_layers": self.total_us - sum(self.us),
                "top_kernels": [[name[:80], count, us] for name, (count, us) in top]}
