"""R-KV redundancy without the C x C matrix (Triton kernel, row-blocked torch) against ``rkv_redundancy``.

CPU (CI): the three kernels (full-matrix "rows"; half-matrix "symmetric"; slot-ordered "ordered") run under
``TRITON_INTERPRET=1`` on fp32 keys ("ieee" dots); fp32 results agree with the reference to rtol 1e-5 / atol 1e-7
(outputs are ~1/C; only the summation order differs, and the symmetric kernel's 2^-40 fixed point). GPU (``gpu``):
bf16 keys, whose products are exact in fp32, against the reference on the same bf16 keys: rtol 1e-4 / atol 1e-6.
"""

import pytest
import torch

from kvroll.kernels import rkv_redundancy as rr
from kvroll.policies.rkv import rkv_redundancy
from tests.conftest import needs_interpreter

TOL = dict(rtol=1e-5, atol=1e-7)


def make_keys(rows, heads, capacity, head_dim, seed, holes=0.25, ordered=False):
    """Keys with near-duplicates (so rows exempt, several rows the same token), shuffled unique positions and
    holes (pos = -1, not live) that differ between rows; returns (k fp32, live, pos int32). ``ordered``: the
    positions ascend with the slot (the engine's periodic caches), holes still anywhere."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(rows, heads, capacity, head_dim, generator=g)
    src = torch.randint(0, capacity, (rows, heads, capacity // 3), generator=g)
    dst = torch.randint(0, capacity, (rows, heads, capacity // 3), generator=g)
    base = k.gather(2, src[..., None].expand(-1, -1, -1, head_dim))
    k.scatter_(2, dst[..., None].expand(-1, -1, -1, head_dim),
               base * 1.3 + 0.3 * torch.randn(base.shape, generator=g))
    pos = torch.stack([torch.randperm(3 * capacity, generator=g)[:capacity] for _ in range(rows * heads)])
    pos = pos.view(rows, heads, capacity).to(torch.int32)
    if ordered:
        pos = pos.sort(dim=-1).values
    pos = pos.masked_fill(torch.rand(pos.shape, generator=g) < holes * torch.rand(rows, 1, 1, generator=g), -1)
    return k, pos >= 0, pos


# (rows, heads, capacity, head_dim): capacities that are not multiples of the 16-wide test blocks, heads 1 and 3
SHAPES = [(2, 1, 37, 16), (2, 3, 35, 32), (1, 3, 16, 16)]


# (kernel, block_u, block_v): symmetric and ordered also with non-square blocks (tiles crossing the diagonal)
KERNELS = [("rows", 16, 16), ("symmetric", 16, 16), ("symmetric", 16, 32), ("symmetric", 32, 16),
           ("ordered", 16, 16), ("ordered", 16, 32), ("ordered", 32, 16), ("scan", 16, 16), ("scan", 16, 32),
           ("scan", 32, 16)]
SLOT_ORDERED = ("ordered", "scan")  # kernels that need time-ordered rows and T >= 0


# (beta, threshold): T < 0 lets the diagonal compete; the slot-ordered kernels need T >= 0 (test_auto_picks_...)
CASES = [(kernel, bu, bv, beta, threshold) for kernel, bu, bv in KERNELS
         for beta, threshold in [(0, 0.5), (1, 0.5), (1, -0.2)] if kernel not in SLOT_ORDERED or threshold >= 0]


@needs_interpreter
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kernel, block_u, block_v, beta, threshold", CASES)
def test_triton_matches_reference(shape, beta, threshold, kernel, block_u, block_v):
    k, live, pos = make_keys(*shape, seed=sum(shape) + beta, ordered=kernel in SLOT_ORDERED)
    want = rkv_redundancy(k, live, pos, threshold, beta)
    got = rr.rkv_redundancy_triton(k, live, pos, threshold, beta, block_u=block_u, block_v=block_v, num_warps=1,
                                   kernel=kernel)
    torch.testing.assert_close(got, want, **TOL)


@needs_interpreter
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the rows kernel reads NaN keys
@pytest.mark.parametrize("kernel, threshold", [("rows", 0.5), ("rows", -0.2), ("symmetric", 0.5),
                                               ("symmetric", -0.2), ("ordered", 0.5), ("scan", 0.5)])
def test_triton_dead_slots_with_positions(kernel, threshold):
    """Slots that are not live but keep a position (still exemption candidates, with S = 0, as in the reference)
    and non-finite keys in dead slots (the reference masks them out)."""
    k, live, pos = make_keys(2, 3, 41, 16, seed=11, ordered=kernel in SLOT_ORDERED)
    g = torch.Generator().manual_seed(12)
    live = live & (torch.rand(live.shape, generator=g) > 0.2)
    k[~live] = torch.where(torch.rand(k[~live].shape, generator=g) < 0.5, float("nan"), float("inf"))
    want = rkv_redundancy(k, live, pos, threshold, 1)
    assert bool(torch.isfinite(want).all())
    got = rr.rkv_redundancy_triton(k, live, pos, threshold, 1, block_u=16, block_v=16, num_warps=1,
                                   kernel=kernel)
    torch.testing.assert_close(got, want, **TOL)


@needs_interpreter
def test_inverse_norms_kernel_matches_torch():
    x = torch.randn(77, 32, generator=torch.Generator().manual_seed(4)) * 3
    x[5] = 0.0  # a zero row: 1 / eps
    want = rr.inverse_norms(x, use_triton=False)
    torch.testing.assert_close(rr.inverse_norms(x, block=16), want, rtol=1e-6, atol=0)


def test_slot_ordered():
    """Live positions strictly ascending with the slot, holes (not live) anywhere and with any position."""
    pos = torch.tensor([[[0, 3, -1, 7, 9]], [[2, 5, 4, 8, 9]], [[1, 1, 2, 3, 4]]], dtype=torch.int32)
    live = pos >= 0
    assert rr.slot_ordered(live[:1], pos[:1])
    assert not rr.slot_ordered(live[1:2], pos[1:2])  # 5 then 4
    assert not rr.slot_ordered(live[2:], pos[2:])  # a repeated position
    hole = live[1:2].clone()
    hole[..., 2] = False  # the out-of-order token is not live: ordered
    assert rr.slot_ordered(hole, pos[1:2])


@needs_interpreter
def test_auto_picks_a_kernel_that_fits():
    """``auto`` runs "ordered" on time-ordered rows and "rows" otherwise (shuffled positions, T < 0): the result
    equals the reference either way; ``ordered`` refuses shuffled positions and T < 0 with an error."""
    for ordered, threshold in [(True, 0.5), (False, 0.5), (True, -0.2)]:
        k, live, pos = make_keys(2, 3, 35, 16, seed=21, ordered=ordered)
        got = rr.rkv_redundancy_triton(k, live, pos, threshold, 1, block_u=16, block_v=16, num_warps=1)
        torch.testing.assert_close(got, rkv_redundancy(k, live, pos, threshold, 1), **TOL)
    for kernel in SLOT_ORDERED:
        k, live, pos = make_keys(2, 3, 35, 16, seed=21, ordered=False)
        with pytest.raises(AssertionError, match="ascending with the slot"):
            rr.rkv_redundancy_triton(k, live, pos, 0.5, 1, kernel=kernel)
        k, live, pos = make_keys(2, 3, 35, 16, seed=21, ordered=True)
        with pytest.raises(AssertionError, match="threshold >= 0"):
            rr.rkv_redundancy_triton(k, live, pos, -0.2, 1, kernel=kernel)


@needs_interpreter
@pytest.mark.parametrize("common", [0.0, 0.5, 3.0])
def test_scan_stops_early_with_the_same_result(common):
    """Keys sharing a direction (real models' keys: most pairs above T = 0.5) end the scan kernel's search in the
    newest tile for most rows; rows of the other head (random keys, ``common`` 0) search every tile. The result
    equals the reference and the full-matrix kernel's either way, at a capacity a block does not divide."""
    k, live, pos = make_keys(3, 2, 53, 16, seed=31, ordered=True)
    shared = torch.randn(16, generator=torch.Generator().manual_seed(32))
    k[:, 0] += common * shared  # head 0: similar keys; head 1: as made
    want = rkv_redundancy(k, live, pos, 0.5, 1)
    for block_u, block_v in [(16, 16), (32, 16)]:
        got = rr.rkv_redundancy_triton(k, live, pos, 0.5, 1, block_u=block_u, block_v=block_v, num_warps=1,
                                       kernel="scan")
        torch.testing.assert_close(got, want, **TOL)
    rows = rr.rkv_redundancy_triton(k, live, pos, 0.5, 1, block_u=16, block_v=16, num_warps=1, kernel="rows")
    torch.testing.assert_close(got, rows, **TOL)


@needs_interpreter
def test_auto_prefers_the_scan_on_time_ordered_rows(monkeypatch):
    """``ORDERED_SCAN`` (the A/B's switch) decides which slot-ordered kernel "auto" runs."""
    k, live, pos = make_keys(1, 2, 20, 16, seed=41, ordered=True)
    ran = []
    for name in ("_scan_col_sums", "_row_col_sums"):
        real = getattr(rr, name)
        monkeypatch.setattr(rr, name, lambda *a, _real=real, _name=name, **kw: ran.append(_name) or _real(*a, **kw))
    for scan in (True, False):
        monkeypatch.setattr(rr, "ORDERED_SCAN", scan)
        rr.rkv_redundancy_triton(k, live, pos, 0.5, 1, block_u=16, block_v=16, num_warps=1)
    assert ran == ["_scan_col_sums", "_row_col_sums"]


@needs_interpreter
def test_symmetric_is_deterministic():
    """Rows receive their sums and exemptions from several programs through integer atomics: bitwise equal.
    (The interpreter runs programs in order; ``test_triton_bf16_on_gpu`` repeats the check where they race.)"""
    k, live, pos = make_keys(2, 3, 35, 32, seed=5)
    args = dict(block_u=16, block_v=16, num_warps=1, kernel="symmetric")
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
def test_scan_stops_early_on_gpu():
    """The compiled scan where most blocks stop after the newest tile (keys sharing a direction, as a real model's
    do; c2's first version went wrong on the GPU only), and where they do not (head 1: random keys), at a capacity
    neither block divides: the reference's result, bit for bit run to run."""
    k, live, pos = make_keys(4, 2, 1100, 128, seed=9, ordered=True)
    k[:, 0] += 3.0 * torch.randn(128, generator=torch.Generator().manual_seed(10))
    k, live, pos = k.cuda().bfloat16(), live.cuda(), pos.cuda()
    want = rkv_redundancy(k, live, pos, 0.5, 1)
    got = rr.rkv_redundancy_triton(k, live, pos, 0.5, 1, kernel="scan")
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert torch.equal(got, rr.rkv_redundancy_triton(k, live, pos, 0.5, 1, kernel="scan"))


@pytest.mark.gpu
@pytest.mark.parametrize("kernel, threshold", [("rows", 0.5), ("rows", -0.2), ("symmetric", 0.5),
                                               ("symmetric", -0.2), ("ordered", 0.5), ("scan", 0.5)])
def test_triton_bf16_on_gpu(kernel, threshold):
    k, live, pos = make_keys(4, 8, 1100, 128, seed=3, ordered=kernel in SLOT_ORDERED)
    k, live, pos = k.cuda().bfloat16(), live.cuda(), pos.cuda()
    want = rkv_redundancy(k, live, pos, threshold, 1)
    got = rr.rkv_redundancy_triton(k, live, pos, threshold, 1, kernel=kernel)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    again = rr.rkv_redundancy_triton(k, live, pos, threshold, 1, kernel=kernel)
    assert torch.equal(got, again), "not deterministic run to run"
