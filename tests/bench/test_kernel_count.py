"""Kernels per decode step: None on a CPU engine; the layer ranges the hooks open (seen by a CPU profile) and are
removed; the attribution of kernels to layers on synthetic profiler events; on a GPU (``gpu``) the real count."""
from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType

from kvroll.bench import kernel_count
from kvroll.bench.kernel_count import LAYER_RANGE, count_kernels, step_kernel_counts
from kvroll.config import CompressionConfig
from kvroll.rollout.engine import RolloutEngine
from kvroll.rollout.sampling import SamplingParams
from tests.conftest import tiny_model


def test_cpu_engine_counts_nothing_and_installs_no_hook():
    engine = RolloutEngine(tiny_model("llama"), compression=CompressionConfig("longflow", budget=16), max_batch=2)
    assert step_kernel_counts(engine, SamplingParams()) is None
    assert all(not layer._forward_hooks and not layer._forward_pre_hooks for layer in engine.model.model.layers)


def test_layer_ranges_wrap_each_layer_and_are_removed():
    from torch.profiler import ProfilerActivity, profile

    model = tiny_model("qwen3", layers=3)
    layers = kernel_count.decoder_layers(model)
    assert len(layers) == 3
    with torch.no_grad(), kernel_count._layer_ranges(layers):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model(torch.tensor([[3, 17, 42]]))
    ranges = {e.name: e.time_range for e in prof.events() if e.name.startswith(LAYER_RANGE)}
    assert sorted(ranges) == [f"{LAYER_RANGE}{i}" for i in range(3)]
    spans = [ranges[f"{LAYER_RANGE}{i}"] for i in range(3)]
    assert all(a.end <= b.start for a, b in zip(spans, spans[1:]))  # in order, disjoint
    mms = [e for e in prof.events() if e.name in ("aten::mm", "aten::addmm", "aten::linear")]
    inside = [any(s.start <= e.time_range.start <= s.end for s in spans) for e in mms]
    assert any(inside) and not all(inside)  # the layers' projections inside, the LM head outside
    assert all(not layer._forward_hooks and not layer._forward_pre_hooks for layer in layers)


def _event(name, device, start=0.0, end=0.0, id=0, linked=0, activity=None):
    return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end), id=id,
                           linked_correlation_id=linked, activity_type=activity)


def test_count_attributes_kernels_to_the_range_of_their_launching_op():
    cpu, gpu = DeviceType.CPU, DeviceType.CUDA
    events = [
        _event("aten::embedding", cpu, 0, 5, id=1),
        _event(f"{LAYER_RANGE}0", cpu, 10, 50, id=2, activity="user_annotation"),
        _event("aten::mm", cpu, 12, 20, id=3),
        _event("aten::add", cpu, 21, 22, id=4),
        _event(f"{LAYER_RANGE}1", cpu, 60, 90, id=5, activity="user_annotation"),
        _event("aten::mm", cpu, 61, 70, id=6),
        _event("aten::argmax", cpu, 100, 110, id=7),
        _event("cudaLaunchKernel", cpu, 13, 14, id=30, linked=3, activity="cuda_runtime"),  # not a frontend op
        _event("gather_kernel", gpu, 200, 201, id=11, linked=1, activity="kernel"),
        _event("gemm", gpu, 202, 205, id=12, linked=3, activity="kernel"),
        _event("splitk_reduce", gpu, 205, 205.5, id=13, linked=3, activity="kernel"),
        _event("add_kernel", gpu, 205, 206, id=14, linked=4, activity="kernel"),
        _event("_rms_norm_kernel", gpu, 207, 208, id=15, linked=2, activity="kernel"),  # Triton: linked to the range
        _event(f"{LAYER_RANGE}0", gpu, 200, 209, id=16, linked=2, activity="gpu_user_annotation"),
        _event("Memcpy DtoD", gpu, 209, 210, id=17, linked=4, activity="gpu_memcpy"),
        _event("gemm", gpu, 211, 215, id=18, linked=6, activity="kernel"),
        _event("argmax_kernel", gpu, 215, 216, id=19, linked=7, activity="kernel"),
        _event("orphan", gpu, 216, 218, id=20, linked=99, activity="kernel"),  # launch not recorded: outside
    ]
    counts = count_kernels(events, num_layers=2)
    assert counts == {"kernels_per_step": 8, "kernels_per_layer": 4, "kernels_by_layer": [4, 1],
                      "kernels_outside_layers": 3,
                      # device µs: layer 0 = gemm 3 + splitk 0.5 + add 1 + norm 1; layer 1 = gemm 4; outside 1 + 1 + 2
                      "kernel_us_per_step": 13.5, "kernel_us_by_layer": [5.5, 4.0], "kernel_us_outside_layers": 4.0,
                      "top_kernels": [["gemm", 2, 7.0], ["orphan", 1, 2.0], ["gather_kernel", 1, 1.0],
                                      ["add_kernel", 1, 1.0], ["_rms_norm_kernel", 1, 1.0], ["argmax_kernel", 1, 1.0],
                                      ["splitk_reduce", 1, 0.5]]}


