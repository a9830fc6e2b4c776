"""ColocatedWeights without a trainer: storage sharing across device spellings, copies, bucketed sync, LoRA models
merged."""
from __future__ import annotations

import copy

import pytest
import torch

from kvroll import CompressionConfig, RolloutEngine, SamplingParams
from kvroll.trainers.colocate import ColocatedWeights, _buckets, weights_checksum
from tests.conftest import lora_model, merged_reference

from .tiny_model import tiny_llama, tokenizer


def test_shares_storage_when_the_device_is_spelled_cpu_0():
    # Accelerate names a CPU rank's device "cpu:0"; parameters say "cpu". Same storage must still be shared.
    model = tiny_llama(tokenizer())
    weights = ColocatedWeights(model, device="cpu:0")
    assert weights.first_sync["copied"] == 0 and weights.first_sync["shared"] > 0
    assert weights_checksum(weights.engine_model) == weights_checksum(model)


def test_copies_another_dtype_and_follows_updates():
    model = tiny_llama(tokenizer())
    weights = ColocatedWeights(model, dtype=torch.bfloat16, device="cpu")
    assert weights.first_sync["shared"] == 0 and weights.first_sync["copied"] > 0
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.add_(1.0)
    assert weights_checksum(weights.engine_model) != weights_checksum(model, torch.bfloat16)
    weights.sync()
    assert weights_checksum(weights.engine_model) == weights_checksum(model, torch.bfloat16)


def test_buckets_keep_order_and_cap_size():
    named = [(f"p{i}", torch.empty(n)) for i, n in enumerate([3, 4, 10, 1, 1, 2])]
    buckets = list(_buckets(named, max_numel=5))
    assert [[name for name, _ in b] for b in buckets] == [["p0"], ["p1"], ["p2"], ["p3", "p4", "p5"]]


def test_a_lora_model_gives_the_engine_its_merged_weights_and_stays_as_it_was():
    from tests.rollout.test_engine import hf_greedy, random_prompts

    peft = pytest.importorskip("peft")
    model = lora_model(peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"])).eval()
    before = {name: param.clone() for name, param in model.named_parameters()}
    weights = ColocatedWeights(model, device="cpu")
    engine_params = dict(weights.engine_model.named_parameters())
    reference = merged_reference(model)
    assert sorted(engine_params) == sorted(reference)
    assert all(torch.equal(engine_params[n], t) for n, t in reference.items())
    # The 6 adapted weights are the engine's own buffers; the other weights are the trainer's storage.
    assert weights.first_sync["copied"] == 6 and weights.first_sync["shared"] == len(reference) - 6
    assert all(torch.equal(param, before[name]) for name, param in model.named_parameters())
    assert type(weights.engine_model).__name__ == "LlamaForCausalLM"

    merged = copy.deepcopy(model).merge_and_unload().eval()
    engine = RolloutEngine(weights.engine_model, compression=CompressionConfig("full"), max_batch=3)
    prompts = random_prompts(3, 256, 3, 30, seed=2)
    results = engine.generate(prompts, SamplingParams(max_new_tokens=24, temperature=0.0))
    assert [r.token_ids for r in results] == [hf_greedy(merged, p, 24) for p in prompts]

    with torch.no_grad():  # an optimizer step on the adapter
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.add_(0.1)
    assert weights_checksum(weights.engine_model) != weights_checksum(model)
    assert weights.sync()["copied"] == 6
    reference = merged_reference(model)
    assert all(torch.equal(engine_params[n], t) for n, t in reference.items())
    assert weights_checksum(weights.engine_model) == weights_checksum(model)


def test_a_lora_model_merges_in_fp32_before_the_engine_dtype():
    peft = pytest.importorskip("peft")
    model = lora_model(peft.LoraConfig(r=4, target_modules=["q_proj", "o_proj"]))
    weights = ColocatedWeights(model, dtype=torch.bfloat16, device="cpu")
    engine_params = dict(weights.engine_model.named_parameters())
    for name, tensor in merged_reference(model).items():
        assert torch.equal(engine_params[name], tensor.to(torch.bfloat16)), name


@pytest.mark.parametrize("change", ["set_adapter", "unmerge", "enable", "late_adapter"])
def test_the_adapters_changing_after_the_build_never_write_into_the_trainers_weights(change):
    # A LoRA layer's base weight is the engine's own copy even while no adapter changes it, so switching, merging or
    # enabling adapters later gives the engine the new merge; an adapter on a module the engine shares is refused.
    peft = pytest.importorskip("peft")
    model = lora_model(peft.LoraConfig(r=4, target_modules=["q_proj"]))
    other = peft.LoraConfig(r=2, target_modules=["o_proj"], init_lora_weights=False)
    if change == "set_adapter":
        model.add_adapter("other", other)
    if change == "unmerge":
        model.merge_adapter()
    if change == "enable":
        with model.disable_adapter():
            weights = ColocatedWeights(model, device="cpu")
    else:
        weights = ColocatedWeights(model, device="cpu")
    if change == "set_adapter":
        model.set_adapter("other")
    if change == "unmerge":
        model.unmerge_adapter()
    if change == "late_adapter":
        model.add_adapter("late", other)
        model.set_adapter("late")
    before = {name: param.clone() for name, param in model.named_parameters()}
    if change == "late_adapter":
        with pytest.raises(ValueError, match="'model.layers.0.self_attn.o_proj.weight' with the training model"):
            weights.sync()
    else:
        weights.sync()
        weights.sync()
        engine_params = dict(weights.engine_model.named_parameters())
        for name, tensor in merged_reference(model).items():
            torch.testing.assert_close(engine_params[name], tensor, atol=1e-6, rtol=0, msg=name)
    assert all(torch.equal(param, before[name]) for name, param in model.named_parameters())


def test_a_parameter_replaced_since_the_build_is_copied_into_the_engine():
    model = tiny_llama(tokenizer())
    weights = ColocatedWeights(model, device="cpu")
    mlp = model.model.layers[0].mlp
    mlp.up_proj.weight = torch.nn.Parameter(mlp.up_proj.weight.detach() + 1.0)  # a new tensor, not an in-place step
    assert weights_checksum(weights.engine_model) != weights_checksum(model)
    assert weights.sync()["copied"] == 1
    assert weights_checksum(weights.engine_model) == weights_checksum(model)
