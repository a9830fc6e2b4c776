"""Rotary embedding of q and k in one kernel against HF's ``apply_rotary_pos_emb``, bit for bit.

CPU (CI): the Triton kernel runs under ``TRITON_INTERPRET=1`` in fp32 and fp16 (the interpreter's fp16 is NumPy's,
round-to-nearest-even; its bf16 casts are not, so bf16 is checked on a GPU only). cos/sin come from HF's own
rotary module for the rows' positions, cast to the dtype as HF casts them. GPU (``gpu``): the same in bf16, fp16
and fp32, where FMA contraction would break fp32 equality if the launch allowed it.

With Qwen3's per-head norms folded in (``q_norm`` / ``k_norm``) the oracle is HF's ``Qwen3RMSNorm`` modules followed
by HF's function. Only the sum of squares' order (and the interpreter's NumPy rsqrt) differs: in fp16/bf16 every
output is HF's function of normalised values each within one ulp of HF's (nearly all HF's bits); in fp32
the per-head scale moves by an ulp or two, so the normalised values by up to 3 ulps and the outputs stay within
atol 1e-6 / rtol 1e-5 of HF's. Under the interpreter the fold is bit for bit the two kernels it replaces
(``rms_norm`` then ``rotary``).
"""
import os
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from kvroll.kernels import rotary as rot
from kvroll.kernels.rmsnorm import rms_norm
from tests.conftest import needs_interpreter

triton_ok = rot.triton is not None and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")
needs_triton = pytest.mark.skipif(not triton_ok, reason="needs Triton on a GPU or TRITON_INTERPRET=1")

HEADS = [(7, 1), (5, 5), (4, 2), (3, 3)]  # (Hq, Hkv): odd counts, MHA, GQA 2, odd GQA 1
HEAD_DIMS = [64, 128, 6, 24]  # the usual two; small ones that are not powers of two
LEADING = [(1, 1), (5, 1), (2, 3)]  # one slot; a decode step's [slots, 1]; a prefill's [B, S]


def hf_cos_sin(leading, head_dim, dtype, device="cpu", theta=10000.0):
    """HF's rotary module's (cos, sin) [*leading, D] for positions spread up to ~8k, in ``dtype`` as HF casts."""
    config = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim, rope_theta=theta)
    module = LlamaRotaryEmbedding(config).to(device)
    gen = torch.Generator().manual_seed(head_dim)
    positions = torch.randint(0, 8192, leading, generator=gen).to(device)
    return module(torch.empty(0, dtype=dtype, device=device), positions)


def qk_input(leading, heads, head_dim, dtype, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(*leading, heads[0], head_dim, generator=gen) * 3
    k = torch.randn(*leading, heads[1], head_dim, generator=gen) * 3
    return q.to(device=device, dtype=dtype), k.to(device=device, dtype=dtype)


def hf_rotary(q, k, cos, sin):
    """HF's function on HF's layout [B, H, S, D] (q/k here are [B, S, H, D])."""
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    return q_ref.transpose(1, 2), k_ref.transpose(1, 2)


def assert_bitwise_hf(q, k, cos, sin):
    q_out, k_out = rot.rotary(q, k, cos, sin)
    q_ref, k_ref = hf_rotary(q, k, cos, sin)
    assert q_out.shape == q.shape and k_out.shape == k.shape and q_out.dtype == q.dtype
    assert q_out.is_contiguous() and k_out.is_contiguous()
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref), \
        ((q_out.float() - q_ref.float()).abs().max(), (k_out.float() - k_ref.float()).abs().max())
    return q_out, k_out


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("leading", LEADING)
def test_bitwise_hf(leading, heads, head_dim, dtype):
    q, k = qk_input(leading, heads, head_dim, dtype, seed=head_dim + heads[0])
    cos, sin = hf_cos_sin(leading, head_dim, dtype)
    q_out, _ = assert_bitwise_hf(q, k, cos, sin)
    # and against the exact rotation (fp64): within HF's three roundings
    exact = q.double() * cos.double()[..., None, :] + rot.rotate_half(q.double()) * sin.double()[..., None, :]
    ulp = torch.finfo(dtype).eps
    assert ((q_out.double() - exact).abs() <= 3 * ulp * (q.double().abs().amax(-1, keepdim=True) + 1)).all()


