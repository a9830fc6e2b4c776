"""The fused gated MLP (one gate+up matmul + ``silu_mul``): its install, the weight views that keep in-place weight
updates working, HF's forward kept for grad and CPU inputs, and the engine switch's greedy tokens and kernel calls.
What the three fusion switches do alike (off by default, sliding window, load_weights, switches together) is tested in
test_fusion_switches.py.

CPU (CI): ``fused_mlp.kernel_on_cpu`` widens the fused path to CPU tensors; the kernel runs under
``TRITON_INTERPRET=1``. GPU (``gpu``): the same on CUDA, where the path is taken for no-grad inputs by itself.
"""
import copy
import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvroll import CompressionConfig, RolloutEngine
from kvroll.kernels import fused_mlp, silu_mul
from tests.conftest import tiny_model
from tests.kernels.conftest import ALL_OFF, GREEDY, assert_same_greedy, generate

triton_ok = silu_mul.triton is not None and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")
needs_triton = pytest.mark.skipif(not triton_ok, reason="needs Triton on a GPU or TRITON_INTERPRET=1")
FUSION = "fused_mlp"  # the switch of kernel_on_cpu (tests/kernels/conftest.py)


def mlps(model):
    return [layer.mlp for layer in model.model.layers]


def biased_llama(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=100, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, mlp_bias=True, pad_token_id=0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for mlp in mlps(model):
            mlp.gate_proj.bias.normal_()
            mlp.up_proj.bias.normal_()
    return model


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_install_joins_gate_and_up_and_keeps_parameters(family):
    model, reference = tiny_model(family), tiny_model(family)
    names = [(n, p.shape) for n, p in model.named_parameters()]
    params = dict(model.named_parameters())
    if silu_mul.triton is None:
        assert fused_mlp.install_fused_mlp(model) == 0
        return
    assert fused_mlp.install_fused_mlp(model) == 2
    assert fused_mlp.install_fused_mlp(model) == 0  # idempotent
    assert [(n, p.shape) for n, p in model.named_parameters()] == names  # HF's names, each weight once
    assert all(p is params[n] for n, p in model.named_parameters())  # the same Parameter objects
    assert set(model.state_dict()) == set(reference.state_dict())
    for mlp, ref in zip(mlps(model), mlps(reference)):
        assert type(mlp).__bases__ == (type(ref),) and type(ref).forward is not fused_mlp._fused_forward
        weight, bias = getattr(mlp, fused_mlp._FUSED)
        assert bias is None and weight.shape == (2 * 128, 64)
        assert torch.equal(weight, torch.cat([ref.gate_proj.weight, ref.up_proj.weight]))
        assert fused_mlp._views_intact(mlp, weight, bias)
        assert mlp.gate_proj.weight.requires_grad and mlp.up_proj.weight.requires_grad


def test_grad_and_cpu_inputs_run_hf_forward_bitwise(monkeypatch):
    calls = []
    monkeypatch.setattr(fused_mlp, "silu_mul", lambda gate_up: calls.append(1))
    model, reference = tiny_model("llama"), tiny_model("llama")
    fused_mlp.install_fused_mlp(model)
    ids = torch.tensor([[3, 17, 42, 5]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)  # CPU input: HF's forward
    out, ref = model(ids).logits, reference(ids).logits  # grad enabled
    assert torch.equal(out, ref) and not calls
    out.square().sum().backward()
    ref.square().sum().backward()
    for mlp, ref_mlp in zip(mlps(model), mlps(reference)):
        for name in ("gate_proj", "up_proj"):
            grad, ref_grad = getattr(mlp, name).weight.grad, getattr(ref_mlp, name).weight.grad
            assert grad is not None and grad.abs().sum() > 0 and torch.equal(grad, ref_grad)


@needs_triton
@pytest.mark.parametrize("family", ["llama", "qwen3", "llama_bias"])
def test_fused_path_matches_hf_under_no_grad(family, kernel_on_cpu):
    build = biased_llama if family == "llama_bias" else lambda: tiny_model(family)
    model, reference = build(), build()
    fused_mlp.install_fused_mlp(model)
    ids = torch.tensor([[3, 17, 42]])
    with torch.no_grad():
        out, ref = model(ids).logits, reference(ids).logits
    width = model.config.intermediate_size
    assert kernel_on_cpu == [(1, 3, 2 * width)] * 2  # one call per layer on the joined [gate | up] row
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)  # fp32: GEMM order and exp only


@needs_triton
def test_copy_into_a_parameter_updates_the_fused_weight(kernel_on_cpu):
    """The weight sync's ``param.copy_`` (and ``load_weights``) write through the views into the fused weight."""
    model, reference = biased_llama(), biased_llama()
    fused_mlp.install_fused_mlp(model)
    x = torch.randn(2, 1, 64, generator=torch.Generator().manual_seed(4))
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name in ("gate_proj.weight", "up_proj.weight", "gate_proj.bias", "up_proj.bias"):
            new = torch.randn(reference.model.layers[0].mlp.get_parameter(name).shape, generator=gen)
            model.model.layers[0].mlp.get_parameter(name).copy_(new)
            reference.model.layers[0].mlp.get_parameter(name).copy_(new)
        mlp, ref = model.model.layers[0].mlp, reference.model.layers[0].mlp
        weight, bias = getattr(mlp, fused_mlp._FUSED)
        assert torch.equal(weight, torch.cat([ref.gate_proj.weight, ref.up_proj.weight]))
        assert torch.equal(bias, torch.cat([ref.gate_proj.bias, ref.up_proj.bias]))
        torch.testing.assert_close(mlp(x), ref(x), atol=1e-5, rtol=1e-4)
    assert len(kernel_on_cpu) == 1


@needs_triton
def test_replaced_parameter_storage_falls_back_to_hf(kernel_on_cpu):
    """A parameter whose .data was replaced (e.g. ``.to()`` after the install) no longer lies in the fused weight:
    the module must not read the stale fused copy."""
    model, reference = tiny_model("llama"), tiny_model("llama")
    fused_mlp.install_fused_mlp(model)
    mlp, ref = model.model.layers[0].mlp, reference.model.layers[0].mlp
    new = torch.randn_like(ref.up_proj.weight)
    with torch.no_grad():
        mlp.up_proj.weight.data = new.clone()
        ref.up_proj.weight.copy_(new)
        x = torch.randn(3, 1, 64)
        assert torch.equal(mlp(x), ref(x)) and not kernel_on_cpu


@needs_triton
def test_deepcopy_is_correct_but_unfused(kernel_on_cpu):
    """``copy.deepcopy`` copies each parameter's storage apart from the fused weight: the copy keeps the class and
    runs HF's forward (correct, not fused) rather than the stale copy of the fused weight."""
    model, reference = tiny_model("qwen3"), tiny_model("qwen3")
    fused_mlp.install_fused_mlp(model)
    clone = copy.deepcopy(model)
    mlp = clone.model.layers[1].mlp
    assert type(mlp) is type(model.model.layers[1].mlp)
    assert not fused_mlp._views_intact(mlp, *getattr(mlp, fused_mlp._FUSED))
    with torch.no_grad():
        mlp.gate_proj.weight.mul_(2)
        reference.model.layers[1].mlp.gate_proj.weight.mul_(2)
        x = torch.randn(2, 1, 64)
        assert torch.equal(mlp(x), reference.model.layers[1].mlp(x)) and not kernel_on_cpu


@needs_triton
@pytest.mark.parametrize("policy", [CompressionConfig("full"), CompressionConfig("longflow", budget=12)])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_engine_greedy_tokens_unchanged_by_the_switch(family, policy, kernel_on_cpu):
    _, off = generate(tiny_model(family), policy)
    engine, on = generate(tiny_model(family), policy, fused_mlp=True)
    assert engine.fused_mlp and all(type(m).__name__.startswith("Fused") for m in mlps(engine.model))
    # the two prompts' one batched prefill forward, then every decode step, both layers
    assert engine.stats["decode_steps"] >= 11 and len(kernel_on_cpu) == 2 * (1 + engine.stats["decode_steps"])
    assert kernel_on_cpu[0][0] == 2  # the prefill's rows: both prompts
    assert_same_greedy(on, off)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_cuda_engine_fp32_greedy_unchanged_and_weight_sync_after_capture(family):
    """fp32 on CUDA (cuBLAS without TF32): the switch leaves greedy tokens as they are, through CUDA graphs, and
    weights loaded after the capture reach the captured fused matmul."""
    prompts = [[5, 9, 33, 7, 81], [2, 200, 14]]
    off = RolloutEngine(tiny_model(family).cuda(), max_batch=2, **ALL_OFF).generate(prompts, GREEDY)
    engine = RolloutEngine(tiny_model(family).cuda(), max_batch=2, **{**ALL_OFF, "fused_mlp": True})
    assert engine.cuda_graphs
    assert [r.token_ids for r in engine.generate(prompts, GREEDY)] == [r.token_ids for r in off]
    engine.load_weights(tiny_model(family, seed=1).cuda().named_parameters())
    expected = RolloutEngine(tiny_model(family, seed=1).cuda(), max_batch=2, **ALL_OFF).generate(prompts, GREEDY)
    assert [r.token_ids for r in engine.generate(prompts, GREEDY)] == [r.token_ids for r in expected]


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 64])
def test_cuda_bf16_mlp_within_a_rounding_of_hf(rows):
    model, reference = tiny_model("qwen3"), tiny_model("qwen3")
    model, reference = model.to("cuda", torch.bfloat16), reference.to("cuda", torch.bfloat16)
    fused_mlp.install_fused_mlp(model)
    x = torch.randn(rows, 1, 64, device="cuda").bfloat16()
    with torch.no_grad():
        out, ref = model.model.layers[0].mlp(x), reference.model.layers[0].mlp(x)
        exact = reference.model.layers[0].mlp.float()(x.float())
    assert out.dtype == torch.bfloat16
    # bf16: each of the three roundings (gate_up, activation, product) may differ by one ulp from HF's
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    assert (out.float() - exact).abs().max() <= 2 * (ref.float() - exact).abs().max() + 1e-2


