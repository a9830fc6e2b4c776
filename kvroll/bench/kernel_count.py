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


def step_kernel_counts(engine, sampling, batch: int | None = None) -> dict | None:
    """Count the CUDA kernels of one eager decode step of ``engine`` at ``batch`` (default ``max_batch``).

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

    with torch.no_grad():
        runner._step(batch)
        torch.cuda.synchronize()
        with _layer_ranges(decoder_layers(engine.model)):
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                runner._step(batch)
                torch.cuda.synchronize()
    return count_kernels(prof.events(), len(decoder_layers(engine.model)))


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
    if event.activity_type:  # "kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation", ...
        return event.activity_type == "kernel"
    return not event.name.startswith(("Memcpy", "Memset", LAYER_RANGE))


def count_kernels(events, num_layers: int) -> dict:
    """Kernels of a profiled step (``prof.events()``): total, per decoder layer and outside the layers.

    A kernel's ``linked_correlation_id`` names the host op (or range) that launched it; the layer is the
    ``LAYER_RANGE`` range whose host time interval holds that op's start. Older torch (2.11) keeps no
    ``linked_correlation_id`` on the events but attaches each kernel to its launching op's ``kernels``: counted
    from there (``_count_attached``), same attribution.
    """
    events = list(events)
    if events and not hasattr(events[0], "linked_correlation_id"):
        return _count_attached(events, num_layers)
    ranges, launch_start = {}, {}
    for event in events:
        if event.device_type != torch.autograd.DeviceType.CPU:
            continue
        if event.name.startswith(LAYER_RANGE):
            ranges[int(event.name[len(LAYER_RANGE):])] = (event.time_range.start, event.time_range.end)
        if event.linked_correlation_id == 0:
            launch_start[event.id] = event.time_range.start
    tally = _Tally(num_layers)
    for event in events:
        if not _is_kernel(event):
            continue
        start = launch_start.get(event.linked_correlation_id)
        layer = next((i for i, (lo, hi) in ranges.items() if start is not None and lo <= start <= hi), None)
        tally.add(event.name, event.time_range.end - event.time_range.start, layer)
    return tally.result()


def _count_attached(events, num_layers: int) -> dict:
    """``count_kernels`` from the kernels attached to their launching host ops (``event.kernels``: name, device,
    duration), for a torch whose events carry no ``linked_correlation_id``; copies, sets and ranges skipped by name."""
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    ranges = {int(e.name[len(LAYER_RANGE):]): (e.time_range.start, e.time_range.end)
              for e in cpu if e.name.startswith(LAYER_RANGE)}
    tally = _Tally(num_layers)
    for event in cpu:
        start = event.time_range.start
        layer = next((i for i, (lo, hi) in ranges.items() if lo <= start <= hi), None)
        for kernel in getattr(event, "kernels", ()):
            if not kernel.name.startswith(("Memcpy", "Memset", LAYER_RANGE)):
                tally.add(kernel.name, kernel.duration, layer)
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
