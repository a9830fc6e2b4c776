"""The fused RMSNorm against the fp32 reference and HF's own modules, and its install on a model.

CPU (CI): the Triton kernel runs under ``TRITON_INTERPRET=1``. fp32 inputs are compared with a tolerance (only
the order of the sum of squares differs); fp16 inputs check HF's rounding order exactly (the interpreter's
fp16 is NumPy's, round-to-nearest-even; its bf16 casts are not). GPU (``gpu``): the same exact check in bf16.
"""
import copy

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from kvroll.kernels import rmsnorm
from tests.conftest import freed_without_gc, needs_interpreter, tiny_model


HIDDEN = [64, 128, 576, 2048]  # 576: SmolLM2's hidden size, not a power of two
LEADING = [(5,), (2, 3), (3, 1, 4)]  # rows; [B, S]; q_norm/k_norm's [B, S=1, H] (per-head norm of [B, 1, H, D])


def hf_norm(cls, hidden, eps, seed, dtype=torch.float32, device="cpu"):
    """An HF RMSNorm module with a random weight."""
    norm = cls(hidden, eps=eps)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(hidden, generator=torch.Generator().manual_seed(seed)) * 2 - 0.5)
    return norm.to(device=device, dtype=dtype)


def assert_one_rounding_apart(out, expected, x, weight, eps):
    """``out`` is HF's output ``expected``, or HF's with its normalised value (rounded to x's dtype) moved by one
    ulp: the only rounding the kernel may take differently. Most elements must be bitwise equal."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    bits = normed.view(torch.int16)  # adjacent values of a same-signed float are adjacent integers
    candidates = [weight * (bits + step).view(x.dtype) for step in (-1, 0, 1)]
    assert torch.equal(candidates[1], expected)  # this is HF's math
    ok = (out == candidates[0]) | (out == candidates[1]) | (out == candidates[2])
    assert ok.all(), (out[~ok], candidates[1][~ok])
    assert (out == candidates[1]).float().mean() > 0.999


@needs_interpreter
@pytest.mark.parametrize("leading", LEADING)
@pytest.mark.parametrize("hidden", HIDDEN)
def test_fp32_matches_reference_and_hf_module(hidden, leading):
    seed = hidden + len(leading)
    cls = Qwen3RMSNorm if hidden % 128 else LlamaRMSNorm
    norm = hf_norm(cls, hidden, 1e-6, seed)
    x = torch.randn(*leading, hidden, generator=torch.Generator().manual_seed(seed)) * 3
    out = rmsnorm.rms_norm(x, norm.weight.detach(), norm.variance_epsilon)
    assert out.shape == x.shape and out.dtype == torch.float32
    # fp32: the sum of squares in another order moves the result by a few fp32 ulps
    torch.testing.assert_close(out, rmsnorm.rms_norm_torch(x, norm.weight.detach(), 1e-6), atol=1e-6, rtol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(out, norm(x), atol=1e-6, rtol=1e-5)


@needs_interpreter
@pytest.mark.parametrize("eps", [1e-6, 1e-5])
def test_eps_counts_on_small_inputs(eps):
    """|x| ~ 1e-3 (mean square ~1e-6): eps moves the result by ~30-70%, so an eps dropped or misplaced shows in
    fp32 (at the other tests' scale it is ~1e-8 relative, far inside their tolerance)."""
    norm = hf_norm(Qwen3RMSNorm, 576, eps, 3)
    x = torch.randn(4, 576, generator=torch.Generator().manual_seed(3)) * 1e-3
    out = rmsnorm.rms_norm(x, norm.weight.detach(), norm.variance_epsilon)
    with torch.no_grad():
        torch.testing.assert_close(out, norm(x), atol=1e-6, rtol=1e-5)
    without = rmsnorm.rms_norm_torch(x, norm.weight.detach(), 0.0)
    assert ((out - without).abs() > 0.1 * without.abs()).float().mean() > 0.9  # eps is visible at this scale


@needs_interpreter
@pytest.mark.parametrize("weight_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("hidden", [64, 576])
def test_fp16_rounds_as_hf(hidden, weight_dtype):
    """fp16 x: normalise in fp32, round to fp16, then the weight (fp16 x fp16 -> fp16, fp16 x fp32 -> fp32)."""
    norm = hf_norm(Qwen3RMSNorm, hidden, 1e-5, seed=hidden, dtype=weight_dtype)
    x = (torch.randn(4, 2, hidden, generator=torch.Generator().manual_seed(1)) * 4).half()
    out = rmsnorm.rms_norm(x, norm.weight.detach(), norm.variance_epsilon)
    with torch.no_grad():
        expected = norm(x)
    assert out.dtype == expected.dtype == torch.promote_types(weight_dtype, torch.float16)
    assert_one_rounding_apart(out, expected, x, norm.weight.detach(), 1e-5)


@needs_interpreter
def test_strided_rows_and_unmergeable_leading_dims():
    weight = torch.rand(64, generator=torch.Generator().manual_seed(2)) + 0.5
    base = torch.randn(6, 4, 128, generator=torch.Generator().manual_seed(3))
    for x in (base[:, :, ::2][..., :64].contiguous()[:, ::2], base[..., :64], base.transpose(0, 1)[..., :64]):
        assert x.stride(-1) == 1 and not x.is_contiguous()
        torch.testing.assert_close(rmsnorm.rms_norm(x, weight, 1e-6), rmsnorm.rms_norm_torch(x, weight, 1e-6),
                                   atol=1e-6, rtol=1e-5)
    assert rmsnorm.rms_norm(torch.empty(0, 3, 64), weight, 1e-6).shape == (0, 3, 64)


def test_launcher_asserts_its_contract():
    if rmsnorm.triton is None:
        pytest.skip("no Triton")
    x = torch.randn(2, 64)
    with pytest.raises(AssertionError):
        rmsnorm.rms_norm(x, torch.ones(32), 1e-6)
    with pytest.raises(AssertionError):
        rmsnorm.rms_norm(x.t(), torch.ones(2), 1e-6)  # the normalised dim is strided
    with pytest.raises(AssertionError):
        rmsnorm.rms_norm(x.double(), torch.ones(64), 1e-6)


def norm_names(model):
    return [name for name, m in model.named_modules() if type(m).__name__.endswith("RMSNorm")]


@pytest.mark.parametrize("family,count", [("qwen3", 2 * 4 + 1), ("llama", 2 * 2 + 1)])
def test_install_patches_instances_once_and_keeps_hf_path_with_grad(family, count):
    model, reference = tiny_model(family), tiny_model(family)
    if rmsnorm.triton is None:
        assert rmsnorm.install_fused_rmsnorm(model) == 0
        return
    assert len(norm_names(model)) == count
    assert rmsnorm.install_fused_rmsnorm(model) == count
    assert rmsnorm.install_fused_rmsnorm(model) == 0  # idempotent
    for name in norm_names(model):
        module = model.get_submodule(name)
        hf_class = type(reference.get_submodule(name))
        assert type(module).__bases__ == (hf_class,) and type(module).forward is rmsnorm._fused_forward
        assert hf_class.forward is not rmsnorm._fused_forward  # the HF class itself is untouched
        assert "forward" not in vars(module) and "forward" not in vars(reference.get_submodule(name))
    assert type(copy.deepcopy(model).model.norm) is type(model.model.norm)  # a copy keeps the kernel path
    ids = torch.tensor([[3, 17, 42, 5]])
    out, ref = model(ids).logits, reference(ids).logits  # grad enabled, CPU: HF's forward
    assert torch.equal(out, ref)
    out.square().sum().backward()
    ref.square().sum().backward()
    grad = model.model.layers[0].input_layernorm.weight.grad
    ref_grad = reference.model.layers[0].input_layernorm.weight.grad
    assert grad is not None and grad.abs().sum() > 0 and torch.equal(grad, ref_grad)


def test_installed_model_is_freed_without_the_garbage_collector():
    """No reference cycle: dropping the last reference frees the model at once (a bound method stored on each
    norm instance kept an engine's weights on the GPU until gc ran)."""
    def build():
        model = tiny_model("llama")
        rmsnorm.install_fused_rmsnorm(model)
        return model, [model.model.norm]

    assert freed_without_gc(build)


def test_install_without_triton_patches_nothing(monkeypatch):
    monkeypatch.setattr(rmsnorm, "triton", None)
    model = tiny_model("qwen3")
    assert rmsnorm.install_fused_rmsnorm(model) == 0
    assert all("forward" not in vars(model.get_submodule(name)) for name in norm_names(model))


@needs_interpreter
def test_installed_kernel_path_under_no_grad(monkeypatch):
    """With the CUDA condition widened to CPU, no-grad forwards run the kernel and match HF's logits."""
    calls = []
    kernel = rmsnorm.rms_norm
    monkeypatch.setattr(rmsnorm, "_fused_applies", lambda x: not torch.is_grad_enabled())
    monkeypatch.setattr(rmsnorm, "rms_norm", lambda *a: calls.append(a[0].shape) or kernel(*a))
    model, reference = tiny_model("qwen3"), tiny_model("qwen3")
    rmsnorm.install_fused_rmsnorm(model)
    ids = torch.tensor([[3, 17, 42]])
    with torch.no_grad():
        out, ref = model(ids).logits, reference(ids).logits
    assert len(calls) == 9 and (1, 3, 4, 16) in calls  # 2 layers x 4 norms + the final one; q_norm per head
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    calls.clear()
    model(ids)  # grad enabled: HF's forward
    assert not calls


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(64, 1, 2048), (64, 1, 16, 128), (7, 33, 576)])
@pytest.mark.parametrize("cls", [Qwen3RMSNorm, LlamaRMSNorm])
def test_bf16_cuda_rounds_as_hf(shape, cls):
    norm = hf_norm(cls, shape[-1], 1e-6, seed=5, dtype=torch.bfloat16, device="cuda")
    x = (torch.randn(*shape, generator=torch.Generator().manual_seed(6)) * 3).to("cuda", torch.bfloat16)
    with torch.no_grad():
        expected = norm(x)
        rmsnorm.install_fused_rmsnorm(norm)
        out = norm(x)  # the patched instance, on CUDA under no-grad: the kernel
    assert torch.equal(out, rmsnorm.rms_norm(x, norm.weight.detach(), 1e-6))
    assert out.dtype == torch.bfloat16
    assert_one_rounding_apart(out, expected, x, norm.weight.detach(), 1e-6)
