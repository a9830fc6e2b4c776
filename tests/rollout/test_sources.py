"""named_sources of PEFT LoRA models against peft's own merge_and_unload of a copy; what it refuses."""
import pytest
import torch

from kvroll.rollout.sources import LoraDelta, base_model, named_sources
from tests.conftest import lora_model, merged_reference, tiny_model

peft = pytest.importorskip("peft")
from peft import LoraConfig, get_peft_model  # noqa: E402


def values(model, kind="parameters") -> dict[str, torch.Tensor]:
    return {name: source.value() for name, source in named_sources(model, kind)}


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_lora_sources_equal_merge_and_unload_and_leave_the_model_alone(family):
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, use_rslora=family == "qwen3",
                        target_modules=["q_proj", "v_proj", "down_proj", "embed_tokens"])
    model = lora_model(config, family)
    before = {name: param.clone() for name, param in model.named_parameters()}
    reference = merged_reference(model)
    got = values(model)
    assert sorted(got) == sorted(reference)
    for name, tensor in reference.items():
        assert torch.equal(got[name], tensor), name  # fp32, same operations as peft: bit for bit
    merged = {name for name, source in named_sources(model) if source.deltas}
    assert merged == {"model.embed_tokens.weight"} | {f"model.layers.{i}.{m}.weight" for i in range(2)
                                                      for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")}
    assert not torch.equal(got["model.layers.0.self_attn.q_proj.weight"],
                           model.get_parameter("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"))
    assert all(torch.equal(param, before[name]) for name, param in model.named_parameters())
    assert not any(getattr(m, "merged", False) for m in model.modules())
    assert set(values(model, "buffers")) == {n for n, _ in base_model(model).named_buffers()} == {
        "model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"}


def test_only_active_adapters_are_merged_and_several_active_ones_add_up():
    model = lora_model(LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    model.add_adapter("other", LoraConfig(r=2, target_modules=["q_proj", "o_proj"], init_lora_weights=False))
    reference = merged_reference(model)  # "default" active only
    assert all(torch.equal(values(model)[n], t) for n, t in reference.items())
    model.base_model.set_adapter(["default", "other"])
    both = merged_reference(model)
    got = values(model)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight"):
        assert not torch.equal(both[name], reference[name])
        torch.testing.assert_close(got[name], both[name], atol=1e-6, rtol=0)  # peft adds in another order


def test_modules_to_save_sends_the_active_copy():
    model = lora_model(LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]))
    with torch.no_grad():
        model.base_model.model.lm_head.modules_to_save["default"].weight.add_(1.0)
    got, reference = values(model), merged_reference(model)
    assert torch.equal(got["lm_head.weight"], reference["lm_head.weight"])
    assert not torch.equal(got["lm_head.weight"], model.base_model.model.lm_head.original_module.weight)


def test_fan_in_fan_out_conv1d_layers_merge_transposed():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                      bos_token_id=0, eos_token_id=0))
    model = get_peft_model(gpt2, LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True,
                                            init_lora_weights=False))
    got, reference = values(model), merged_reference(model)
    assert sorted(got) == sorted(reference)  # tied lm_head / wte appear once, as in named_parameters
    assert all(torch.equal(got[n], t) for n, t in reference.items())


def test_merged_or_disabled_layers_send_what_their_forward_uses():
    model = lora_model(LoraConfig(r=4, target_modules=["q_proj"]))
    reference = merged_reference(model)
    with model.disable_adapter():
        plain = values(model)
    assert torch.equal(plain["model.layers.0.self_attn.q_proj.weight"],
                       model.get_parameter("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"))
    model.merge_adapter()
    torch.testing.assert_close(values(model)["model.layers.0.self_attn.q_proj.weight"],
                               reference["model.layers.0.self_attn.q_proj.weight"], atol=1e-6, rtol=0)


@pytest.mark.parametrize("config, message", [
    (LoraConfig(r=4, target_modules=["q_proj"], use_dora=True), "LoRA variant"),
    (LoraConfig(r=4, target_modules=["q_proj"], lora_bias=True), "lora_bias"),
    (peft.IA3Config(target_modules=["q_proj", "down_proj"], feedforward_modules=["down_proj"]), r"ia3\.layer\.Linear"),
    (peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4), "prompt learning"),
    (LoraConfig(r=4, target_modules=["q_proj"], trainable_token_indices=[1, 2]), "TrainableTokens"),
])
def test_unsupported_adapters_are_refused_by_name(config, message):
    model = get_peft_model(tiny_model("llama"), config)
    with pytest.raises(ValueError, match=message):
        named_sources(model)


def test_an_adapter_on_one_of_two_tied_weights_is_refused():
    base = tiny_model("llama")
    base.config.tie_word_embeddings = True
    base.tie_weights()
    assert base.lm_head.weight is base.model.embed_tokens.weight
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["embed_tokens"]))
    with pytest.raises(ValueError, match="'model.embed_tokens.weight' and 'lm_head.weight' are tied"):
        named_sources(model)


def test_a_mixed_peft_model_merges_its_lora_and_refuses_its_loha():
    model = get_peft_model(tiny_model("llama"), LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False),
                           mixed=True)
    got, reference = values(model), merged_reference(model)
    assert sorted(got) == sorted(reference) and all(torch.equal(got[n], t) for n, t in reference.items())
    model.add_adapter("loha", peft.LoHaConfig(r=2, target_modules=["v_proj"]))
    model.set_adapter(["default", "loha"])
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.v_proj' \(peft.tuners.loha.layer.Linear\)"):
        named_sources(model)


