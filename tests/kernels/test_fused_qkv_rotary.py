"""The fused attention prologue (one QKV matmul, one ``rotary`` kernel holding Qwen3's norms): its install, the weight
views that keep in-place weight updates working, HF's forward kept for prefill, grad and CPU inputs, and the engine
switch's greedy tokens and kernel calls. What the three fusion switches do alike (off by default, sliding window,
load_weights, switches together) is tested in test_fusion_switches.py.

CPU (CI): ``fused_qkv_rotary.kernel_on_cpu`` widens the decode path to CPU tensors; the kernels run under
``TRITON_INTERPRET=1``. GPU (``gpu``): the same on CUDA, where the path is taken for no-grad decode steps by itself.
"""
import copy
import os

import pytest
import torch

from kvroll import CompressionConfig, RolloutEngine, SamplingParams
from kvroll.kernels import fused_qkv_rotary as fqr, rotary
from tests.conftest import tiny_model
from tests.kernels.conftest import ALL_OFF, FAMILIES, GREEDY, PROMPTS, assert_same_greedy, generate, model_of

triton_ok = rotary.triton is not None and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")
needs_triton = pytest.mark.skipif(not triton_ok, reason="needs Triton on a GPU or TRITON_INTERPRET=1")
FUSION = "fused_qkv_rotary"  # the switch of kernel_on_cpu (tests/kernels/conftest.py)


def attentions(model):
    return [layer.self_attn for layer in model.model.layers]


def joined(module):
    return getattr(module, fqr._FUSED)


@pytest.mark.parametrize("family", FAMILIES)
def test_install_joins_qkv_and_keeps_parameters(family):
    model, reference = model_of(family), model_of(family)
    names = [(n, p.shape) for n, p in model.named_parameters()]
    params = dict(model.named_parameters())
    if rotary.triton is None:
        assert fqr.install_fused_qkv_rotary(model) == 0
        return
    assert fqr.install_fused_qkv_rotary(model) == 2
    assert fqr.install_fused_qkv_rotary(model) == 0  # idempotent
    assert [(n, p.shape) for n, p in model.named_parameters()] == names  # HF's names, each weight once
    assert all(p is params[n] for n, p in model.named_parameters())  # the same Parameter objects
    assert set(model.state_dict()) == set(reference.state_dict())
    for attn, ref in zip(attentions(model), attentions(reference)):
        assert type(attn).__bases__ == (type(ref),) and type(attn).__name__ == "Fused" + type(ref).__name__
        weight, bias = joined(attn)
        assert weight.shape == ((4 + 2 * 2) * 16, 64)
        assert torch.equal(weight, torch.cat([ref.q_proj.weight, ref.k_proj.weight, ref.v_proj.weight]))
        assert (bias is not None) == (family == "qwen2")
        if bias is not None:
            assert torch.equal(bias, torch.cat([ref.q_proj.bias, ref.k_proj.bias, ref.v_proj.bias]))
        assert fqr._views_intact(attn, weight, bias)
        assert all(getattr(attn, n).weight.requires_grad for n in fqr._PROJECTIONS)


