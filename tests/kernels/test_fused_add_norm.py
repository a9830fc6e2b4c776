"""The fused decoder layer (mid-layer residual add + post-attention RMSNorm as one ``add_rms_norm``): its install,
HF's forward kept for prefill, grad and CPU inputs, and the engine switch's greedy tokens and kernel calls. What the
three fusion switches do alike (off by default, sliding window, load_weights, switches together) is tested in
test_fusion_switches.py.

CPU (CI): ``fused_add_norm.kernel_on_cpu`` widens the decode path to CPU tensors; the kernel runs under
``TRITON_INTERPRET=1``. GPU (``gpu``): the same on CUDA, where the path is taken for no-grad decode steps by itself.
"""
import copy
import os

import pytest
import torch

from kvroll import CompressionConfig, RolloutEngine, SamplingParams
from kvroll.kernels import add_rms_norm, fused_add_norm as fan
from tests.kernels.conftest import ALL_OFF, FAMILIES, PROMPTS, assert_same_greedy, generate, model_of

triton_ok = add_rms_norm.triton is not None and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")
needs_triton = pytest.mark.skipif(not triton_ok, reason="needs Triton on a GPU or TRITON_INTERPRET=1")
GREEDY_CUDA = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)
FUSION = "fused_add_norm"  # the switch of kernel_on_cpu (tests/kernels/conftest.py)


def layers(model):
    return list(model.model.layers)


@pytest.mark.parametrize("family", FAMILIES)
def test_install_swaps_layer_classes_once_and_keeps_parameters(family):
    model, reference = model_of(family), model_of(family)
    params = dict(model.named_parameters())
    if add_rms_norm.triton is None:
        assert fan.install_fused_add_norm(model) == 0
        return
    assert fan.install_fused_add_norm(model) == 2
    assert fan.install_fused_add_norm(model) == 0  # idempotent
    assert dict(model.named_parameters()) == params and set(model.state_dict()) == set(reference.state_dict())
    for layer, ref in zip(layers(model), layers(reference)):
        assert type(layer).__bases__ == (type(ref),) and type(layer).__name__ == "Fused" + type(ref).__name__
        assert type(ref).forward is not fan._fused_forward and "forward" not in vars(layer)
    assert type(copy.deepcopy(model).model.layers[0]) is type(layers(model)[0])


@needs_triton
@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_prefill_grad_and_cpu_inputs_run_hf_forward_bitwise(family, kernel_on_cpu):
    """Without an engine decode step (a plain forward, with or without grad) the layer is HF's, bit for bit."""
    model, reference = model_of(family), model_of(family)
    fan.install_fused_add_norm(model)
    ids = torch.tensor([[3, 17, 42, 5]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
    out, ref = model(ids).logits, reference(ids).logits  # grad enabled
    assert torch.equal(out, ref) and not kernel_on_cpu
    out.square().sum().backward()
    ref.square().sum().backward()
    for layer, ref_layer in zip(layers(model), layers(reference)):
        grad, ref_grad = layer.post_attention_layernorm.weight.grad, ref_layer.post_attention_layernorm.weight.grad
        assert grad is not None and grad.abs().sum() > 0 and torch.equal(grad, ref_grad)


@needs_triton
@pytest.mark.parametrize("policy", [CompressionConfig("full"), CompressionConfig("longflow", budget=12)])
@pytest.mark.parametrize("family", FAMILIES)
def test_engine_greedy_tokens_unchanged_by_the_switch(family, policy, kernel_on_cpu):
    _, off = generate(model_of(family), policy)
    engine, on = generate(model_of(family), policy, fused_add_norm=True)
    assert engine.fused_add_norm and all(type(m).__name__.startswith("Fused") for m in layers(engine.model))
    steps = engine.stats["decode_steps"]
    # every decode step: layer 0 its mid-layer add, layer 1 also the MLP add of layer 0 (into its input norm); no prefill
    assert steps >= 11 and len(kernel_on_cpu) == 3 * steps
    assert all(shape[1:] == (1, 64) for shape in kernel_on_cpu)  # [slots, 1, H]
    assert_same_greedy(on, off)


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_engine_greedy_unchanged_fp32_and_bf16(family):
    """On CUDA (graphs captured) the fused add + norm is the unfused add + RMSNorm kernel bit for bit: same tokens
    and logprobs in fp32 and in bf16."""
    for dtype in (torch.float32, torch.bfloat16):
        off = RolloutEngine(model_of(family).to("cuda", dtype), max_batch=2, **ALL_OFF).generate(PROMPTS, GREEDY_CUDA)
        engine = RolloutEngine(model_of(family).to("cuda", dtype), max_batch=2, **{**ALL_OFF, "fused_add_norm": True})
        assert engine.cuda_graphs
        on = engine.generate(PROMPTS, GREEDY_CUDA)
        assert [r.token_ids for r in on] == [r.token_ids for r in off], dtype
        assert [r.logprobs for r in on] == [r.logprobs for r in off], dtype


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_cuda_kernels_per_layer_drop_with_the_switch(family):
    """The add kernel goes (and the norm's launch merges into it): at least one kernel fewer per layer. The next
    GPU session reads both counts from the log."""
    from kvroll.bench.kernel_count import step_kernel_counts
    from tests.conftest import tiny_model

    counts = {}
    for on in (False, True):
        model = tiny_model(family, layers=3).to("cuda", torch.bfloat16)
        engine = RolloutEngine(model, compression=CompressionConfig("longflow", budget=32), max_batch=4,
                               fused_add_norm=on)
        counts[on] = step_kernel_counts(engine, SamplingParams(temperature=1.0), batch=4)["kernels_per_layer"]
    print(family, "kernels per layer, fused_add_norm off/on:", counts[False], counts[True])
    assert counts[True] <= counts[False] - 1

