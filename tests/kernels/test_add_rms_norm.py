"""``add_rms_norm`` (residual add + RMSNorm in one kernel) against its torch reference and HF's two steps.

CPU (CI): the kernel runs under ``TRITON_INTERPRET=1``. fp32: the sum is bitwise HF's; the normed sum within a few
fp32 ulps (only the order of the sum of squares differs). fp16: the sum bitwise, the normed sum HF's or one rounding
of the normalised value away (``test_rmsnorm.assert_one_rounding_apart``). GPU (``gpu``): the same in bf16, and
bitwise equal to the unfused ``rms_norm`` kernel of the rounded sum.
"""

import pytest
import torch
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from kvroll.kernels import add_rms_norm as arn
from kvroll.kernels import rmsnorm
from tests.conftest import needs_interpreter
from tests.kernels.test_rmsnorm import assert_one_rounding_apart, hf_norm


HIDDEN = [1, 7, 100, 257, 1500]  # odd sizes: one column, a partial block of 8, 128, 512, 2048
LEADING = [(5,), (2, 3)]  # rows; a decode step's [B, S=1]-style leading dims


def inputs(leading, hidden, seed, dtype=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*leading, hidden, generator=gen) * 2  # an attention output
    residual = torch.randn(*leading, hidden, generator=gen) * 4  # the residual stream is larger
    return x.to(device, dtype), residual.to(device, dtype)


def hf_steps(norm, x, residual):
    """HF's decoder layer: ``hidden = residual + hidden; residual = hidden; hidden = norm(hidden)``."""
    with torch.no_grad():
        summed = residual + x
        return summed, norm(summed)


@needs_interpreter
@pytest.mark.parametrize("leading", LEADING)
@pytest.mark.parametrize("hidden", HIDDEN)
def test_fp32_sum_bitwise_and_norm_within_ulps(hidden, leading):
    norm = hf_norm(Qwen3RMSNorm, hidden, 1e-6, seed=hidden)
    x, residual = inputs(leading, hidden, seed=hidden + 1)
    summed, normed = arn.add_rms_norm(x, residual, norm.weight.detach(), norm.variance_epsilon)
    ref_sum, ref_norm = arn.add_rms_norm_torch(x, residual, norm.weight.detach(), 1e-6)
    hf_sum, hf_out = hf_steps(norm, x, residual)
    assert summed.shape == normed.shape == x.shape and summed.dtype == normed.dtype == torch.float32
    assert torch.equal(summed, ref_sum) and torch.equal(summed, hf_sum)
    # fp32: the sum of squares in another order moves the result by a few fp32 ulps
    torch.testing.assert_close(normed, ref_norm, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(normed, hf_out, atol=1e-6, rtol=1e-5)


@needs_interpreter
@pytest.mark.parametrize("weight_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("hidden", HIDDEN)
def test_fp16_rounds_as_hf(hidden, weight_dtype):
    """fp16: the sum in fp32, one rounding to fp16; the norm of that rounded sum as HF (fp16 or fp32 weight)."""
    norm = hf_norm(Qwen3RMSNorm, hidden, 1e-5, seed=hidden, dtype=weight_dtype)
    x, residual = inputs((4, 2), hidden, seed=hidden + 2, dtype=torch.float16)
    summed, normed = arn.add_rms_norm(x, residual, norm.weight.detach(), norm.variance_epsilon)
    hf_sum, hf_out = hf_steps(norm, x, residual)
    assert summed.dtype == torch.float16 and normed.dtype == hf_out.dtype == torch.promote_types(weight_dtype,
                                                                                                 torch.float16)
    assert torch.equal(summed, hf_sum)
    assert torch.equal(summed, (x.float() + residual.float()).half())  # one rounding of the exact sum
    assert_one_rounding_apart(normed, hf_out, hf_sum, norm.weight.detach(), 1e-5)


@needs_interpreter
def test_strided_rows_and_empty_input():
    weight = torch.rand(100, generator=torch.Generator().manual_seed(2)) + 0.5
    base_x, base_r = inputs((6, 4), 256, seed=3)
    for x, r in ((base_x[..., :100], base_r[..., 50:150]),  # strided rows
                 (base_x.transpose(0, 1)[..., :100], base_r.transpose(0, 1)[..., 100:200])):  # dims can't merge
        assert x.stride(-1) == 1 and not x.is_contiguous()
        summed, normed = arn.add_rms_norm(x, r, weight, 1e-6)
        ref_sum, ref_norm = arn.add_rms_norm_torch(x, r, weight, 1e-6)
        assert torch.equal(summed, ref_sum)
        torch.testing.assert_close(normed, ref_norm, atol=1e-6, rtol=1e-5)
    empty = torch.empty(0, 3, 100)
    assert all(t.shape == (0, 3, 100) for t in arn.add_rms_norm(empty, empty, weight, 1e-6))


def test_launcher_asserts_its_contract():
    if arn.triton is None:
        pytest.skip("no Triton")
    x = torch.randn(2, 64)
    for args in ((x, x, torch.ones(32)), (x, x.half(), torch.ones(64)), (x, x[:1], torch.ones(64)),
                 (x.t(), x.t(), torch.ones(2)), (x.double(), x.double(), torch.ones(64))):
        with pytest.raises(AssertionError):
            arn.add_rms_norm(*args, 1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(64, 1, 2048), (1, 1, 1536), (7, 33, 576), (3, 1, 257)])
def test_bf16_cuda_rounds_as_hf_and_equals_the_unfused_kernel(shape):
    norm = hf_norm(Qwen3RMSNorm, shape[-1], 1e-6, seed=5, dtype=torch.bfloat16, device="cuda")
    x, residual = inputs(shape[:-1], shape[-1], seed=6, dtype=torch.bfloat16, device="cuda")
    summed, normed = arn.add_rms_norm(x, residual, norm.weight.detach(), 1e-6)
    hf_sum, hf_out = hf_steps(norm, x, residual)
    assert torch.equal(summed, hf_sum) and normed.dtype == torch.bfloat16
    assert torch.equal(normed, rmsnorm.rms_norm(hf_sum, norm.weight.detach(), 1e-6))  # same reduction
    assert_one_rounding_apart(normed, hf_out, hf_sum, norm.weight.detach(), 1e-6)
