"""Every public integer argument takes a numpy integer, stored as a Python int, and refuses a bool, a float (even
2.0) and a string alike, with an error naming the field (kvroll/checks.py's ``as_int``)."""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from kvroll.bench.config import load_config
from kvroll.checks import as_int
from kvroll.config import CompressionConfig
from kvroll.rollout import pool as pool_module
from kvroll.rollout.engine import RolloutEngine
from kvroll.rollout.pool import RolloutPool
from kvroll.rollout.requests import validate_request
from kvroll.rollout.sampling import SamplingParams
from tests.conftest import tiny_model

BAD = [True, np.bool_(True), 2.0, "2"]
BENCH_YAML = Path(__file__).resolve().parents[1] / "configs" / "bench" / "cpu_smollm2.yaml"


def test_as_int():
    assert [as_int(v) for v in (3, np.int64(3), np.uint8(3), np.int32(-1))] == [3, 3, 3, -1]
    assert all(type(as_int(v)) is int for v in (3, np.int64(3)))
    assert [as_int(v) for v in (True, np.bool_(False), 2.0, np.float64(2.0), "2", None)] == [None] * 6


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


# ---- RolloutEngine and generate --------------------------------------------------------------------------------
@pytest.mark.parametrize("field", ["max_batch", "sync_every"])
def test_engine_takes_a_numpy_integer(model, field):
    engine = RolloutEngine(model, **{field: np.int64(2)})
    assert type(getattr(engine, field)) is int and getattr(engine, field) == 2


@pytest.mark.parametrize("value", BAD)
@pytest.mark.parametrize("field", ["max_batch", "sync_every"])
def test_engine_refuses_a_non_integer(model, field, value):
    with pytest.raises(ValueError, match=f"RolloutEngine.{field}="):
        RolloutEngine(model, **{field: value})


def test_generate_takes_a_numpy_n(model):
    results = RolloutEngine(model, max_batch=2).generate([[1, 2, 3]], SamplingParams(max_new_tokens=1, seed=0),
                                                         n=np.int64(2))
    assert len(results) == 2


@pytest.mark.parametrize("value", BAD)
def test_generate_refuses_a_non_integer_n(value):
    with pytest.raises(ValueError, match="n="):
        validate_request([[1, 2, 3]], SamplingParams(max_new_tokens=1), value)


# ---- SamplingParams ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field", ["max_new_tokens", "top_k", "seed"])
def test_sampling_takes_a_numpy_integer(field):
    params = SamplingParams(**{field: np.int64(2)})
    assert type(getattr(params, field)) is int and getattr(params, field) == 2


@pytest.mark.parametrize("value", BAD)
@pytest.mark.parametrize("field", ["max_new_tokens", "top_k", "seed"])
def test_sampling_refuses_a_non_integer(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}="):
        SamplingParams(**{field: value})


# ---- CompressionConfig: the budget and a policy's integer field ---------------------------------------------------
def test_compression_takes_numpy_integers():
    config = CompressionConfig("streaming", budget=np.int64(16), sink_tokens=np.int64(4))
    assert type(config.budget) is int and config.budget == 16
    assert type(config.params.sink_tokens) is int and config.params.sink_tokens == 4


@pytest.mark.parametrize("value", BAD)
def test_compression_refuses_a_non_integer_budget(value):
    with pytest.raises(ValueError, match="CompressionConfig.budget="):
        CompressionConfig("streaming", budget=value)


@pytest.mark.parametrize("value", BAD)
def test_compression_refuses_a_non_integer_policy_field(value):
    with pytest.raises(ValueError, match="StreamingParams.sink_tokens="):
        CompressionConfig("streaming", budget=16, sink_tokens=value)


# ---- RolloutPool: checked before Ray is reached --------------------------------------------------------------------
POOL_FIELDS = {"num_workers": 1, "max_batch": 2, "bucket_bytes": 1 << 20, "sync_retries": 1, "max_task_retries": 1,
               "sync_every": 2}


class _Reserved(Exception):
    pass


def test_pool_takes_numpy_integers(model, monkeypatch):
    """Past every check, to the placement group's reservation (patched: no Ray starts), numpy integers as ints."""
    seen = {}

    def reserve(num_workers, gpus, strategy, timeout_s):
        caller = sys._getframe(1).f_locals  # RolloutPool.__init__'s: what the workers' arguments are made of
        seen.update({name: caller[name] for name in ("num_workers", "max_batch", "bucket_bytes", "sync_retries",
                                                      "max_task_retries", "worker_timeout_s", "connect_timeout_s")},
                    sync_every=caller["engine_options"]["sync_every"], timeout=timeout_s)
        raise _Reserved

    monkeypatch.setattr(pool_module.cluster, "connect", lambda *args, **kwargs: None)
    monkeypatch.setattr(pool_module.cluster, "reserve", reserve)
    with pytest.raises(_Reserved):
        RolloutPool(model, gpus_per_worker=0, worker_timeout_s=np.int64(30), connect_timeout_s=np.int64(5),
                    **{name: np.int64(value) for name, value in POOL_FIELDS.items()})
    assert {name: type(value) for name, value in seen.items()} == dict.fromkeys(seen, int), seen
    assert seen["num_workers"] == 1 and seen["sync_every"] == 2 and seen["bucket_bytes"] == 1 << 20


