"""``kvroll_mode="ray"`` under PPO: a 2-step run with one CPU Ray worker; before every rollout and after the last
update the worker holds the policy's weights (per-bucket checksums), and the sync and IS metrics are logged."""
from __future__ import annotations

import math

import pytest

from kvroll.trainers import PPOConfig, PPOTrainer

from .tiny_model import chat_dataset, length_reward, tiny_llama, tokenizer

pytestmark = pytest.mark.ray
ray = pytest.importorskip("ray")


@pytest.fixture(scope="module", autouse=True)
def fresh_ray():
    ray.shutdown()
    yield
    ray.shutdown()


def test_ppo_two_steps_with_a_ray_worker(tmp_path):
    tok = tokenizer()
    args = PPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, rollout_batch_size=4, num_ppo_epochs=1,
                     max_completion_length=10, max_steps=2, logging_steps=1, report_to="none", use_cpu=True,
                     save_strategy="no", seed=0, learning_rate=1e-2, use_kvroll=True, kvroll_policy="longflow",
                     kvroll_budget=16, kvroll_mode="ray", kvroll_num_workers=1, kvroll_gpus_per_worker=0,
                     kvroll_worker_timeout_s=120)
    trainer = PPOTrainer(model=tiny_llama(tok), reward_funcs=length_reward, args=args, train_dataset=chat_dataset(),
                         processing_class=tok)
    generation, policy = trainer.kvroll_generation, trainer.model.policy
    before = []

    def generate(_generate=generation.generate, **kwargs):
        pool = generation.ray.pool
        before.append(pool.plan.checksums(policy))
        assert pool.checksums() == [before[-1]], "the worker's weights differ from the policy's before a rollout"
        return _generate(**kwargs)

    generation.generate = generate
    trainer.train()
    pool = generation.ray.pool
    assert len(before) == 2 and before[0] != before[1], "the first update did not change the policy"
    assert pool.checksums() == [pool.plan.checksums(policy)] and pool.version == 3  # first sync + one per update
    history = trainer.state.log_history
    for name in ("kvroll/sync_seconds", "kvroll/rollout_seconds", "sampling/sampling_logp_difference/mean",
                 "sampling/importance_sampling_ratio/mean", "loss/policy", "loss/value"):
        values = [h[name] for h in history if name in h]
        assert len(values) == 2 and all(math.isfinite(v) for v in values), name
    pool.close()
