"""2-step GRPO and RLOO runs with ``use_kvroll=True`` on a tiny model: TRL's generation contract, TRL's
importance-sampling metrics, and engine weights equal to the trainer's after every optimizer step."""
from __future__ import annotations

import math

import torch
from transformers import TrainerCallback

from kvroll.trainers import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer
from kvroll.trainers.colocate import weights_checksum

from .tiny_model import chat_dataset, length_reward, tiny_llama, tokenizer

MAX_COMPLETION = 16
COMMON = dict(per_device_train_batch_size=8, num_generations=4, max_completion_length=MAX_COMPLETION, max_steps=2,
              logging_steps=1, report_to="none", use_cpu=True, bf16=False, save_strategy="no", seed=0,
              learning_rate=1e-2, use_kvroll=True, kvroll_policy="longflow", kvroll_budget=16)


class Recorder(TrainerCallback):
    """Wraps the adapter's ``generate`` to check each call, and checksums the weights after each optimizer step."""

    def __init__(self, trainer, dtype):
        self.trainer, self.dtype, self.calls, self.steps = trainer, dtype, [], []
        self.generation = trainer.kvroll_generation
        self._generate = self.generation.generate
        self.generation.generate = self.generate

    def checksums(self):
        engine = self.generation.weights.engine_model
        return weights_checksum(self.trainer.model, self.dtype), weights_checksum(engine)

    def generate(self, prompts, images=None, num_generations=1, profiler=None):
        out = self._generate(prompts=prompts, images=images, num_generations=num_generations, profiler=profiler)
        self.calls.append((list(map(list, prompts)), num_generations, out, self.checksums()))
        return out

    def on_step_end(self, args, state, control, **kwargs):
        # Storage sharing keeps the engine current at once; a copy is refreshed by TRL's sync before generating.
        if self.generation.weights.first_sync["copied"] == 0:
            trainer_sum, engine_sum = self.checksums()
            assert engine_sum == trainer_sum, f"engine weights differ from the trainer's after step {state.global_step}"
        self.steps.append(weights_checksum(self.trainer.model, self.dtype))


def check_contract(recorder, eos_ids):
    finished = 0
    for prompts, group, (prompt_ids, completion_ids, logprobs, extra), _ in recorder.calls:
        assert prompt_ids == prompts and extra is None
        assert len(completion_ids) == len(logprobs) == len(prompts)
        assert all(prompts[i] == prompts[i - i % group] for i in range(len(prompts)))  # TRL repeats each prompt
        for ids, lps in zip(completion_ids, logprobs):
            assert 1 <= len(ids) <= MAX_COMPLETION
            assert len(lps) == len(ids) and all(len(lp) == 1 and math.isfinite(lp[0]) and lp[0] <= 0 for lp in lps)
            assert not any(t in eos_ids for t in ids[:-1]), "a token after EOS was returned"
            if len(ids) < MAX_COMPLETION:
                assert ids[-1] in eos_ids, "a completion shorter than the limit must end with EOS"
            finished += ids[-1] in eos_ids
    assert finished > 0, "no completion finished with EOS: the EOS case went untested"


def check_weights(recorder, trainer):
    # After step k, the engine generating step k+1's rollouts holds step k's weights (and they did change).
    assert len(recorder.steps) == 2 and len(recorder.calls) == 2
    assert recorder.calls[1][3][0] == recorder.calls[1][3][1] == recorder.steps[0]
    assert recorder.calls[0][3][0] != recorder.steps[0], "the first optimizer step did not change the weights"
    trainer.kvroll_generation.sync_weights()  # the sync TRL would run before a third generation
    assert recorder.checksums() == (recorder.steps[1], recorder.steps[1])


def metric_values(trainer, name):
    return [h[name] for h in trainer.state.log_history if name in h]


def test_grpo_two_steps_shared_weights(tmp_path):
    tok = tokenizer()
    args = GRPOConfig(output_dir=str(tmp_path), **COMMON)
    trainer = GRPOTrainer(model=tiny_llama(tok), reward_funcs=length_reward, args=args,
                          train_dataset=chat_dataset(), processing_class=tok)
    recorder = Recorder(trainer, dtype=None)
    trainer.add_callback(recorder)
    trainer.train()
    check_contract(recorder, set(trainer.eos_token_ids))
    check_weights(recorder, trainer)
    assert trainer.kvroll_generation.last_sync["copied"] == 0  # fp32 trainer, fp32 engine: storage is shared
    for name in ("sampling/sampling_logp_difference/mean", "sampling/importance_sampling_ratio/mean",
                 "kvroll/is_masked_fraction", "kvroll/sync_seconds", "kvroll/rollout_seconds"):
        values = metric_values(trainer, name)
        assert len(values) == 2 and all(math.isfinite(v) for v in values), name
    # The prompt (31 tokens) is compressed to the budget, so rollouts are slightly off-policy but close.
    assert 0 < metric_values(trainer, "sampling/sampling_logp_difference/mean")[0] < 1.0
    assert trainer.kvroll_generation.engine.stats["prefills"] == 2 * 8 // 4  # one prefill per group


def test_rloo_two_steps_copied_bf16_weights(tmp_path):
    tok = tokenizer()
    args = RLOOConfig(output_dir=str(tmp_path), kvroll_dtype="bfloat16", beta=0.0, **COMMON)
    trainer = RLOOTrainer(model=tiny_llama(tok), reward_funcs=length_reward, args=args,
                          train_dataset=chat_dataset(), processing_class=tok)
    recorder = Recorder(trainer, dtype=torch.bfloat16)
    trainer.add_callback(recorder)
    trainer.train()
    check_contract(recorder, set(trainer.eos_token_ids))
    check_weights(recorder, trainer)
    generation = trainer.kvroll_generation
    assert generation.last_sync["copied"] > 0 and generation.last_sync["shared"] == 0
    assert next(generation.weights.engine_model.parameters()).dtype == torch.bfloat16
    assert next(trainer.model.parameters()).dtype == torch.float32
    assert trainer.model.config._attn_implementation != "kvroll"  # the trainer's model is left as it was
    assert len(metric_values(trainer, "kvroll/sync_seconds")) == 2