@needs_interpreter
@pytest.mark.parametrize("head_dim", [5, 7, 1])
def test_odd_head_dim_follows_rotate_half(head_dim):
    """HF's rotate_half on an odd D pairs unequal halves; with cos/sin of width D the function still applies."""
    leading = (3, 1)
    q, k = qk_input(leading, (3, 1), head_dim, torch.float16, seed=head_dim)
    angles = torch.randn(*leading, head_dim, generator=torch.Generator().manual_seed(1)) * 50
    assert_bitwise_hf(q, k, angles.cos().half(), angles.sin().half())


@needs_interpreter
def test_strided_slices_of_a_joined_row():
    """q, k as the fused QKV matmul gives them: slices of one [rows, (Hq + 2 Hkv) D] row, viewed per head."""
    hq, hkv, d = 5, 1, 64
    qkv = torch.randn(4, 1, (hq + 2 * hkv) * d, generator=torch.Generator().manual_seed(2))
    q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k = q.view(4, 1, hq, d), k.view(4, 1, hkv, d)
    assert not q.is_contiguous() and not k.is_contiguous()
    cos, sin = hf_cos_sin((4, 1), d, torch.float32)
    assert_bitwise_hf(q, k, cos, sin)
    q_out, k_out = rot.rotary(q[:0], k[:0], cos[:0], sin[:0])
    assert q_out.shape == (0, 1, hq, d) and k_out.shape == (0, 1, hkv, d)


@needs_interpreter
def test_extremes():
    """Zeros keep their sign through HF's sum as through the kernel's; inf and large values as torch does."""
    q = torch.tensor([[[[0.0, -0.0, 65504.0, -65504.0, 1e-7, float("inf"), 3.0, -2.0]]]]).half()
    k = q.clone()
    cos = torch.tensor([[[1.0, 1.0, 1.0, 1.0, 0.5, 0.25, -1.0, 0.0]]]).half()
    sin = torch.tensor([[[0.0, 0.0, 1.0, 1.0, 0.5, 0.0, 0.0, 1.0]]]).half()
    q_out, _ = rot.rotary(q, k, cos, sin)
    q_ref, _ = hf_rotary(q, k, cos, sin)
    assert torch.equal(q_out.isnan(), q_ref.isnan())
    same = q_out.isnan() | (q_out == q_ref)
    assert same.all() and torch.equal(torch.signbit(q_out[~q_out.isnan()]), torch.signbit(q_ref[~q_ref.isnan()]))


def qwen3_norms(head_dim, dtype, device="cpu", eps=1e-6, seed=0):
    """HF's q_norm and k_norm modules with random weights (around 1, some negative)."""
    gen = torch.Generator().manual_seed(seed)
    norms = [Qwen3RMSNorm(head_dim, eps=eps) for _ in range(2)]
    with torch.no_grad():
        for norm in norms:
            norm.weight.copy_(torch.rand(head_dim, generator=gen) * 2 - 0.5)
    return [norm.to(device=device, dtype=dtype) for norm in norms]


def normed_rotary_candidates(x, weight, eps, cos, sin):
    """HF's Qwen3RMSNorm then HF's rotary of x [B, S, H, D] (fp16/bf16), with the normalised values (HF's rounding
    point) moved by -1/0/+1 ulp, separately for the element's own term and its rotate_half partner: {(a, b): output}."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    bits = normed.view(torch.int16)  # adjacent values of a same-signed float are adjacent integers
    y = {step: weight * (bits + step).view(x.dtype) for step in (-1, 0, 1)}
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return {(a, b): y[a] * cos + rot.rotate_half(y[b]) * sin for a in (-1, 0, 1) for b in (-1, 0, 1)}


def assert_normed_rotary_as_hf(q, k, cos, sin, eps=1e-6, seed=0):
    """The fused norm + rotary against HF's modules (fp32: within atol 1e-6 / rtol 1e-5; fp16/bf16: the one-ulp
    oracle); returns the outputs and HF's."""
    q_norm, k_norm = qwen3_norms(q.shape[-1], q.dtype, q.device, eps, seed)
    wq, wk = q_norm.weight.detach(), k_norm.weight.detach()
    q_out, k_out = rot.rotary(q, k, cos, sin, q_norm=(wq, eps), k_norm=(wk, eps))
    with torch.no_grad():
        q_ref, k_ref = hf_rotary(q_norm(q), k_norm(k), cos, sin)
    assert q_out.shape == q.shape and k_out.shape == k.shape and q_out.dtype == k_out.dtype == q.dtype
    for x, weight, out, ref in ((q, wq, q_out, q_ref), (k, wk, k_out, k_ref)):
        if x.dtype == torch.float32:
            torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
            continue
        candidates = normed_rotary_candidates(x, weight, eps, cos, sin)
        assert torch.equal(candidates[0, 0], ref)  # the oracle's unshifted value is HF's
        ok = torch.stack([out == c for c in candidates.values()]).any(0)
        assert ok.all(), (out[~ok], ref[~ok])
    return (q_out, k_out), (q_ref, k_ref)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 24, 7, 5])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("leading", [(5, 1), (2, 3)])
