"""The private TRL 1.16 surfaces kvroll relies on (DESIGN.md §2.5). A failure here means TRL changed them: update
``kvroll/trainers/switch.py`` / ``adapter.py`` and the pin in ``kvroll/trainers/_trl.py`` together."""
from __future__ import annotations

import inspect

import pytest
import trl
from trl.generation.vllm_generation import VLLMGeneration

from kvroll.trainers import GRPOConfig, RLOOConfig
from kvroll.trainers.adapter import KVRollGeneration
from kvroll.trainers.args import KVRollArguments


def source(fn) -> str:
    return " ".join(inspect.getsource(fn).split())  # whitespace-normalised


@pytest.mark.parametrize("trainer_cls", [trl.GRPOTrainer, trl.RLOOTrainer])
def test_generation_path_calls_the_duck_typed_backend(trainer_cls):
    body = source(trainer_cls._generate_single_turn)
    assert "if self.use_vllm:" in body
    assert "if self.state.global_step != self._last_loaded_step:" in body
    assert "self.vllm_generation.sync_weights()" in body
    assert "self._last_loaded_step = self.state.global_step" in body
    assert "self.vllm_generation.generate( prompts=prompt_ids, images=images, num_generations=" in body
    init = source(trainer_cls.__init__)
    assert "self.use_vllm = args.use_vllm" in init and "self.vllm_mode = args.vllm_mode" in init
    assert "self.eos_token_ids = eos_token_ids" in init


def test_grpo_takes_rollout_logprobs_and_corrects_with_them():
    body = source(trl.GRPOTrainer._generate_single_turn)
    assert "_, completion_ids, logprobs, _ = self.vllm_generation.generate(" in body
    assert "logprobs = [[lp[0] for lp in seq] for seq in logprobs]" in body  # [rows][tokens][1]
    score = source(trl.GRPOTrainer._generate_and_score_completions)
    assert "self.use_vllm and self.vllm_importance_sampling_correction" in score
    assert 'output["importance_sampling_ratio"] = vllm_importance_sampling_ratio' in score
    assert 'self._metrics[mode]["sampling/importance_sampling_ratio/mean"]' in score
    assert "inputs[\"importance_sampling_ratio\"]" in source(trl.GRPOTrainer._compute_loss)


def test_server_mode_keeps_trl_off_colocated_vllm_internals():
    # kvroll sets vllm_mode="server"; TRL reaches into vLLM's engine only for "colocate".
    for trainer_cls in (trl.GRPOTrainer, trl.RLOOTrainer):
        for name, fn in inspect.getmembers(trainer_cls, inspect.isfunction):
            if name == "__init__":
                continue
            body = source(fn)
            if "vllm_generation.llm" in body or "vllm_client" in body:
                assert 'self.vllm_mode == "colocate"' in body, f"{trainer_cls.__name__}.{name}"


def test_adapter_matches_vllm_generation_signatures():
    for name in ("generate", "sync_weights"):
        ours = inspect.signature(getattr(KVRollGeneration, name)).parameters
        theirs = inspect.signature(getattr(VLLMGeneration, name)).parameters
        assert list(ours) == list(theirs), name


def test_metrics_store_and_fields_exist():
    assert "self._metrics = {\"train\": defaultdict(list), \"eval\": defaultdict(list)}" in source(
        trl.GRPOTrainer.__init__)
    for config_cls in (GRPOConfig, RLOOConfig):
        fields = config_cls.__dataclass_fields__
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_completion_length",
                     "generation_kwargs", "use_vllm", "steps_per_generation", "num_generations"):
            assert name in fields, (config_cls.__name__, name)
        for name in KVRollArguments.__dataclass_fields__:
            assert fields[name].metadata.get("help"), name
    for name in ("vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
                 "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min"):
        assert name in GRPOConfig.__dataclass_fields__
    assert GRPOConfig.__dataclass_fields__["vllm_importance_sampling_correction"].default is True