@needs_triton
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_prefill_grad_and_cpu_inputs_run_hf_forward_bitwise(family, kernel_on_cpu):
    """Without an engine decode step (a plain forward, with or without grad) the module is HF's, bit for bit."""
    model, reference = model_of(family), model_of(family)
    fqr.install_fused_qkv_rotary(model)
    ids = torch.tensor([[3, 17, 42, 5]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
    out, ref = model(ids).logits, reference(ids).logits  # grad enabled
    assert torch.equal(out, ref) and not kernel_on_cpu
    out.square().sum().backward()
    ref.square().sum().backward()
    for attn, ref_attn in zip(attentions(model), attentions(reference)):
        for name in fqr._PROJECTIONS:
            grad, ref_grad = getattr(attn, name).weight.grad, getattr(ref_attn, name).weight.grad
            assert grad is not None and grad.abs().sum() > 0 and torch.equal(grad, ref_grad)


@needs_triton
@pytest.mark.parametrize("policy", [CompressionConfig("full"), CompressionConfig("longflow", budget=12)])
@pytest.mark.parametrize("family", FAMILIES)
def test_engine_greedy_tokens_unchanged_by_the_switch(family, policy, kernel_on_cpu):
    _, off = generate(model_of(family), policy)
    engine, on = generate(model_of(family), policy, fused_qkv_rotary=True)
    assert engine.fused_qkv_rotary and all(type(m).__name__.startswith("Fused") for m in attentions(engine.model))
    steps = engine.stats["decode_steps"]
    assert steps >= 11 and len(kernel_on_cpu) == 2 * steps  # every decode step, both layers; no prefill
    assert all(shape[1:] == (1, 4, 16) for shape, _ in kernel_on_cpu)  # [slots, 1, Hq, D]
    # Qwen3's q_norm / k_norm run inside the rotary kernel (no separate norm launch); no other family has them
    norms = ("k_norm", "q_norm") if family == "qwen3" else ()
    assert all(given == norms for _, given in kernel_on_cpu)
    assert_same_greedy(on, off)


@needs_triton
def test_copy_into_a_parameter_updates_the_joined_weight(kernel_on_cpu):
    """The weight sync's ``param.copy_`` (and ``load_weights``) write through the views into the joined weight."""
    model, reference = model_of("qwen2"), model_of("qwen2")
    fqr.install_fused_qkv_rotary(model)
    attn, ref = attentions(model)[0], attentions(reference)[0]
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for proj in fqr._PROJECTIONS:
            for kind in ("weight", "bias"):
                new = torch.randn(getattr(getattr(ref, proj), kind).shape, generator=gen)
                getattr(getattr(attn, proj), kind).copy_(new)
                getattr(getattr(ref, proj), kind).copy_(new)
    weight, bias = joined(attn)
    assert torch.equal(weight, torch.cat([getattr(ref, p).weight for p in fqr._PROJECTIONS]))
    assert torch.equal(bias, torch.cat([getattr(ref, p).bias for p in fqr._PROJECTIONS]))
    assert fqr._views_intact(attn, weight, bias)


@needs_triton
def test_replaced_parameter_storage_falls_back_to_hf(kernel_on_cpu):
    """A parameter whose .data was replaced (e.g. ``.to()`` after the install) no longer lies in the joined weight:
    the engine must not read the stale joined copy."""
    model, reference = model_of("llama"), model_of("llama")
    fqr.install_fused_qkv_rotary(model)
    engine = RolloutEngine(model, max_batch=1)  # installed before: the engine's switch is not needed for this
    for attn, ref in zip(attentions(model), attentions(reference)):
        attn.v_proj.weight.data = attn.v_proj.weight.detach().clone() * 2
        with torch.no_grad():
            ref.v_proj.weight.mul_(2)
    assert not fqr._views_intact(attentions(model)[0], *joined(attentions(model)[0]))
    out = engine.generate(PROMPTS[:1], GREEDY)[0].token_ids
    assert out == RolloutEngine(reference, max_batch=1).generate(PROMPTS[:1], GREEDY)[0].token_ids
    assert not kernel_on_cpu


@needs_triton
def test_deepcopy_is_correct_but_unfused(kernel_on_cpu):
    """``copy.deepcopy`` copies each parameter's storage apart from the joined weight: the copy keeps the class and
    runs HF's forward (correct, not fused) rather than the stale copy of the joined weight."""
    model, reference = model_of("qwen3"), model_of("qwen3")
    fqr.install_fused_qkv_rotary(model)
    clone = copy.deepcopy(model)
    attn = attentions(clone)[1]
    assert type(attn) is type(attentions(model)[1])
    assert not fqr._views_intact(attn, *joined(attn))
    with torch.no_grad():
        attn.k_proj.weight.mul_(2)
        attentions(reference)[1].k_proj.weight.mul_(2)
    out = RolloutEngine(clone, max_batch=1).generate(PROMPTS[:1], GREEDY)[0].token_ids
    assert out == RolloutEngine(reference, max_batch=1).generate(PROMPTS[:1], GREEDY)[0].token_ids
    assert not kernel_on_cpu


@needs_triton
def test_bucket_plan_unpack_reaches_the_joined_weight(kernel_on_cpu):
    """The weight sync's own path (``BucketPlan`` pack on the trainer side, ``unpack`` into the engine's tensors)."""
    from kvroll.rollout.weights import BucketPlan

    engine = RolloutEngine(model_of("qwen2", seed=0), max_batch=1, fused_qkv_rotary=True)
    trainer = model_of("qwen2", seed=1)
    plan = BucketPlan.for_model(trainer, bucket_bytes=1 << 16)
    targets = dict(engine.model.named_parameters()) | dict(engine.model.named_buffers())
    for index in range(len(plan)):
        with plan.fetch(trainer, index) as tensors:
            buffer = plan.pack(index, tensors, plan.new_buffer(index, "cpu"))
        plan.unpack(index, buffer, targets)
    for attn, ref in zip(attentions(engine.model), attentions(trainer)):
        weight, bias = joined(attn)
        assert fqr._views_intact(attn, weight, bias)
        assert torch.equal(weight, torch.cat([getattr(ref, p).weight for p in fqr._PROJECTIONS]))
        assert torch.equal(bias, torch.cat([getattr(ref, p).bias for p in fqr._PROJECTIONS]))
    prompts = PROMPTS[:1]
    expected = RolloutEngine(model_of("qwen2", seed=1), max_batch=1).generate(prompts, GREEDY)[0].token_ids
    assert engine.generate(prompts, GREEDY)[0].token_ids == expected and kernel_on_cpu


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_engine_fp32_greedy_unchanged_and_weight_sync_after_capture(family):
    """fp32 on CUDA (cuBLAS without TF32): the switch leaves greedy tokens as they are, through CUDA graphs, and
    weights loaded after the capture reach the captured joined matmul."""
    off = RolloutEngine(model_of(family).cuda(), max_batch=2, **ALL_OFF).generate(PROMPTS, GREEDY)
    engine = RolloutEngine(model_of(family).cuda(), max_batch=2, **{**ALL_OFF, "fused_qkv_rotary": True})
    assert engine.cuda_graphs
    assert [r.token_ids for r in engine.generate(PROMPTS, GREEDY)] == [r.token_ids for r in off]
    engine.load_weights(model_of(family, seed=1).cuda().named_parameters())
    expected = RolloutEngine(model_of(family, seed=1).cuda(), max_batch=2, **ALL_OFF).generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in engine.generate(PROMPTS, GREEDY)] == [r.token_ids for r in expected]


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_cuda_bf16_both_switches_greedy_close_to_off(family):
    """bf16 on CUDA with both switches: the joined matmuls may round differently from HF's three / two, so tokens
    may part late in a random model; the first tokens and the logprobs of the agreeing prefix stay close."""
    off = RolloutEngine(model_of(family).to("cuda", torch.bfloat16), max_batch=2, **ALL_OFF).generate(PROMPTS, GREEDY)
    engine = RolloutEngine(model_of(family).to("cuda", torch.bfloat16), max_batch=2,
                           **{**ALL_OFF, "fused_mlp": True, "fused_qkv_rotary": True})
    on = engine.generate(PROMPTS, GREEDY)
    for a, b in zip(on, off):
        assert a.token_ids[:4] == b.token_ids[:4]
        torch.testing.assert_close(torch.tensor(a.logprobs[:4]), torch.tensor(b.logprobs[:4]), atol=5e-2, rtol=5e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_cuda_kernels_per_layer_drop_with_the_switch(family):
    """HF's prologue is 3 GEMMs + ~10 rotary kernels (Qwen3: + the q/k norms, one RMSNorm kernel each on the engine);
    fused it is 1 GEMM + 1 rotary kernel (Qwen3's norms inside it). The next GPU session reads both counts from the
    log."""
    from kvroll.bench.kernel_count import step_kernel_counts

    counts = {}
    for on in (False, True):
        model = tiny_model(family, layers=3).to("cuda", torch.bfloat16)
        engine = RolloutEngine(model, compression=CompressionConfig("longflow", budget=32), max_batch=4,
                               fused_qkv_rotary=on)
        counts[on] = step_kernel_counts(engine, SamplingParams(temperature=1.0), batch=4)["kernels_per_layer"]
    print(family, "kernels per layer, fused_qkv_rotary off/on:", counts[False], counts[True])
    assert counts[True] <= counts[False] - (8 if family == "qwen3" else 6)  # Qwen3: both norm launches go too


@needs_triton
@pytest.mark.parametrize("policy", [CompressionConfig("full"), CompressionConfig("longflow", budget=12),
                                    CompressionConfig("rkv", budget=16, buffer=8),
                                    CompressionConfig("snapkv", budget=16, buffer=8, window=8)])
def test_engine_rotary_and_cache_write_in_one_kernel(policy, kernel_on_cpu, monkeypatch):
    """With kvroll's cache kernels on (CPU under the interpreter here, as on CUDA), every decode step's rotary also
    writes the cache (``CompressedKVCache.rotary_write``) and, for R-KV and SnapKV, their query ring: the
    completions and the rings are those of the switch off, where HF's rotary, the cache write's own kernel and
    ``window.ring_write`` run, for an appending, an evicting and two periodic policies."""
    from kvroll.policies import window
    from kvroll.rollout.cache import CompressedKVCache

    monkeypatch.setattr(CompressedKVCache, "kernel_on_cpu", True)
    fused_writes, write = [], CompressedKVCache.rotary_write
    ring_writes, ring_write = [], window.ring_write

    def recorded(self, *args, **kwargs):
        out = write(self, *args, **kwargs)
        fused_writes.append(out is not None)
        return out

    def recorded_ring(cache, layer, q):
        ring_writes.append(layer)
        return ring_write(cache, layer, q)

    monkeypatch.setattr(CompressedKVCache, "rotary_write", recorded)
    monkeypatch.setattr(window, "ring_write", recorded_ring)
    engine_off, off = generate(model_of("qwen3"), policy, fused_qkv_rotary=False)
    assert not fused_writes
    rings = policy.policy in ("rkv", "snapkv")
    steps_off = engine_off.stats["decode_steps"]
    assert len(ring_writes) == (2 * steps_off if rings else 0)  # both layers, every step, by ring_write
    ring_writes.clear()
    engine, on = generate(model_of("qwen3"), policy, fused_qkv_rotary=True)
    steps = engine.stats["decode_steps"]
    assert steps >= 11 and fused_writes == [True] * 2 * steps and not kernel_on_cpu  # both layers, every step
    assert not ring_writes  # the rotary kernel stored every decode query in the ring
    assert_same_greedy(on, off)
    if rings:  # the same window of queries (Qwen3's q_norm folded into the rotary: a few fp32 ulps, module doc)
        torch.testing.assert_close(engine.cache.state["queries"], engine_off.cache.state["queries"], rtol=1e-5,
                                   atol=1e-5)