def test_count_without_activity_types_skips_copies_and_ranges_by_name():
    gpu = DeviceType.CUDA
    events = [_event(f"{LAYER_RANGE}0", DeviceType.CPU, 0, 10, id=1), _event("k", gpu, linked=1),
              _event("Memset (Device)", gpu, linked=1), _event(f"{LAYER_RANGE}0", gpu, linked=1)]
    assert count_kernels(events, num_layers=1)["kernels_by_layer"] == [1]


def _recorded(path="tests/bench/data/h200_step_events.json"):
    import json
    from pathlib import Path

    data = json.loads((Path(__file__).parents[2] / path).read_text())
    return [SimpleNamespace(name=e["name"], device_type=DeviceType.CUDA if e["cuda"] else DeviceType.CPU, id=e["id"],
                            time_range=SimpleNamespace(start=e["start"], end=e["end"])) for e in data["events"]]


def test_count_a_recorded_h200_step_with_its_triton_kernels():
    """Events of a real step (torch 2.11 on an H200: no linked ids, no activity types). Every kernel counts, Triton's
    included: they are launched under no aten op (``cuLaunchKernelEx``), which the count read before missed."""
    events = _recorded()
    counts = count_kernels(events, num_layers=2)
    per_layer = ["_rms_norm_kernel", "nvjet", "_rotary_kernel", "_cache_write_kernel", "_decode_split_kernel",
                 "_decode_merge_kernel", "elementwise", "elementwise", "nvjet", "_add_rms_norm_kernel", "nvjet",
                 "_silu_mul_kernel", "nvjet", "elementwise"]
    assert counts["kernels_by_layer"] == [len(per_layer)] * 2 and counts["kernels_outside_layers"] == 29
    kernels = [e for e in events if e.device_type == DeviceType.CUDA and not e.name.startswith(("Memcpy", "kvroll"))]
    assert counts["kernels_per_step"] == len(kernels) == 57
    assert counts["kernel_us_per_step"] == pytest.approx(sum(e.time_range.end - e.time_range.start for e in kernels))
    assert counts["kernel_us_by_layer"] == pytest.approx([20.381, 20.447], abs=1e-3)
    layer0 = [e.name for e in kernels][12:26]  # after the embedding's and the position's kernels
    kinds = ["nvjet" if name.startswith("nvjet") else "elementwise" if "elementwise" in name else name for name in layer0]
    assert kinds == per_layer
    names = {name: count for name, count, _ in counts["top_kernels"]}
    assert names["_decode_split_kernel"] == names["_decode_merge_kernel"] == 2
    # without the launch calls (a profile that dropped them) the kernels still count, outside the layers
    bare = count_kernels([e for e in events if "Launch" not in e.name], num_layers=2)
    assert bare["kernels_per_step"] == 57 and bare["kernels_by_layer"] == [0, 0]


