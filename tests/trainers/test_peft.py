"""A 2-step GRPO run with ``use_kvroll=True`` and a LoRA ``peft_config`` (colocate mode): before each generation and
after the last step the engine holds peft's merge_and_unload of the trainer's model; the trainer's model stays an
unmerged LoRA model whose frozen base weights never move."""
from __future__ import annotations

import copy

import pytest
import torch

from kvroll.trainers import GRPOConfig, GRPOTrainer

from .test_switch import COMMON, check_contract
from .tiny_model import chat_dataset, length_reward, tiny_llama, tokenizer

peft = pytest.importorskip("peft")

LORA = dict(r=4, lora_alpha=8, lora_dropout=0.05, target_modules=["q_proj", "v_proj", "up_proj"],
            init_lora_weights=False)  # B starts non-zero, so even the first rollout needs the merge
ADAPTED = {f"model.layers.{i}.{m}.weight" for i in range(2) for m in ("self_attn.q_proj", "self_attn.v_proj",
                                                                          "mlp.up_proj")}


class MergedRecorder:
    """Wraps the adapter's generate: before each call, ``compare(merged)`` checks the engine against ``merged``,
    peft's merge_and_unload of a copy of the trainer's model (an independent reference)."""

    def __init__(self, trainer, compare):
        self.trainer, self.generation, self.compare = trainer, trainer.kvroll_generation, compare
        self.calls, self.merged = [], []
        self._generate = self.generation.generate
        self.generation.generate = self.generate

    def check_engine(self):
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        merged = copy.deepcopy(model).merge_and_unload()
        self.compare(merged)
        self.merged.append({name: param.detach().clone() for name, param in merged.named_parameters()})

    def generate(self, prompts, images=None, num_generations=1, profiler=None):
        self.check_engine()  # TRL has just synced (the first sync builds the engine / the pool)
        out = self._generate(prompts=prompts, images=images, num_generations=num_generations, profiler=profiler)
        self.calls.append((list(map(list, prompts)), num_generations, out, None))
        return out


def check_lora_run(trainer, recorder, base_before):
    """Both generations saw the merged weights of their step; the adapter trained; the base did not move."""
    check_contract(recorder, set(trainer.eos_token_ids))
    trainer.kvroll_generation.sync_weights()  # the sync TRL would run before a third generation
    recorder.check_engine()
    first, second, last = recorder.merged
    changed = {n for n in first if not torch.equal(first[n], second[n])}
    assert changed == ADAPTED and any(not torch.equal(second[n], last[n]) for n in ADAPTED), \
        "the adapter did not train, or something besides the adapted weights changed"
    model = trainer.accelerator.unwrap_model(trainer.model)
    assert isinstance(model, peft.PeftModel) and not any(getattr(m, "merged", False) for m in model.modules())
    for name, param in model.named_parameters():
        assert ("lora_" in name) == param.requires_grad, name
        if "lora_" not in name:
            assert torch.equal(param, base_before[name]), f"the frozen {name} changed: merged in place?"


def test_grpo_two_steps_with_a_lora_model(tmp_path):
    tok = tokenizer()
    args = GRPOConfig(output_dir=str(tmp_path), **COMMON)
    trainer = GRPOTrainer(model=tiny_llama(tok), reward_funcs=length_reward, args=args, train_dataset=chat_dataset(),
                          processing_class=tok, peft_config=peft.LoraConfig(**LORA))
    base_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" not in n}

    def compare(merged):
        engine = dict(trainer.kvroll_generation.weights.engine_model.named_parameters())
        reference = dict(merged.named_parameters())
        assert sorted(engine) == sorted(reference)
        for name, tensor in reference.items():
            assert torch.equal(engine[name], tensor), f"engine weight {name} is not the merged weight"

    recorder = MergedRecorder(trainer, compare)
    trainer.train()
    check_lora_run(trainer, recorder, base_before)
    sync = trainer.kvroll_generation.last_sync
    assert sync["copied"] == len(ADAPTED) and sync["shared"] > 0  # only the adapted weights are the engine's own


def test_an_unmergeable_adapter_is_refused_when_the_trainer_is_built(tmp_path):
    tok = tokenizer()
    args = GRPOConfig(output_dir=str(tmp_path), **COMMON)
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.q_proj': it is a LoRA variant"):
        GRPOTrainer(model=tiny_llama(tok), reward_funcs=length_reward, args=args, train_dataset=chat_dataset(),
                    processing_class=tok, peft_config=peft.LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))


def test_the_pool_refuses_an_unmergeable_adapter_before_reaching_ray(monkeypatch):
    from kvroll import CompressionConfig
    from kvroll.rollout import cluster
    from kvroll.rollout.pool import RolloutPool
    from tests.conftest import lora_model

    monkeypatch.setattr(cluster, "connect", lambda *a, **k: pytest.fail("Ray reached before the refusal"))
    model = lora_model(peft.LoraConfig(r=4, target_modules=["q_proj"], lora_bias=True))
    with pytest.raises(ValueError, match="lora_bias"):
        RolloutPool(model, CompressionConfig("full"), num_workers=1, gpus_per_worker=0)
