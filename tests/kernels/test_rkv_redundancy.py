"""R-KV redundancy without the C x C matrix (Triton kernel, row-blocked torch) against ``rkv_redundancy``.

CPU (CI): both kernels (full-matrix rows, ``symmetric=False``; half-matrix, ``symmetric=True``) run under
``TRITON_INTERPRET=1`` on fp32 keys ("ieee" dots); fp32 results agree with the reference to rtol 1e-5 / atol 1e-7
(outputs are ~1/C; only the summation order differs, and the symmetric kernel's 2^-40 fixed point). GPU (``gpu``):
bf16 keys, whose products are exact in fp32, against the reference on the same bf16 keys: rtol 1e-4 / atol 1e-6.
"""
import os

import pytest
import torch

from kvroll.kernels import rkv_redundancy as rr
from kvroll.policies.rkv import rkv_redundancy

triton_ok = rr.triton is not None and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")
needs_triton = pytest.mark.skipif(not triton_ok, reason="needs Triton on a GPU or TRITON_INTERPRET=1")
TOL = dict(rtol=1e-5, atol=1e-7)


def make_keys(rows, heads, capacity, head_dim, seed, holes=0.25):
    """Keys with near-duplicates (so rows exempt, several rows the same token), shuffled unique positions and
    holes (pos = -1, not live) that differ between rows; returns (k fp32, live, pos int32)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(rows, heads, capacity, head_dim, generator=g)
    src = torch.randint(0, capacity, (rows, heads, capacity // 3), generator=g)
    dst = torch.randint(0, capacity, (rows, heads, capacity // 3), generator=g)
    base = k.gather(2, src[..., None].expand(-1, -1, -1, head_dim))
    k.scatter_(2, dst[..., None].expand(-1, -1, -1, head_dim),
               base * 1.3 + 0.3 * torch.randn(base.shape, generator=g))
    pos = torch.stack([torch.randperm(3 * capacity, generator=g)[:capacity] for _ in range(rows * heads)])
    pos = pos.view(rows, heads, capacity).to(torch.int32)
    pos = pos.masked_fill(torch.rand(pos.shape, generator=g) < holes * torch.rand(rows, 1, 1, generator=g), -1)
    return k, pos >= 0, pos


# (rows, heads, capacity, head_dim): capacities that are not multiples of the 16-wide test blocks, heads 1 and 3
SHAPES = [(2, 1, 37, 16), (2, 3, 35, 32), (1, 3, 16, 16)]


# (symmetric, block_u, block_v): the symmetric kernel also with non-square blocks (tiles crossing the diagonal)
KERNELS = [(False, 16, 16), (True, 16, 16), (True, 16, 32), (True, 32, 16)]


@needs_triton
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("beta, threshold", [(0, 0.5), (1, 0.5), (1, -0.2)])  # T < 0: the diagonal competes
@pytest.mark.parametrize("symmetric, block_u, block_v", KERNELS)
def test_triton_matches_reference(shape, beta, threshold, symmetric, block_u, block_v):
    k, live, pos = make_keys(*shape, seed=sum(shape) + beta)
    want = rkv_redundancy(k, live, pos, threshold, beta)
    got = rr.rkv_redundancy_triton(k, live, pos, threshold, beta, block_u=block_u, block_v=block_v, num_warps=1,
                                   symmetric=symmetric)
    torch.testing.assert_close(got, want, **TOL)


@needs_triton
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the rows kernel reads NaN keys
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("threshold", [0.5, -0.2])
def test_triton_dead_slots_with_positions(symmetric, threshold):
    """Slots that are not live but keep a position (still exemption candidates, with S = 0, as in the reference)
    and non-finite keys in dead slots (the reference masks them out)."""
    k, live, pos = make_keys(2, 3, 41, 16, seed=11)
    g = torch.Generator().manual_seed(12)
    live = live & (torch.rand(live.shape, generator=g) > 0.2)
    k[~live] = torch.where(torch.rand(k[~live].shape, generator=g) < 0.5, float("nan"), float("inf"))
    want = rkv_redundancy(k, live, pos, threshold, 1)
    assert bool(torch.isfinite(want).all())
    got = rr.rkv_redundancy_triton(k, live, pos, threshold, 1, block_u=16, block_v=16, num_warps=1,
                                   symmetric=symmetric)
    torch.testing.assert_close(got, want, **TOL)


@needs_triton
def test_symmetric_is_deterministic():
    """Rows receive their sums and exemptions from several programs through integer atomics: bitwise equal.
    (The interpreter runs programs in order; ``test_triton_bf16_on_gpu`` repeats the check where they race.)"""
    k, live, pos = make_keys(2, 3, 35, 32, seed=5)
    args = dict(block_u=16, block_v=16, num_warps=1, symmetric=True)
    first = rr.rkv_redundancy_triton(k, live, pos, -0.2, 1, **args)
    assert torch.equal(first, rr.rkv_redundancy_triton(k, live, pos, -0.2, 1, **args))


def test_exemption_changes_the_result():
    """The fixtures exercise the exemption: beta = 1 differs from beta = 0 well beyond the tolerance."""
    for shape in SHAPES[:2]:
        k, live, pos = make_keys(*shape, seed=sum(shape) + 1)
        diff = (rkv_redundancy(k, live, pos, 0.5, 1) - rkv_redundancy(k, live, pos, 0.5, 0)).abs().max()
        assert float(diff) > 1e-3


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("beta", [0, 1, 2, 3])
def test_blocked_matches_reference(shape, beta):
    k, live, pos = make_keys(*shape, seed=7 * sum(shape) + beta)
    rows, heads, capacity, _ = shape
    want = rkv_redundancy(k, live, pos, 0.5, beta)
    block = rows * heads * capacity * 5  # 5 rows u per block: capacity is not a multiple of it
    torch.testing.assert_close(rr.rkv_redundancy_blocked(k, live, pos, 0.5, beta, block_elems=block), want, **TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("threshold", [0.5, -0.2])
def test_triton_bf16_on_gpu(symmetric, threshold):
    k, live, pos = make_keys(4, 8, 1100, 128, seed=3)
    k, live, pos = k.cuda().bfloat16(), live.cuda(), pos.cuda()
    want = rkv_redundancy(k, live, pos, threshold, 1)
    got = rr.rkv_redundancy_triton(k, live, pos, threshold, 1, symmetric=symmetric)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    again = rr.rkv_redundancy_triton(k, live, pos, threshold, 1, symmetric=symmetric)
    assert torch.equal(got, again), "not deterministic run to run"