def test_qwen3_norm_then_rotary_as_hf(leading, heads, head_dim, dtype):
    q, k = qk_input(leading, heads, head_dim, dtype, seed=head_dim + heads[0])
    if head_dim % 2:  # HF's rotary module has no odd D; angles of width D still define the function
        angles = torch.randn(*leading, head_dim, generator=torch.Generator().manual_seed(head_dim)) * 50
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    else:
        cos, sin = hf_cos_sin(leading, head_dim, dtype)
    (q_out, k_out), (q_ref, k_ref) = assert_normed_rotary_as_hf(q, k, cos, sin, seed=head_dim)
    if dtype == torch.float16:  # a normalised value takes HF's neighbour only rarely: mostly HF's bits
        assert (q_out == q_ref).float().mean() > 0.95 and (k_out == k_ref).float().mean() > 0.95
    # bit for bit the two kernels the fold replaces (same fp32 sum of squares over the same block)
    wq, wk = (n.weight.detach() for n in qwen3_norms(head_dim, dtype, seed=head_dim))
    q_two, k_two = rot.rotary(rms_norm(q, wq, 1e-6), rms_norm(k, wk, 1e-6), cos, sin)
    assert torch.equal(q_out, q_two) and torch.equal(k_out, k_two)


@needs_interpreter
def test_qwen3_norm_on_strided_slices_of_a_joined_row():
    """Norms read q/k straight from the joined QKV row (no copy); eps as passed, each tensor its own weight."""
    hq, hkv, d = 5, 1, 128
    qkv = torch.randn(4, 1, (hq + 2 * hkv) * d, generator=torch.Generator().manual_seed(3)).half()
    q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k = q.view(4, 1, hq, d), k.view(4, 1, hkv, d)
    assert not q.is_contiguous() and not k.is_contiguous()
    cos, sin = hf_cos_sin((4, 1), d, torch.float16)
    (q_out, k_out), (q_ref, k_ref) = assert_normed_rotary_as_hf(q, k, cos, sin, eps=1e-2, seed=4)
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)
    assert not torch.equal(q_out, rot.rotary(q, k, cos, sin, q_norm=(torch.ones(d).half(), 1e-2),
                                             k_norm=(torch.ones(d).half(), 1e-2))[0])  # the weight is applied
    empty = rot.rotary(q[:0], k[:0], cos[:0], sin[:0], q_norm=(torch.ones(d).half(), 1e-6),
                       k_norm=(torch.ones(d).half(), 1e-6))
    assert empty[0].shape == (0, 1, hq, d) and empty[1].shape == (0, 1, hkv, d)


def test_torch_reference_is_hfs_function_and_modules():
    """Without norms HF's function; with Qwen3's norms HF's ``Qwen3RMSNorm`` modules followed by HF's function."""
    q, k = qk_input((2, 3), (4, 2), 16, torch.float32)
    cos, sin = hf_cos_sin((2, 3), 16, torch.float32)
    for out, ref in zip(rot.rotary_torch(q, k, cos, sin), hf_rotary(q, k, cos, sin)):
        assert torch.equal(out, ref)
    q_norm, k_norm = qwen3_norms(16, torch.float32, eps=1e-5)
    out = rot.rotary_torch(q, k, cos, sin, q_norm=(q_norm.weight, 1e-5), k_norm=(k_norm.weight, 1e-5))
    with torch.no_grad():
        for o, r in zip(out, hf_rotary(q_norm(q), k_norm(k), cos, sin)):
            assert torch.equal(o, r)