@needs_triton
def test_bucket_plan_unpack_reaches_the_fused_weight(kernel_on_cpu):
    """The weight sync's own path (``BucketPlan`` pack on the trainer side, ``unpack`` into the engine's tensors)."""
    from kvroll.rollout.weights import BucketPlan

    engine = RolloutEngine(tiny_model("llama", seed=0), max_batch=1, fused_mlp=True)
    trainer = tiny_model("llama", seed=1)
    plan = BucketPlan.for_model(trainer, bucket_bytes=1 << 16)
    targets = dict(engine.model.named_parameters()) | dict(engine.model.named_buffers())
    for index in range(len(plan)):
        with plan.fetch(trainer, index) as tensors:
            buffer = plan.pack(index, tensors, plan.new_buffer(index, "cpu"))
        plan.unpack(index, buffer, targets)
    for mlp, ref in zip(mlps(engine.model), mlps(trainer)):
        weight, _ = getattr(mlp, fused_mlp._FUSED)
        assert fused_mlp._views_intact(mlp, weight, None)
        assert torch.equal(weight, torch.cat([ref.gate_proj.weight, ref.up_proj.weight]))
    prompts = [[5, 9, 33, 7, 81]]
    expected = RolloutEngine(tiny_model("llama", seed=1), max_batch=1).generate(prompts, GREEDY)[0].token_ids
    assert engine.generate(prompts, GREEDY)[0].token_ids == expected and kernel_on_cpu
