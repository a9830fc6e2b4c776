"""Split-K projections (``kvroll/kernels/split_k.py``): the K slices' fp32 partial products against the whole
product, ``add_rms_norm`` summing them (rounded once, then HF's add and norm) against its torch reference, the rule,
the refusals, and the engine's greedy tokens with the decoder layer asking the fused attention and MLP for them.

CPU (CI): the kernel under ``TRITON_INTERPRET=1`` in fp32 and fp16; the engine on tiny models with the slices'
minimum K lowered so that their projections split. GPU (``gpu``): bf16, and the engine in bf16 / fp32.
"""
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvroll import CompressionConfig, RolloutEngine, SamplingParams
from kvroll.kernels import add_rms_norm as arn
from kvroll.kernels import fused_add_norm as fan
from kvroll.kernels import split_k
from tests.conftest import needs_interpreter
from tests.kernels.conftest import ALL_OFF, FAMILIES, PROMPTS, assert_same_greedy, generate, model_of, \
    record_kernel_on_cpu

triton_ok = arn.triton is not None and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")
needs_triton = pytest.mark.skipif(not triton_ok, reason="needs Triton on a GPU or TRITON_INTERPRET=1")
# CPU tensors into the kernel: the interpreter only (on a GPU machine without it they would reach a compiled kernel)
FUSIONS = ("fused_mlp", "fused_qkv_rotary", "fused_add_norm")