def test_launcher_asserts_its_contract():
    """Each bad (q, k, cos, sin) and each bad pair of norms with good tensors is refused."""
    if rot.triton is None:
        pytest.skip("no Triton")
    q, k = qk_input((2, 1), (4, 2), 16, torch.float32)
    cos, sin = hf_cos_sin((2, 1), 16, torch.float32)
    w = torch.ones(16)
    bad = [
        ((q.half(), k, cos, sin), {}),  # mixed dtypes
        ((q, k[..., :8], cos, sin), {}),  # head dims differ
        ((q, k, cos[..., :8], sin[..., :8]), {}),  # cos narrower than the heads
        ((q, k, cos[:1], sin[:1]), {}),  # rows differ
        ((q.transpose(-1, -2), k, cos, sin), {}),  # head dim strided
        ((q.double(), k.double(), cos.double(), sin.double()), {}),
        ((q, k, cos, sin), dict(q_norm=(w, 1e-6))),  # only one of the two norms
        ((q, k, cos, sin), dict(q_norm=(w, 1e-6), k_norm=(w[:8], 1e-6))),  # weight narrower than the head
        ((q, k, cos, sin), dict(q_norm=(w.half(), 1e-6), k_norm=(w, 1e-6))),  # weight dtype differs from q's
        ((q, k, cos, sin), dict(q_norm=w, k_norm=w)),  # not (weight, eps)
    ]
    for args, norms in bad:
        with pytest.raises(AssertionError):
            rot.rotary(*args, **norms)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [((64, 1), (16, 8), 128), ((7, 1), (14, 2), 64), ((3, 33), (5, 1), 24),
                                   ((256, 1), (16, 8), 128), ((160, 1), (14, 2), 64)])  # 4 / 2 heads a program
def test_cuda_qwen3_norm_then_rotary_as_hf(shape, dtype):
    """On a GPU the sum's order is the compiler's: each normalised value within one ulp of HF's (the oracle); the
    last two shapes run heads grouped per program (``_heads_per_program`` on an H100 / H200's 132 SMs)."""
    leading, heads, head_dim = shape
    q, k = qk_input(leading, heads, head_dim, dtype, device="cuda", seed=head_dim)
    cos, sin = hf_cos_sin(leading, head_dim, dtype, device="cuda", theta=1_000_000.0)
    (q_out, _), (q_ref, _) = assert_normed_rotary_as_hf(q, k, cos, sin, seed=head_dim)
    if dtype != torch.float32:
        assert (q_out == q_ref).float().mean() > 0.99


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [((64, 1), (16, 8), 128), ((7, 1), (14, 2), 64), ((3, 33), (5, 1), 24),
                                   ((256, 1), (16, 8), 128), ((160, 1), (14, 2), 64)])  # 4 / 2 heads a program
def test_cuda_bitwise_hf(shape, dtype):
    leading, heads, head_dim = shape
    q, k = qk_input(leading, heads, head_dim, dtype, device="cuda", seed=head_dim)
    cos, sin = hf_cos_sin(leading, head_dim, dtype, device="cuda", theta=1_000_000.0)
    assert_bitwise_hf(q, k, cos, sin)
    grouped = rot._heads_per_program(leading[0] * leading[1], *heads, rot.triton.next_power_of_2(head_dim), q.device)
    assert grouped > 1 or leading[0] < 160  # the last two shapes run several heads a program (under 213 SMs)


