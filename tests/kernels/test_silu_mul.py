"""SiLU(gate) * up in one kernel against HF's math (``silu_mul_torch``) on odd widths.

CPU (CI): the Triton kernel runs under ``TRITON_INTERPRET=1``. fp32 inputs agree with the fp32 reference to a few
fp32 ulp (only ``exp`` differs); fp16 inputs check HF's rounding order: the activation rounded to fp16, then one
rounding of the product (the interpreter's fp16 is NumPy's, round-to-nearest-even; its bf16 casts are not, so bf16
is checked on a GPU only). GPU (``gpu``): the same exact-rounding check in bf16 and fp16.
"""
import os

import pytest
import torch
import torch.nn.functional as F

from kvroll.kernels import silu_mul as sm

# the tests below but the gpu one run the kernel on CPU tensors: the interpreter's (on a GPU machine they would hand
# CPU pointers to a compiled kernel)
triton_ok = sm.triton is not None and os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not triton_ok, reason="the kernel on CPU tensors needs TRITON_INTERPRET=1")

WIDTHS = [1, 7, 100, 257, 1500]  # I, the intermediate size; 1500 > one block of 1024 columns
LEADING = [(1,), (5,), (3, 1), (2, 3)]  # rows; a decode step's [slots, 1]; a prefill's [B, S]


def gate_up_input(leading, width, seed, dtype=torch.float32, device="cpu", scale=4.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*leading, 2 * width, generator=gen) * scale).to(device=device, dtype=dtype)


def assert_one_rounding_apart(out, gate_up):
    """``out`` is HF's ``silu(gate) * up`` in gate_up's 16-bit dtype, or HF's with the rounded activation moved by
    one ulp (the one rounding the kernel may take differently: its exp is not torch's). Most elements are equal."""
    gate, up = gate_up.chunk(2, dim=-1)
    act = F.silu(gate)
    bits = act.view(torch.int16)  # adjacent values of a same-signed float are adjacent integers
    candidates = [(bits + step).view(act.dtype) * up for step in (-1, 0, 1)]
    expected = candidates[1]
    assert torch.equal(expected, sm.silu_mul_torch(gate_up))  # this is HF's math
    ok = (out == candidates[0]) | (out == expected) | (out == candidates[2])
    assert ok.all(), (out[~ok], expected[~ok])
    assert (out == expected).float().mean() > 0.99


@needs_triton
@pytest.mark.parametrize("leading", LEADING)
@pytest.mark.parametrize("width", WIDTHS)
def test_fp32_matches_reference(width, leading):
    gate_up = gate_up_input(leading, width, seed=width + len(leading))
    out = sm.silu_mul(gate_up)
    assert out.shape == (*leading, width) and out.dtype == torch.float32
    ref = sm.silu_mul_torch(gate_up)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=2e-6)  # fp32: exp differs by a few ulp
    gate, up = gate_up.double().chunk(2, dim=-1)
    torch.testing.assert_close(out.double(), gate * torch.sigmoid(gate) * up, atol=1e-6, rtol=2e-6)


@needs_triton
@pytest.mark.parametrize("width", WIDTHS)
def test_fp16_rounds_as_hf(width):
    gate_up = gate_up_input((4, 3), width, seed=width, dtype=torch.float16)
    out = sm.silu_mul(gate_up)
    assert out.dtype == torch.float16
    assert_one_rounding_apart(out, gate_up)
    ref32 = sm.silu_mul_torch(gate_up.float())  # fp16 against the fp32 reference: two fp16 roundings at most
    torch.testing.assert_close(out.float(), ref32, atol=1e-3, rtol=2e-3)


@needs_triton
def test_extremes_saturate_like_torch():
    gate = torch.tensor([-1e4, -90.0, -20.0, -1e-30, 0.0, 1e-30, 20.0, 90.0, 1e4])
    gate_up = torch.cat([gate, torch.full_like(gate, 3.0)])
    out = sm.silu_mul(gate_up)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, sm.silu_mul_torch(gate_up), atol=1e-30, rtol=1e-6)


@needs_triton
def test_strided_rows_and_empty_input():
    base = gate_up_input((6, 4), 100, seed=3)
    for gate_up in (base[::2], base.transpose(0, 1)):
        assert gate_up.stride(-1) == 1 and not gate_up.is_contiguous()
        torch.testing.assert_close(sm.silu_mul(gate_up), sm.silu_mul_torch(gate_up), atol=1e-6, rtol=2e-6)
    assert sm.silu_mul(torch.empty(0, 3, 14)).shape == (0, 3, 7)


def test_launcher_asserts_its_contract():
    if sm.triton is None:
        pytest.skip("no Triton")
    with pytest.raises(AssertionError):
        sm.silu_mul(torch.randn(2, 7))  # odd last dim: not [gate | up]
    with pytest.raises(AssertionError):
        sm.silu_mul(torch.randn(8, 2).t())  # the last dim is strided
    with pytest.raises(AssertionError):
        sm.silu_mul(torch.randn(2, 8).double())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [((64, 1), 6144), ((7, 1), 257), ((3, 33), 100)])
def test_cuda_rounds_as_hf(shape, dtype):
    leading, width = shape
    gate_up = gate_up_input(leading, width, seed=width, dtype=dtype, device="cuda")
    out = sm.silu_mul(gate_up)
    assert out.dtype == dtype
    assert_one_rounding_apart(out, gate_up)
