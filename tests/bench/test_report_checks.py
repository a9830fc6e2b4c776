"""Tests for mutants of ``kvroll/bench`` that the bench tests let through: the 'max' batch's sizing (its
out-of-memory retry is in test_measure_edges.py), a real run's end-to-end rate and policy fraction, HF generate's floor, the markdown's bandwidth
and kernel-time units, and the schema's refusals."""
import copy
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
STORED = ROOT / "docs" / "benchmarks" / "bench_cpu_smollm2" / "report.json"


@pytest.mark.parametrize("free_rows, cap, want", [(13, 1024, 8), (23.5, 1024, 16), (5, 1024, 5), (0.5, 1024, 1),
                                                  (100, 24, 24)])
def test_largest_batch_is_free_memory_less_the_reserve_over_a_sequence_in_multiples_of_8(monkeypatch, free_rows, cap,
                                                                                         want):
    """(free - reserve) // bytes per sequence, rounded down to a multiple of 8 past 8, at least 1, at most the cap."""
    from kvroll.bench import measure

    per_seq, reserve = 3_000_000, 2 * 2**30
    monkeypatch.setattr(measure, "free_bytes", lambda device: reserve + int(free_rows * per_seq))
    bench = SimpleNamespace(device=torch.device("cpu"), reserve=reserve, cap=cap)
    assert measure.Bench.largest_batch(bench, per_seq) == want


def test_a_real_runs_e2e_rate_and_policy_fraction_by_their_definitions(tiny_llama):
    """e2e = batch x generated tokens / wall time (prefill included); policy_frac = the periodic work's seconds over
    the decode time (not the wall time)."""
    from kvroll.bench.measure import Bench, measure_policy

    bench = Bench(tiny_llama, prompt_length=16, reserve_gb=0, max_batch_cap=8, temperature=1.0, seed=0)
    row = measure_policy(bench, "rkv", 16, 2, length=32, steady_steps=16, kwargs={"buffer": 4, "window": 2})
    assert row["events"] >= 2 and row["policy_s"] > 0 and row["wall_s"] > row["decode_s"]
    assert row["run_tokens"] == 16 + 4 - 16 + 16 == 20  # fill (capacity 16 + 4 - prompt 16) + steady steps
    assert row["e2e_tok_s"] == pytest.approx(2 * 20 / row["wall_s"])
    assert row["policy_frac"] == pytest.approx(row["policy_s"] / row["decode_s"])


def test_hf_floor_reads_every_static_cache_slot(tiny_llama, monkeypatch):
    """HF's SDPA attends over the whole StaticCache (prompt + output) at every step: the floor's live tokens."""
    from kvroll.bench import measure

    bench = measure.Bench(tiny_llama, prompt_length=8, reserve_gb=0, max_batch_cap=8, temperature=1.0, seed=0)
    clock = [0.0]
    monkeypatch.setattr(measure.time, "perf_counter", lambda: clock[0])
    real = tiny_llama.generate

    lengths = []

    def generate(*args, generation_config, **kwargs):
        lengths.append(generation_config.max_new_tokens)
        clock[0] += 0.5 + 0.01 * generation_config.max_new_tokens + (1.0 if len(lengths) == 1 else 0.0)  # cold
        return real(*args, generation_config=generation_config, **kwargs)

    monkeypatch.setattr(tiny_llama, "generate", generate)
    row = measure.measure_hf(bench, 2, 32, [4, 16])
    assert lengths == [4, 4, 16] and row["tok_s"] == pytest.approx(200.0)  # the cold first run is a warm-up only
    assert row["mean_live_tokens"] == 40 and row["kv_bytes_per_seq"] == 40 * bench.kv_per_token
    assert row["floor_step_ms"] == pytest.approx(bench.floor_ms(2, 40))
    assert row["step_over_floor"] == pytest.approx(10.0 / bench.floor_ms(2, 40))


def test_markdown_header_gives_the_bandwidth_in_decimal_gb_per_s():
    from kvroll.bench.report import markdown

    report = json.loads(STORED.read_text())
    report["environment"]["copy_bandwidth"] = 4.25e12
    assert "copy bandwidth measured in this run 4,250.0 GB/s" in markdown(report)


def test_kernel_time_table_gives_busy_ms_and_microseconds_per_layer():
    from kvroll.bench.report import _kernel_time

    row = {"policy": "longflow", "budget": 3200, "batch": 64, "steady_step_ms": 4.39, "kernel_us_per_step": 4123.4,
           "kernel_us_by_layer": [100.0, 140.0], "kernel_us_outside_layers": 210.4,
           "top_kernels": [["decode_attention_kernel", 28, 1500.0]]}
    lines = _kernel_time([row])
    assert "| longflow 3200 | 64 | 4.39 | 4.12 | 120.0 | 210 | 28 × `decode_attention_kernel` 1,500 |" in lines


@pytest.mark.parametrize("case", ["tok_s_zero", "tok_s_negative", "error_row_without_error", "error_row_no_length"])
def test_schema_refuses_a_non_positive_rate_and_an_error_row_without_its_fields(case):
    import jsonschema

    from kvroll.bench.schema import REPORT_SCHEMA

    good = json.loads(STORED.read_text())
    jsonschema.validate(good, REPORT_SCHEMA)
    bad = copy.deepcopy(good)
    point = {k: bad["measurements"][0][k] for k in ("kind", "policy", "budget", "batch_request", "length")}
    {"tok_s_zero": lambda: bad["measurements"][0].update(tok_s=0),
     "tok_s_negative": lambda: bad["measurements"][0].update(tok_s=-338.3),
     "error_row_without_error": lambda: bad["errors"].append(point),
     "error_row_no_length": lambda: bad["errors"].append({**point, "error": "x", "length": None} | {}) or
     bad["errors"][-1].pop("length")}[case]()
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, REPORT_SCHEMA)


def test_run_report_table_gives_sync_in_ms():
    from kvroll.bench.run_report import _table

    lines = _table([{"step": 3, "kvroll/sync_seconds": 0.0123}])
    assert lines[-2].endswith("| 12.30 |")