@pytest.mark.parametrize("value", BAD)
@pytest.mark.parametrize("field", list(POOL_FIELDS))
def test_pool_refuses_a_non_integer(model, field, value):
    with pytest.raises(ValueError, match=f"RolloutPool.{field}="):
        RolloutPool(model, **{field: value})


# ---- kvroll bench's config ---------------------------------------------------------------------------------------
BENCH_FIELDS = ["prompt_length", "steady_steps", "full_steps", "seed"]


@pytest.fixture(scope="module")
def bench_config():
    return load_config(BENCH_YAML)


@pytest.mark.parametrize("field", BENCH_FIELDS)
def test_bench_takes_a_numpy_integer(bench_config, field):
    value = getattr(bench_config, field) + 1
    config = dataclasses.replace(bench_config, **{field: np.int64(value)})
    assert type(getattr(config, field)) is int and getattr(config, field) == value


def test_bench_takes_numpy_integers_in_lists(bench_config):
    config = dataclasses.replace(bench_config, batch_sizes=[np.int64(2)], budgets={"longflow": [np.int64(40)],
                                                                                  "rkv": [np.int64(40)]})
    assert [type(b) for b in config.batch_sizes] == [int]
    assert [type(b) for b in config.budgets_of("rkv")] == [int]


def test_bench_stores_numpy_floats_as_floats(bench_config):
    """The float fields too: a numpy float would reach the report's JSON."""
    config = dataclasses.replace(bench_config, temperature=np.float32(0.5), reserve_gb=np.float64(1.5))
    assert (type(config.temperature), type(config.reserve_gb)) == (float, float)
    assert (config.temperature, config.reserve_gb) == (0.5, 1.5)


@pytest.mark.parametrize("raw", ["true", "2.0", '"2"'])
@pytest.mark.parametrize("field", [*BENCH_FIELDS, "batch_sizes", "budgets"])
def test_bench_refuses_a_non_integer(field, raw):
    with pytest.raises(ValueError, match=field):
        load_config(BENCH_YAML, [f"--{field}", raw])


# ---- the trainers' arguments and the arithmetic task ---------------------------------------------------------------
def test_trainer_args_store_numpy_integers_as_ints(tmp_path):
    """kvroll_budget stayed a numpy integer on the args (CompressionConfig converted only its own copy): the args'
    to_json_string() raised TypeError."""
    from kvroll.trainers.grpo import GRPOConfig

    args = GRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, per_device_train_batch_size=4,
                      num_generations=4, use_kvroll=True, kvroll_policy="rkv", kvroll_budget=np.int64(64),
                      kvroll_max_batch=np.int64(4))
    assert (type(args.kvroll_budget), type(args.kvroll_max_batch)) == (int, int)
    assert json.loads(args.to_json_string())["kvroll_budget"] == 64


def test_task_args_store_numpy_integers_as_ints():
    from kvroll.trainers.train import TaskArguments

    task = TaskArguments(task_size=np.int64(4), task_max_operand=np.int64(9), task_seed=np.int64(3))
    assert [type(getattr(task, n)) for n in ("task_size", "task_max_operand", "task_seed")] == [int, int, int]
    assert json.loads(json.dumps(dataclasses.asdict(task)))["task_size"] == 4


def test_arithmetic_problems_take_a_numpy_seed():
    """random.Random(np.int64) raises TypeError ('The only supported seed types are ...')."""
    from kvroll.trainers.arithmetic import arithmetic_problems

    assert arithmetic_problems(np.int64(3), seed=np.int64(5)) == arithmetic_problems(3, seed=5)


def test_trainer_ray_fields_take_numpy_numbers_as_python_ones(tmp_path):
    """kvroll_gpus_per_worker and kvroll_worker_timeout_s take numpy numbers, as RolloutPool's fields do, stored as
    Python's (they went into run.json and to Ray); a numpy bool is refused like a bool."""
    from kvroll.trainers.grpo import GRPOConfig

    common = dict(output_dir=str(tmp_path), report_to="none", use_cpu=True, per_device_train_batch_size=4,
                  num_generations=4, use_kvroll=True, kvroll_policy="rkv", kvroll_budget=64, kvroll_mode="ray")
    args = GRPOConfig(**common, kvroll_gpus_per_worker=np.float64(0.5), kvroll_worker_timeout_s=np.int64(30))
    assert (type(args.kvroll_gpus_per_worker), type(args.kvroll_worker_timeout_s)) == (float, int)
    assert json.loads(args.to_json_string())["kvroll_worker_timeout_s"] == 30
    with pytest.raises(ValueError, match="kvroll_worker_timeout_s=np.True_ is invalid"):
        GRPOConfig(**common, kvroll_worker_timeout_s=np.bool_(True))