def _write_case(slots, hq, hkv, d, capacity, dtype, device, seed, extra=2):
    """A joined QKV row (strided q/k/v views), HF's cos/sin, and one layer's cache buffers over slots + extra
    (the step writes through the first ``slots``: a slot view), some heads at capacity."""
    gen = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(slots, 1, (hq + 2 * hkv) * d, generator=gen) * 3).to(device=device, dtype=dtype)
    q, k, v = (t.view(slots, 1, -1, d) for t in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
    cos, sin = hf_cos_sin((slots, 1), d, dtype, device=device)
    total = slots + extra
    bufs = dict(k_cache=torch.randn(total, hkv, capacity, d, generator=gen), v_cache=torch.randn(total, hkv, capacity, d,
                generator=gen), vnorm=torch.rand(total, hkv, capacity, generator=gen),
                pos=torch.randint(-1, 4 * capacity, (total, hkv, capacity), generator=gen, dtype=torch.int32),
                count=torch.randint(capacity - 2, capacity + 1, (total, hkv), generator=gen),
                write_idx=torch.randint(0, capacity, (total, hkv), generator=gen),
                cur_pos=torch.randint(capacity, 8 * capacity, (total,), generator=gen))
    bufs = {name: t.to(device=device, dtype=dtype if name in ("k_cache", "v_cache") else t.dtype)
            for name, t in bufs.items()}
    return (q, k, v, cos, sin), bufs


@needs_triton
@pytest.mark.parametrize("device, dtype", [pytest.param("cpu", torch.float32, marks=needs_interpreter),
                                           pytest.param("cpu", torch.float16, marks=needs_interpreter),
                                           pytest.param("cuda", torch.bfloat16, marks=pytest.mark.gpu),
                                           pytest.param("cuda", torch.float32, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("hq, hkv, d, capacity, norm, vnorm, advance", [
    (4, 2, 64, 37, False, True, False), (7, 1, 128, 20, True, False, True), (5, 5, 16, 9, True, True, True),
    (6, 3, 32, 13, False, False, False), (16, 8, 128, 33, True, True, False),
])
def test_cache_write_rides_along_bit_for_bit(hq, hkv, d, capacity, norm, vnorm, advance, device, dtype):
    """``write=``: q as ``rotary`` gives it, and every cache buffer as ``rotary`` then ``cache_write`` leave it (the
    rotated key stored at the write index, the value, position, count, the advanced write index: bit for bit;
    ||v||_1 up to its fp32 sum's order, which a GPU's two reductions may take differently); the slots past the
    view and the rest of the rows untouched."""
    from kvroll.kernels.cache_write import cache_write, cache_write_torch

    slots = 3
    (q, k, v, cos, sin), bufs = _write_case(slots, hq, hkv, d, capacity, dtype, device, seed=d + capacity)
    norms = {}
    if norm:
        qn, kn = qwen3_norms(d, dtype, device=device)
        norms = dict(q_norm=(qn.weight.detach(), 1e-6), k_norm=(kn.weight.detach(), 1e-6))
    if not vnorm:
        bufs["vnorm"] = None
    views = {name: (t[:slots] if t is not None else None) for name, t in bufs.items()}
    order = ("k_cache", "v_cache", "vnorm", "pos", "count", "write_idx", "cur_pos")
    expected = {name: (t.clone() if t is not None else None) for name, t in bufs.items()}
    q_ref, k_ref = rot.rotary(q, k, cos, sin, **norms)
    for fn in (cache_write, cache_write_torch):  # the kernel and its reference agree on the rotated keys
        copy = {name: (t.clone() if t is not None else None) for name, t in bufs.items()}
        fn(*[copy[n][:slots] if copy[n] is not None else None for n in order], k_ref.transpose(1, 2),
           v.transpose(1, 2), capacity, advance=advance)
        if fn is cache_write:
            expected = copy
        else:
            for name in order:
                if name == "vnorm" and vnorm:
                    torch.testing.assert_close(copy[name], expected[name], rtol=1e-6, atol=1e-6)
                elif copy[name] is not None:
                    assert torch.equal(copy[name], expected[name]), name
    write = rot.CacheWrite(v, *[views[n] for n in order], capacity, advance)
    q_out, none = rot.rotary(q, k, cos, sin, write=write, **norms)
    assert none is None and torch.equal(q_out, q_ref)
    for name in order:
        if name == "vnorm" and vnorm:
            torch.testing.assert_close(bufs[name], expected[name], rtol=1e-6, atol=0)
        elif bufs[name] is not None:
            assert torch.equal(bufs[name], expected[name]), name
    count = bufs["count"][:slots]
    assert (count == capacity).any() and (count < capacity).any()  # both of the advance's cases reached


@needs_interpreter
def test_cache_write_layout_is_checked():
    (q, k, v, cos, sin), bufs = _write_case(2, 4, 2, 64, 10, torch.float32, "cpu", seed=1)
    order = ("k_cache", "v_cache", "vnorm", "pos", "count", "write_idx", "cur_pos")
    whole = rot.CacheWrite(v, *[bufs[n] for n in order], 10, False)  # 4 cache rows for 2 rows of q
    with pytest.raises(AssertionError):
        rot.rotary(q, k, cos, sin, write=whole)
    narrow = rot.CacheWrite(v, *[bufs[n][:2] for n in order], 10, False)._replace(pos=bufs["pos"][:2].long())
    with pytest.raises(AssertionError):
        rot.rotary(q, k, cos, sin, write=narrow)
    half = rot.CacheWrite(v, *[bufs[n][:2].half() if n in ("k_cache", "v_cache") else bufs[n][:2] for n in order],
                          10, False)  # an fp16 cache for fp32 keys: the rotary's roundings would not be HF's
    with pytest.raises(AssertionError, match="dtype torch.float16 / torch.float16 is not k's torch.float32"):
        rot.rotary(q, k, cos, sin, write=half)
    strided = rot.CacheWrite(v, *[bufs[n][:2] for n in order], 10, False)  # row r's position read at cur_pos + r
    strided = strided._replace(cur_pos=torch.stack([strided.cur_pos, strided.cur_pos + 50], dim=1)[:, 0])
    with pytest.raises(AssertionError):
        rot.rotary(q, k, cos, sin, write=strided)


@needs_triton
@pytest.mark.parametrize("device, dtype", [pytest.param("cpu", torch.float32, marks=needs_interpreter),
                                           pytest.param("cpu", torch.float16, marks=needs_interpreter),
                                           pytest.param("cuda", torch.bfloat16, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("hq, hkv, d, window, norm", [(4, 2, 64, 8, False), (7, 1, 24, 3, True),
                                                      (16, 8, 128, 8, True)])
def test_query_ring_rides_along(hq, hkv, d, window, norm, device, dtype):
    """``CacheWrite(q_ring=)``: the rotated queries also land in R-KV's / SnapKV's observation ring at index
    cur_pos % W of each row, as ``window.ring_write`` stores them (bit for bit), the other ring entries and the
    rows past the view untouched; the cache writes are those of the call without a ring."""
    from kvroll.policies.window import ring_write

    slots = 3
    (q, k, v, cos, sin), bufs = _write_case(slots, hq, hkv, d, 16, dtype, device, seed=d + window)
    norms = {}
    if norm:
        qn, kn = qwen3_norms(d, dtype, device=device)
        norms = dict(q_norm=(qn.weight.detach(), 1e-6), k_norm=(kn.weight.detach(), 1e-6))
    gen = torch.Generator().manual_seed(window)
    ring = torch.randn(slots + 2, window, hq, d, generator=gen).to(device=device, dtype=dtype)
    order = ("k_cache", "v_cache", "vnorm", "pos", "count", "write_idx", "cur_pos")
    plain = {name: t.clone() for name, t in bufs.items()}
    q_plain, _ = rot.rotary(q, k, cos, sin, write=rot.CacheWrite(v, *[plain[n][:slots] for n in order], 16, False),
                            **norms)
    expected = ring.clone()
    ring_write(SimpleNamespace(state={"queries": expected[None, :slots]}, cur_pos=bufs["cur_pos"][:slots]), 0,
               q_plain[:, 0])
    write = rot.CacheWrite(v, *[bufs[n][:slots] for n in order], 16, False, ring[:slots])
    q_out, _ = rot.rotary(q, k, cos, sin, write=write, **norms)
    assert torch.equal(q_out, q_plain) and torch.equal(ring, expected)
    for name in order:
        assert torch.equal(bufs[name], plain[name]), name
    with pytest.raises(AssertionError, match="query heads"):
        rot.rotary(q, k, cos, sin, write=write._replace(q_ring=ring[:slots, :, :hq - 1]), **norms)


@needs_interpreter
@pytest.mark.parametrize("heads_per_program", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype, full", [(torch.float32, True), (torch.float16, True), (torch.float32, False)])
def test_any_heads_per_program_writes_the_same(heads_per_program, dtype, full, monkeypatch):
    """Heads grouped per program (``HEADS_PER_PROGRAM``; 2 and 4 leave partial groups of 7 query and 3 key heads, 8
    holds them all; 1 is a GPU's choice at small batches) give the default grouping's outputs bit for bit under the
    interpreter: q, every cache buffer,
    the ring, and the plain (q, k) rotary; the default is HF's (the tests above). The default rule: one head per
    program while the programs are few, then the fewest heads that keep them within a bound per SM."""
    slots, hq, hkv, d, window = 3, 7, 3, 24, 4
    (q, k, v, cos, sin), bufs = _write_case(slots, hq, hkv, d, 11, dtype, "cpu", seed=5)
    qn, kn = qwen3_norms(d, dtype)
    norms = dict(q_norm=(qn.weight.detach(), 1e-6), k_norm=(kn.weight.detach(), 1e-6)) if full else {}
    ring = torch.randn(slots, window, hq, d, generator=torch.Generator().manual_seed(3)).to(dtype)
    order = ("k_cache", "v_cache", "vnorm", "pos", "count", "write_idx", "cur_pos")
    monkeypatch.setattr(rot, "HEADS_PER_PROGRAM", None)
    cpu, gpu = torch.device("cpu"), SimpleNamespace(type="cuda")
    monkeypatch.setattr(rot, "sm_count", lambda device: 132 if device.type == "cuda" else 8)
    assert [rot._heads_per_program(rows, 16, 8, 128, gpu) for rows in (1, 66, 67, 220, 221, 440, 441, 4096)] == \
        [1, 1, 2, 2, 4, 4, 8, 8]  # Qwen3-1.7B at 132 SMs: one head to 66 rows (1,584 programs), 2 to 220, ...
    assert rot._heads_per_program(4096, 14, 2, 64, gpu) == 16 and rot._heads_per_program(100, 1, 1, 128, gpu) == 1
    assert rot._heads_per_program(slots, hq, hkv, 32, cpu) == 8  # the interpreter: all 7 (3) heads in one program
    results = []
    for grouping in (None, heads_per_program):
        monkeypatch.setattr(rot, "HEADS_PER_PROGRAM", grouping)
        state = {name: t.clone() for name, t in bufs.items()}
        q_ring = ring.clone()
        views = [None if n == "vnorm" and not full else state[n][:slots] for n in order]  # (``full``: Qwen3's
        # norms, ||v||_1 and an appending cache; else none of the three)
        q_out, _ = rot.rotary(q, k, cos, sin, write=rot.CacheWrite(v, *views, 11, full, q_ring), **norms)
        results.append((q_out, q_ring, state, rot.rotary(q, k, cos, sin, **norms)))
    (q0, ring0, state0, plain0), (q1, ring1, state1, plain1) = results
    assert torch.equal(q0, q1) and torch.equal(ring0, ring1) and not torch.equal(ring0, ring)
    assert all(torch.equal(a, b) for a, b in zip(plain0, plain1))
    for name in order:
        assert torch.equal(state0[name], state1[name]), name
    assert not torch.equal(state0["k_cache"], bufs["k_cache"])  # the call wrote


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or rot.triton is None, reason="PDL launches need a GPU")
@pytest.mark.parametrize("late_signal", [False, True])
def test_cuda_pdl_launch_writes_the_same(late_signal):
    """As a programmatic dependent launch (``pdl``), signalling the next kernel at once or at each program's end
    (``late_signal``, ``pdl_gemm.rotary_signal_late``), the kernel writes what its plain launch writes, bit for bit:
    q and every cache buffer (Qwen3's norms, ||v||_1, a cache write at 128 rows of 8 KV heads)."""
    from kvroll.kernels import pdl_gemm

    if not pdl_gemm.pdl_available("cuda"):
        pytest.skip("PDL launches need compute capability 9.x")
    slots, hq, hkv, d, capacity = 16, 16, 8, 128, 40
    (q, k, v, cos, sin), bufs = _write_case(slots, hq, hkv, d, capacity, torch.bfloat16, "cuda", seed=7)
    qn, kn = qwen3_norms(d, torch.bfloat16, device="cuda")
    norms = dict(q_norm=(qn.weight.detach(), 1e-6), k_norm=(kn.weight.detach(), 1e-6))
    order = ("k_cache", "v_cache", "vnorm", "pos", "count", "write_idx", "cur_pos")
    results = []
    for pdl in (False, True):
        state = {name: t.clone() for name, t in bufs.items()}
        write = rot.CacheWrite(v, *[state[n][:slots] for n in order], capacity, False)
        q_out, _ = rot.rotary(q, k, cos, sin, write=write, pdl=pdl, late_signal=late_signal and pdl, **norms)
        torch.cuda.synchronize()
        results.append((q_out, state))
    (q0, state0), (q1, state1) = results
    assert torch.equal(q0, q1)
    for name in order:
        assert torch.equal(state0[name], state1[name]), name
    assert not torch.equal(state0["k_cache"], bufs["k_cache"])  # the call wrote
