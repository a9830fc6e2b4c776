"""``kvroll_mode="ray"``: 2-step GRPO and RLOO runs with CPU Ray workers and gloo weight sync on a tiny model.

Before every generation (after TRL's sync) and after the last step, each worker's per-bucket checksums equal the
trainer's weights packed the same way; TRL's generation contract and importance-sampling metrics hold."""
from __future__ import annotations

import math

import pytest

from kvroll.trainers import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

from .test_switch import MAX_COMPLETION, check_contract, metric_values
from .tiny_model import chat_dataset, length_reward, tiny_llama, tokenizer

pytestmark = pytest.mark.ray
ray = pytest.importorskip("ray")

COMMON = dict(per_device_train_batch_size=8, num_generations=4, max_completion_length=MAX_COMPLETION, max_steps=2,
              logging_steps=1, report_to="none", use_cpu=True, bf16=False, save_strategy="no", seed=0,
              learning_rate=1e-2, use_kvroll=True, kvroll_policy="longflow", kvroll_budget=16, kvroll_mode="ray",
              kvroll_gpus_per_worker=0, kvroll_worker_timeout_s=120)


@pytest.fixture(scope="module", autouse=True)
def fresh_ray():
    ray.shutdown()
    yield
    ray.shutdown()


class SyncRecorder:
    """Wraps the adapter's generate: records each call and checks the workers hold the trainer's weights."""

    def __init__(self, trainer):
        self.trainer, self.generation, self.calls = trainer, trainer.kvroll_generation, []
        self._generate = self.generation.generate
        self.generation.generate = self.generate

    def check_workers(self):
        pool = self.generation.ray.pool
        expected = pool.plan.checksums(self.trainer.model)
        assert pool.checksums() == [expected] * pool.num_workers, "a worker's weights differ from the trainer's"
        return expected

    def generate(self, prompts, images=None, num_generations=1, profiler=None):
        sums = self.check_workers()
        out = self._generate(prompts=prompts, images=images, num_generations=num_generations, profiler=profiler)
        self.calls.append((list(map(list, prompts)), num_generations, out, sums))
        return out


def run(trainer_cls, config_cls, tmp_path, **kwargs):
    tok = tokenizer()
    args = config_cls(output_dir=str(tmp_path), **COMMON, **kwargs)
    trainer = trainer_cls(model=tiny_llama(tok), reward_funcs=length_reward, args=args,
                          train_dataset=chat_dataset(), processing_class=tok)
    recorder = SyncRecorder(trainer)
    trainer.train()
    check_contract(recorder, set(trainer.eos_token_ids))
    assert len(recorder.calls) == 2 and recorder.calls[0][3] != recorder.calls[1][3], "weights did not change"
    trainer.kvroll_generation.sync_weights()  # the sync TRL would run before a third generation
    recorder.check_workers()
    pool = trainer.kvroll_generation.ray.pool
    assert pool.version == 3 and pool.versions() == [3] * pool.num_workers
    return trainer, pool


def test_grpo_two_steps_with_two_ray_workers(tmp_path):
    trainer, pool = run(GRPOTrainer, GRPOConfig, tmp_path, kvroll_num_workers=2)
    assert pool.num_workers == 2 and len({m["pid"] for m in ray.get(
        [slot.actor.health.remote() for slot in pool.slots])}) == 2
    assert sum(m["generated_tokens"] for m in pool.metrics()) > 0 and all(
        m["generate_calls"] == 2 for m in pool.metrics())  # both workers took a shard of each step
    for name in ("sampling/sampling_logp_difference/mean", "sampling/importance_sampling_ratio/mean",
                 "kvroll/sync_seconds", "kvroll/sync_bytes", "kvroll/sync_gb_per_s", "kvroll/sync_version",
                 "kvroll/rollout_seconds", "kvroll/rollout_tokens_per_second"):
        values = metric_values(trainer, name)
        assert len(values) == 2 and all(math.isfinite(v) for v in values), name
    assert metric_values(trainer, "kvroll/sync_version") == [1, 2]
    assert 0 < metric_values(trainer, "sampling/sampling_logp_difference/mean")[0] < 1.0
    pool.close()


def test_rloo_two_steps_with_a_ray_worker_in_bf16(tmp_path):
    trainer, pool = run(RLOOTrainer, RLOOConfig, tmp_path, kvroll_num_workers=1, kvroll_dtype="bfloat16", beta=0.0)
    assert pool.dtype.__repr__() == "torch.bfloat16" and pool.metrics()[0]["generate_calls"] == 2
    pool.close()


def test_shipped_ray_config_parses():
    from pathlib import Path

    from kvroll.trainers.train import build_parser

    config = Path(__file__).parents[2] / "configs" / "grpo_smollm2_ray.yaml"
    task, args = build_parser().parse_args_and_config(["--config", str(config)])
    assert (task.model, args.use_kvroll, args.kvroll_mode, args.kvroll_num_workers) == ("smollm2", True, "ray", 1)
    assert args.kvroll_gpus_per_worker is None and args.kvroll_ray_address is None


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_grpo_ray_mode_under_zero3_on_two_ranks(tmp_path, lora):
    if lora:
        pytest.importorskip("peft")
    import os
    import subprocess
    import sys
    from pathlib import Path

    from .test_two_ranks import free_port

    worker = Path(__file__).with_name("ray_zero3_worker.py")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(worker), str(tmp_path)] + (["--lora"] if lora else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    assert "RANK 0 OK" in output and "RANK 1 OK" in output, output[-6000:]


def test_grpo_with_a_lora_model_sends_the_merged_weights(tmp_path):
    peft = pytest.importorskip("peft")
    from .test_peft import ADAPTED, LORA, MergedRecorder, check_lora_run

    tok = tokenizer()
    args = GRPOConfig(output_dir=str(tmp_path), **COMMON, kvroll_num_workers=1)
    trainer = GRPOTrainer(model=tiny_llama(tok), reward_funcs=length_reward, args=args, train_dataset=chat_dataset(),
                          processing_class=tok, peft_config=peft.LoraConfig(**LORA))
    base_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" not in n}

    def compare(merged):  # the worker's buckets against peft's merged copy packed by the same plan
        pool = trainer.kvroll_generation.ray.pool
        assert sorted(pool.plan.names()) == sorted(n for kind in (merged.named_parameters(), merged.named_buffers())
                                                   for n, _ in kind)
        assert pool.checksums() == [pool.plan.checksums(merged)], "the worker does not hold the merged weights"

    recorder = MergedRecorder(trainer, compare)
    trainer.train()
    check_lora_run(trainer, recorder, base_before)
    pool = trainer.kvroll_generation.ray.pool
    assert pool.version == 3 and not any(".base_layer" in n or "lora_" in n for n in pool.plan.names())
    assert all(n in pool.plan.names() for n in ADAPTED)
    pool.close()