def test_launch_call_of_the_same_id_places_a_kernel_before_its_linked_op():
    """The launch call (layer 1) wins over the kernel's linked op (layer 0) and over an op sharing the kernel's id
    (layer 0); without the launch call the linked op places it."""
    cpu, gpu = DeviceType.CPU, DeviceType.CUDA
    events = [_event(f"{LAYER_RANGE}0", cpu, 10, 20, id=1), _event(f"{LAYER_RANGE}1", cpu, 30, 40, id=2),
              _event("aten::mm", cpu, 11, 12, id=7),  # an aten op whose id happens to equal the kernel's
              _event("aten::addmm", cpu, 13, 14, id=9),  # the op the kernel is linked to
              _event("cuLaunchKernelEx", cpu, 31, 32, id=7, linked=9), _event("triton_k", gpu, 50, 51, id=7, linked=9)]
    assert count_kernels(events, num_layers=2)["kernels_by_layer"] == [0, 1]
    no_launch = [e for e in events if e.name != "cuLaunchKernelEx"]
    assert count_kernels(no_launch, num_layers=2)["kernels_by_layer"] == [1, 0]


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_cuda_step_kernels_every_layer_alike(family):
    model = tiny_model(family, layers=3).to("cuda", torch.bfloat16)
    engine = RolloutEngine(model, compression=CompressionConfig("longflow", budget=32), max_batch=4)
    counts = step_kernel_counts(engine, SamplingParams(temperature=1.0), batch=4)
    by_layer = counts["kernels_by_layer"]
    assert len(by_layer) == 3 and by_layer[0] == by_layer[1] and by_layer[0] >= 5  # norms, 4+ GEMMs, attention
    assert by_layer[2] == by_layer[0] + 1  # the last layer adds its MLP's residual itself (fused_add_norm)
    assert counts["kernels_outside_layers"] >= 3  # embedding, final norm, LM head, sampling
    assert counts["kernels_per_step"] == sum(by_layer) + counts["kernels_outside_layers"]
    assert all(us > 0 for us in counts["kernel_us_by_layer"]) and counts["kernel_us_outside_layers"] > 0
    assert sum(count for _, count, _ in counts["top_kernels"]) <= counts["kernels_per_step"]
    assert all(not layer._forward_hooks for layer in engine.model.model.layers)
    print(family, counts)  # the next GPU session reads the counts from the log
    # a full cache: both steps (the untimed one and the profiled one) start from every head holding its capacity
    # (the device times are too small at this size to tell a full cache from an empty one: checked on the state)
    runner = engine._decode_runner(SamplingParams(temperature=1.0))
    seen, step = [], runner._step

    def recording_step(batch):
        seen.append((int(engine.cache.count.min()), int(engine.cache.count.max())))
        return step(batch)

    runner._step = recording_step
    full = step_kernel_counts(engine, SamplingParams(temperature=1.0), batch=4, live=10 ** 6)
    cap = engine.cache.capacity
    assert seen == [(cap, cap), (cap, cap)]
    assert full["kernels_by_layer"] == by_layer and int(engine.cache.count.sum()) == 0  # emptied afterwards


def test_report_tables_a_steps_device_time_by_kernel():
    from kvroll.bench.report import _kernel_time

    row = {"policy": "longflow", "budget": 1024, "batch": 64, "steady_step_ms": 4.7, "kernel_us_per_step": 3900.0,
           "kernel_us_by_layer": [120.0, 130.0], "kernel_us_outside_layers": 3650.0,
           "top_kernels": [["nvjet_gemm", 3, 2500.0], ["_decode_attention_kernel", 2, 900.0], ["argmax", 1, 5.0]]}
    assert _kernel_time([{**row, "kernel_us_per_step": None}]) == []  # CPU rows: no section
    lines = _kernel_time([row], top=2)
    assert lines[0] == "## Device time of one decode step, by kernel"
    assert lines[-2] == ("| longflow 1024 | 64 | 4.70 | 3.90 | 125.0 | 3,650 | 3 × `nvjet_gemm` 2,500; "
                         "2 × `_decode_attention_kernel` 900 |")