def _partitioned(full: torch.Tensor, world: int = 1, rank: int = 0, device: str = "cpu",
                 **part_attrs) -> torch.nn.Parameter:
    """A parameter laid out as DeepSpeed ZeRO-3 partitions it (partition_parameters.py): ``data`` freed, this rank's
    slice of the flat tensor (padded at the end) in ``ds_tensor``."""
    from deepspeed.runtime.zero.partition_parameters import PartitionedParamStatus, ZeroParamStatus

    size = -(-full.numel() // world)
    flat = torch.cat([full.flatten(), torch.full((size * world - full.numel(),), float("nan"))])
    param = torch.nn.Parameter(torch.empty(0))
    param.ds_id, param.ds_status, param.ds_shape, param.ds_numel = 7, ZeroParamStatus.NOT_AVAILABLE, full.shape, \
        full.numel()
    param.ds_zero_partition_world_size = world
    param.ds_tensor = flat[rank * size:(rank + 1) * size].clone().to(device)
    param.ds_tensor.status, param.ds_tensor.final_location = PartitionedParamStatus.AVAILABLE, None
    for key, value in part_attrs.items():
        setattr(param.ds_tensor, key, value)
    return param


def test_a_zero3_partition_held_whole_is_read_without_a_gather_and_others_are_gathered(monkeypatch):
    import deepspeed

    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
    from deepspeed.runtime.zero.partition_parameters import PartitionedParamStatus, ZeroParamStatus

    from kvroll.rollout.sources import Source, held_whole, whole
    from kvroll.rollout.weights import gathered

    full = torch.randn(5, 3)
    one = _partitioned(full)
    assert held_whole(one) and torch.equal(whole(one), full)  # read from ds_tensor, shaped as the parameter
    assert isinstance(gathered([one]), type(gathered([])))  # nothing to gather: a null context
    lora_a, lora_b = torch.randn(2, 3), torch.randn(5, 2)
    merged = Source(one, (LoraDelta(_partitioned(lora_a), _partitioned(lora_b), 0.5, False),)).value()
    torch.testing.assert_close(merged, full + 0.5 * lora_b @ lora_a)
    others = {"two ranks": _partitioned(full, world=2), "rank 1 of 2": _partitioned(full, world=2, rank=1),
              "nvme": _partitioned(full, final_location=OffloadDeviceEnum.nvme),
              "swapped out": _partitioned(full, status=PartitionedParamStatus.NOT_AVAILABLE),
              "quantized": _partitioned(full, ds_quant_scale=torch.ones(1)),
              "offloaded": _partitioned(full, device="meta")}  # partition on another device than the parameter
    available = _partitioned(full)
    available.ds_status, available.data = ZeroParamStatus.AVAILABLE, full.clone()  # inside a gather: itself
    for name, param in others.items():
        assert not held_whole(param), name
        assert whole(param).numel() == 0, name  # the freed data: these need DeepSpeed's gather (``gathered``)
    assert not held_whole(available) and torch.equal(whole(available), full)
    assert not held_whole(torch.nn.Parameter(full.clone()))
    assert isinstance(gathered([available]), type(gathered([])))  # already full: no (nested) gather
    calls = []
    monkeypatch.setattr(deepspeed.zero, "GatheredParameters", lambda params, **kw: calls.append(params) or kw)
    gathered([one, available, *others.values(), torch.nn.Parameter(full.clone())])
    assert [[id(p) for p in params] for params in calls] == [[id(p) for p in others.values()]]  # exactly these


def test_an_adapter_on_replicated_layers_is_refused_with_the_replication_named():
    # layer_replication makes layers 2 and 3 share layers 0 and 1's weights; each copy gets its own LoRA
    model = get_peft_model(tiny_model("llama"), LoraConfig(r=2, target_modules=["q_proj"],
                                                           layer_replication=[[0, 2], [0, 2]]))
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.q_proj.weight' and "
                                         r"'model.layers.2.self_attn.q_proj.weight' are tied .*drop layer_replication"):
        named_sources(model)


def test_modules_to_save_sends_the_original_while_adapters_are_disabled():
    model = lora_model(LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]))
    with torch.no_grad():
        model.base_model.model.lm_head.modules_to_save["default"].weight.add_(1.0)
    with model.disable_adapter():
        got = values(model)
    assert torch.equal(got["lm_head.weight"], model.base_model.model.lm_head.original_module.weight)


def test_modules_to_save_on_one_of_two_tied_weights_is_refused():
    base = tiny_model("llama")
    base.config.tie_word_embeddings = True
    base.tie_weights()
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]))
    with pytest.raises(ValueError, match="'model.embed_tokens.weight' and 'lm_head.weight' are tied"):
        named_sources(model)


def test_a_layer_merged_and_disabled_at_once_is_refused():
    model = lora_model(LoraConfig(r=4, target_modules=["q_proj"]))
    model.merge_adapter()
    with model.disable_adapter(), pytest.raises(ValueError, match="'model.layers.0.self_attn.q_proj' is merged and "
                                                                  "disabled at once"):
        named_sources(model)


def test_a_merged_weights_gather_includes_its_lora_a_and_b(monkeypatch):
    import deepspeed

    from kvroll.rollout.sources import Source
    from kvroll.rollout.weights import gathered

    weight, lora_a, lora_b = (_partitioned(torch.randn(*shape), world=2) for shape in [(5, 3), (2, 3), (5, 2)])
    calls = []
    monkeypatch.setattr(deepspeed.zero, "GatheredParameters", lambda params, **kw: calls.append(params) or kw)
    gathered(Source(weight, (LoraDelta(lora_a, lora_b, 0.5, False),)).params)
    assert [[id(p) for p in params] for params in calls] == [[id(weight), id(lora_a), id(lora_b)]]
