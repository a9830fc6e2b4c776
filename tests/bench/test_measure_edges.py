"""``kvroll bench``'s measuring and reporting at their edges: a failed HF rate is an error, not a negative
number; a step policy's floor over a steady window that starts before its cache fills; the 'max' batch's
out-of-memory retry from a cap of 9-10 rows; the reserve's unit; the schema refuses malformed error rows,
environments and ratios."""
import copy
import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
STORED = ROOT / "docs" / "benchmarks" / "bench_cpu_smollm2" / "report.json"


def test_hf_rate_from_a_long_run_no_slower_than_the_short_one_is_an_error(tiny_llama, monkeypatch):
    """Timing noise larger than the extra steps (seen on a shared CPU with hf_new_tokens [1, 2]: 2 of 30 runs) gave
    a negative rate, step and step / floor, written into the report as numbers; it is an error naming the field."""
    from kvroll.bench import measure

    bench = measure.Bench(tiny_llama, prompt_length=8, reserve_gb=0, max_batch_cap=8, temperature=1.0, seed=0)
    clock = [0.0]
    monkeypatch.setattr(measure.time, "perf_counter", lambda: clock[0])
    real = tiny_llama.generate

    def generate(*args, generation_config, **kwargs):
        clock[0] += 0.60 if generation_config.max_new_tokens == 4 else 0.55  # the longer run measured faster
        return real(*args, generation_config=generation_config, **kwargs)

    monkeypatch.setattr(tiny_llama, "generate", generate)
    with pytest.raises(RuntimeError, match=r"hf_new_tokens=\[4, 16\]: the 16-token run took 0.5500 s, no longer than "
                                           r"the 4-token run's 0.6000 s.*widen hf_new_tokens"):
        measure.measure_hf(bench, 2, 32, [4, 16])


def test_a_step_policy_filling_inside_the_steady_window_floors_at_the_windows_mean_fill(tiny_llama):
    """streaming at 64 after a 16-token prompt, 8 steady steps: the cache fills at decode step 48 of 55, inside the
    last quarter (decode steps 43 .. 55 on a CPU, a mark per token); the floor's live tokens are that window's mean
    (was: the last step's fill, the capacity, for every step policy whose cache filled at all)."""
    from kvroll.bench.measure import Bench, measure_policy

    bench = Bench(tiny_llama, prompt_length=16, reserve_gb=0, max_batch_cap=8, temperature=1.0, seed=0)
    row = measure_policy(bench, "streaming", 64, 2, length=56, steady_steps=8)
    window = [min(16 + step, 64) for step in range(56 * 3 // 4 + 1, 56)]  # count after decode step k: prompt + k
    assert row["capacity"] == 64 and row["run_tokens"] == 56 and row["live_tokens_end"] == 64
    assert row["mean_live_tokens"] == pytest.approx(sum(window) / len(window)) and row["mean_live_tokens"] < 64
    assert row["floor_step_ms"] == pytest.approx(bench.floor_ms(2, sum(window) / len(window)))


@pytest.mark.parametrize("cap, fits, tried", [(32, 16, [32, 24, 16]), (10, 7, [10, 7])])
def test_max_batch_out_of_memory_retries_at_three_quarters(tiny_llama, monkeypatch, cap, fits, tried):
    """'max' retries an out-of-memory batch at 3/4 of it, rounded down to a multiple of 8; at a cap of 10 rows (not a
    multiple of 8) that is 7 rows (was 0, which failed as a bad max_batch instead of measuring)."""
    from kvroll.bench import measure

    sizes = []

    def run(bench, compression, batch, tokens, length, capacity):
        sizes.append(batch)
        if batch > fits:
            raise torch.cuda.OutOfMemoryError("simulated")
        return {"batch": batch}

    monkeypatch.setattr(measure, "_policy_run", run)
    bench = measure.Bench(tiny_llama, prompt_length=16, reserve_gb=0, max_batch_cap=cap, temperature=1.0, seed=0)
    row = measure.measure_policy(bench, "streaming", 24, "max", length=16, steady_steps=8)
    assert sizes == tried and row["batch"] == fits and row["largest_batch"] == cap


def test_the_reserve_is_in_gib_as_the_report_says(tiny_llama):
    """reserve_gb is taken as GiB (2**30 bytes) when sizing the 'max' batch: the report's memory table and the
    field's help say so (they said GB, 7.4% less)."""
    from kvroll.bench.config import BenchConfig
    from kvroll.bench.measure import Bench
    from kvroll.bench.report import _memory

    assert Bench(tiny_llama, 8, reserve_gb=1.5, max_batch_cap=8, temperature=1.0, seed=0).reserve == 1.5 * 2**30
    line = next(x for x in _memory([], {"device": "cuda"}, {"reserve_gb": 8, "max_batch_cap": 64}) if "reserve" in x)
    assert "reserve 8 GiB)" in line
    help_text = next(f.metadata["help"] for f in BenchConfig.__dataclass_fields__.values() if f.name == "reserve_gb")
    assert "GiB" in help_text


def _error_row(report, **change):
    point = {k: report["measurements"][0][k] for k in ("kind", "policy", "budget", "batch_request", "length")}
    return {**point, "error": "RuntimeError: out of memory", **change}


@pytest.mark.parametrize("case", ["error_not_text", "error_empty", "error_batch_zero", "error_policy_none",
                                  "error_kind", "kv_bytes_per_token_zero", "kv_bytes_per_token_text",
                                  "device_name_number", "step_over_floor_negative", "x_full_negative", "x_hf_zero",
                                  "live_tokens_negative", "seconds_negative"])
def test_schema_refuses_malformed_error_rows_environment_and_ratios(case):
    """The stored CPU report validates; each malformation of it is refused (was: error rows had only their keys
    checked, kv_bytes_per_token and device_name no type, the ratios and live tokens any sign)."""
    import jsonschema

    from kvroll.bench.schema import REPORT_SCHEMA

    good = json.loads(STORED.read_text())
    jsonschema.validate(good, REPORT_SCHEMA)
    bad = copy.deepcopy(good)
    row, env = bad["measurements"][0], bad["environment"]
    change = {
        "error_not_text": lambda: bad["errors"].append(_error_row(bad, error=123)),
        "error_empty": lambda: bad["errors"].append(_error_row(bad, error="")),
        "error_batch_zero": lambda: bad["errors"].append(_error_row(bad, batch_request=0)),
        "error_policy_none": lambda: bad["errors"].append(_error_row(bad, policy=None)),
        "error_kind": lambda: bad["errors"].append(_error_row(bad, kind="gpu")),
        "kv_bytes_per_token_zero": lambda: env.update(kv_bytes_per_token=0),
        "kv_bytes_per_token_text": lambda: env.update(kv_bytes_per_token="45 KiB"),
        "device_name_number": lambda: env.update(device_name=0),
        "step_over_floor_negative": lambda: row.update(step_over_floor=-5.6),
        "x_full_negative": lambda: row.update(x_full=-1.0),
        "x_hf_zero": lambda: row.update(x_hf=0.0),
        "live_tokens_negative": lambda: row.update(mean_live_tokens=-77.0),
        "seconds_negative": lambda: bad.update(seconds=-1.0),
    }[case]
    change()
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, REPORT_SCHEMA)