@pytest.mark.parametrize("parts", [1, 2, 3, 4])
@pytest.mark.parametrize("leading", [(1,), (5, 1), (2, 3)])
def test_linear_parts_sum_to_the_product(parts, leading):
    gen = torch.Generator().manual_seed(parts)
    x = torch.randn(*leading, 96, generator=gen)
    weight = torch.randn(33, 96, generator=gen)
    out = split_k.linear_parts(x, weight, parts)
    assert out.shape == (parts, *leading, 33) and out.dtype == torch.float32
    torch.testing.assert_close(out.sum(0), F.linear(x, weight), rtol=1e-5, atol=1e-4)
    for p in range(parts):  # each part is its slice's product
        sl = slice(p * 96 // parts, (p + 1) * 96 // parts)
        torch.testing.assert_close(out[p], F.linear(x[..., sl], weight[:, sl]), rtol=1e-5, atol=1e-4)


def test_linear_parts_refuses_a_k_that_does_not_split():
    with pytest.raises(AssertionError):
        split_k.linear_parts(torch.randn(2, 10), torch.randn(4, 10), 3)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("parts", [1, 2, 3, 4])
@pytest.mark.parametrize("hidden", [7, 100, 257])
def test_add_rms_norm_sums_the_parts_once_rounded(dtype, parts, hidden):
    """The partials added in order in fp32, rounded once to the residual's dtype (the projection's output), then
    the add and norm as without them: the sum bit for bit the reference's, the norm as the plain kernel's."""
    gen = torch.Generator().manual_seed(hidden + parts)
    partial = torch.randn(parts, 3, 1, hidden, generator=gen) * 2
    residual = (torch.randn(3, 1, hidden, generator=gen) * 4).to(dtype)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    summed, normed = arn.add_rms_norm(partial, residual, weight, 1e-6)
    ref_sum, ref_norm = arn.add_rms_norm_torch(partial, residual, weight, 1e-6)
    x = arn.sum_parts(partial, dtype)
    in_order = partial[0]
    for p in range(1, parts):
        in_order = in_order + partial[p]
    assert torch.equal(x, in_order.to(dtype))  # in order, in fp32, one rounding
    plain_sum, plain_norm = arn.add_rms_norm(x, residual, weight, 1e-6)
    assert summed.dtype == normed.dtype == dtype and summed.shape == residual.shape
    assert torch.equal(summed, ref_sum) and torch.equal(summed, plain_sum)
    assert torch.equal(normed, plain_norm)  # the same kernel's norm of the same rounded sum
    torch.testing.assert_close(normed.float(), ref_norm.float(), rtol=2e-3 if dtype == torch.float16 else 1e-5,
                               atol=1e-5)


@needs_triton
def test_add_rms_norm_refuses_parts_it_cannot_read():
    residual, weight = torch.randn(3, 1, 16), torch.ones(16)
    with pytest.raises(AssertionError, match="split-K partials"):
        arn.add_rms_norm(torch.randn(5, 3, 1, 16), residual, weight, 1e-6)  # more than 4 parts
    with pytest.raises(AssertionError, match="split-K partials"):
        arn.add_rms_norm(torch.randn(2, 3, 1, 16).half(), residual, weight, 1e-6)  # not fp32


def test_the_rule_splits_what_the_sweep_measured_faster(monkeypatch):
    """2 slices for down at 1-128 rows; o at 1-128 rows up to 2,560 outputs, at 1-16 rows of wider ones (the H100
    measurements); never qkv or gate_up, a K that does not halve, or slices under 1,024; off with SPLIT_K."""
    parts = split_k.split_k_parts
    assert [parts(r, 2048, 6144, "down") for r in (1, 64, 128, 129, 256)] == [2, 2, 2, 1, 1]
    assert [parts(r, 4096, 14336, "down") for r in (1, 128, 256)] == [2, 2, 1]
    assert [parts(r, 2048, 2048, "o") for r in (1, 128, 129)] == [2, 2, 1]
    assert [parts(r, 2560, 4096, "o") for r in (16, 128, 129)] == [2, 2, 1]
    assert [parts(r, 4096, 4096, "o") for r in (1, 16, 17, 64)] == [2, 2, 1, 1]
    assert parts(64, 4096, 2048, "qkv") == 1 and parts(64, 12288, 2048, "gate_up") == 1
    assert parts(64, 896, 1791, "down") == 1 and parts(64, 896, 1792, "o") == 1  # odd K; slices of 896
    monkeypatch.setattr(split_k, "SUPPORTED", False)  # a torch without bmm(out_dtype=), or ROCm
    assert parts(64, 2048, 6144, "down") == 1
    monkeypatch.setattr(split_k, "SUPPORTED", True)
    monkeypatch.setattr(split_k, "SPLIT_K", False)
    assert parts(64, 2048, 6144, "down") == 1


def test_plain_linear_takes_only_a_bias_free_hookless_linear():
    lin = nn.Linear(8, 4, bias=False)
    assert split_k.plain_linear(lin) is lin.weight
    assert split_k.plain_linear(nn.Linear(8, 4)) is None  # a bias
    hooked = nn.Linear(8, 4, bias=False)
    hooked.register_forward_hook(lambda *a: None)
    assert split_k.plain_linear(hooked) is None
    pre = nn.Linear(8, 4, bias=False)
    pre.register_forward_pre_hook(lambda *a: None)
    assert split_k.plain_linear(pre) is None

    class LoRA(nn.Linear):
        pass
    assert split_k.plain_linear(LoRA(8, 4, bias=False)) is None
    assert split_k.plain_linear(nn.Identity()) is None


needs_split = pytest.mark.skipif(not split_k.SUPPORTED, reason="torch without bmm(out_dtype=) (< 2.8) or ROCm")


@needs_triton
@needs_split
@pytest.mark.parametrize("policy", [CompressionConfig("full"), CompressionConfig("longflow", budget=12)])
@pytest.mark.parametrize("family", FAMILIES)
def test_engine_greedy_with_split_projections_equals_without(family, policy, monkeypatch):
    """All three module fusions on CPU, the slices' minimum K lowered to the tiny models' (64 / 128): every
    layer's o and every layer's but the last's down projection arrive at add_rms_norm as 2 partials, and the greedy
    tokens and logprobs are those of the whole projections (SPLIT_K off) and of HF's modules."""
    calls = {fusion: record_kernel_on_cpu(monkeypatch, fusion) for fusion in FUSIONS}
    seen = []
    kernel = fan.add_rms_norm  # the recorder's

    def recorded(x, residual, weight, eps, **launch):  # launch: pdl (kvroll.kernels.pdl_gemm)
        seen.append(x.dim() - residual.dim())
        return kernel(x, residual, weight, eps, **launch)
    monkeypatch.setattr(fan, "add_rms_norm", recorded)
    monkeypatch.setattr(split_k, "MIN_K", 16)
    _, off = generate(model_of(family), policy, **dict.fromkeys(FUSIONS, False))
    engine, on = generate(model_of(family), policy, **dict.fromkeys(FUSIONS, True))
    assert all(calls.values())
    steps = engine.stats["decode_steps"]
    assert seen.count(1) == 3 * steps and seen.count(0) == 0  # 2 layers: o, o, and layer 0's down
    assert_same_greedy(on, off)
    seen.clear()
    monkeypatch.setattr(split_k, "SPLIT_K", False)
    _, whole = generate(model_of(family), policy, **dict.fromkeys(FUSIONS, True))
    assert seen and seen.count(1) == 0
    assert_same_greedy(on, whole)


def _split_calls(monkeypatch):
    """Every fused path on CPU, the slices' minimum K lowered to the tiny models'; returns the list of
    ``x.dim() - residual.dim()`` of each ``add_rms_norm`` call of the decoder layers (1: partials)."""
    for fusion in FUSIONS:
        record_kernel_on_cpu(monkeypatch, fusion)
    monkeypatch.setattr(split_k, "MIN_K", 16)
    seen, kernel = [], fan.add_rms_norm

    def recorded(x, residual, weight, eps, **launch):  # launch: pdl (kvroll.kernels.pdl_gemm)
        seen.append(x.dim() - residual.dim())
        return kernel(x, residual, weight, eps, **launch)
    monkeypatch.setattr(fan, "add_rms_norm", recorded)
    return seen


@needs_triton
@needs_split
def test_a_hooked_mlp_or_attention_returns_whole_outputs(monkeypatch):
    """A forward hook on layer 0's MLP and on its attention: both see [slots, 1, H] outputs, never partials (those
    projections stay whole; the hook-free layer 1 still splits its o), and the tokens are unchanged."""
    seen = _split_calls(monkeypatch)
    model = model_of("llama")
    shapes = []
    model.model.layers[0].mlp.register_forward_hook(lambda mod, args, out: shapes.append(tuple(out.shape)))
    model.model.layers[0].self_attn.register_forward_hook(lambda mod, args, out: shapes.append(tuple(out[0].shape)))
    _, off = generate(model_of("llama"), CompressionConfig("full"), **dict.fromkeys(FUSIONS, False))
    engine, on = generate(model, CompressionConfig("full"), **dict.fromkeys(FUSIONS, True))
    steps = engine.stats["decode_steps"]
    assert len(shapes) >= 2 * steps and all(len(shape) == 3 for shape in shapes)
    assert seen.count(1) == steps  # layer 1's o only (its down is the last layer's: whole)
    assert_same_greedy(on, off)


@needs_triton
@needs_split
def test_a_hooked_biased_or_transposed_projection_stays_whole(monkeypatch):
    """A forward hook on o_proj (it runs at every step), a bias on a down_proj, a down_proj weight stored
    column-major (a transposed view): each of those runs whole through its own forward, and the tokens are those of
    the same model with no split."""
    seen = _split_calls(monkeypatch)
    for change in ("hook", "bias", "transposed"):
        models = []
        for _ in range(2):
            model = model_of("qwen3")
            layer = model.model.layers[0]
            if change == "hook":
                ran = []
                layer.self_attn.o_proj.register_forward_hook(lambda *a: ran.append(1))
            elif change == "bias":
                layer.mlp.down_proj.bias = nn.Parameter(torch.randn(64) * 0.1)
            else:
                w = layer.mlp.down_proj.weight.detach()
                layer.mlp.down_proj.weight = nn.Parameter(w.t().contiguous().t())
                assert layer.mlp.down_proj.weight.stride(0) == 1
            models.append(model)
        seen.clear()
        engine, on = generate(models[0], CompressionConfig("full"), **dict.fromkeys(FUSIONS, True))
        steps = engine.stats["decode_steps"]
        # 2 layers: o of layer 0 and 1, down of layer 0 (layer 1 is the last): 3 splits a step less the changed one
        assert seen.count(1) == 2 * steps, change
        if change == "hook":
            assert len(ran) >= steps
        monkeypatch.setattr(split_k, "SPLIT_K", False)
        _, whole = generate(models[1], CompressionConfig("full"), **dict.fromkeys(FUSIONS, True))
        monkeypatch.setattr(split_k, "SPLIT_K", True)
        assert_same_greedy(on, whole)


def test_plain_linear_refuses_a_column_major_weight():
    lin = nn.Linear(8, 4, bias=False)
    lin.weight = nn.Parameter(lin.weight.detach().t().contiguous().t())
    assert split_k.plain_linear(lin) is None
    lin.weight = nn.Parameter(lin.weight.detach().contiguous())
    assert split_k.plain_linear(lin) is lin.weight


@pytest.mark.gpu
def test_cuda_linear_parts_and_their_sum_in_bf16():
    gen = torch.Generator(device="cuda").manual_seed(0)
    for rows in (1, 7, 64):
        x = torch.randn(rows, 1, 2048, device="cuda", generator=gen).bfloat16()
        weight = (torch.randn(512, 2048, device="cuda", generator=gen) * 0.02).bfloat16()
        partial = split_k.linear_parts(x, weight, 2)
        assert partial.dtype == torch.float32 and partial.shape == (2, rows, 1, 512)
        ref = x.double() @ weight.double().T
        got = arn.sum_parts(partial, torch.bfloat16)
        whole = F.linear(x, weight)
        # the split's rounded output is as close to the exact product as cuBLAS's whole one, up to a rounding
        err, err_whole = (got.double() - ref).abs().max(), (whole.double() - ref).abs().max()
        assert err <= 2 * err_whole + 1e-6, (err, err_whole)
        residual = torch.randn(rows, 1, 512, device="cuda", generator=gen).bfloat16()
        w = torch.rand(512, device="cuda", generator=gen).bfloat16() + 0.5
        summed, normed = arn.add_rms_norm(partial, residual, w, 1e-6)
        plain_sum, plain_norm = arn.add_rms_norm(got, residual, w, 1e-6)
        assert torch.equal(summed, plain_sum) and torch.equal(normed, plain_norm)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_cuda_engine_split_projections(family, monkeypatch):
    """On CUDA with graphs, in bf16 and fp16 (an fp32 model keeps whole projections): the decoder layers get
    partials at every decode step, and the greedy run's logprobs stay within a rounding's reach of the whole
    projections' (a split's sum rounds like another cuBLAS algorithm) until near-ties of the tiny random models."""
    monkeypatch.setattr(split_k, "MIN_K", 16)
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    seen, kernel = [], fan.add_rms_norm

    def recorded(x, residual, weight, eps, **launch):  # launch: pdl=True in the chain (kvroll.kernels.pdl_gemm)
        seen.append(x.dim() - residual.dim())
        return kernel(x, residual, weight, eps, **launch)
    monkeypatch.setattr(fan, "add_rms_norm", recorded)
    for dtype in (torch.bfloat16, torch.float16):
        runs = {}
        for on in (True, False):
            monkeypatch.setattr(split_k, "SPLIT_K", on)
            seen.clear()
            engine = RolloutEngine(model_of(family).to("cuda", dtype), max_batch=2,
                                   **{**ALL_OFF, **dict.fromkeys(FUSIONS, True)})
            assert engine.cuda_graphs
            runs[on] = engine.generate(PROMPTS, params)
            assert (seen.count(1) > 0) == on  # partials reach add_rms_norm (calls seen while graphs are captured)
        for a, b in zip(runs[True], runs[False]):
            n = next((i for i, (s, t) in enumerate(zip(a.token_ids, b.token_ids)) if s != t), len(a.token_ids))
            assert n >= 4, (dtype, a.token_ids, b.token_ids)  # tiny random models: near-ties may flip late
            torch.testing.assert_close(torch.tensor(a.logprobs[:n]), torch.tensor(b.logprobs[:n]), atol=0.05,
                                       rtol=0.05)
