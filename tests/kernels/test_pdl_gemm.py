"""The PDL chain (``kvroll/kernels/pdl_gemm.py``): ``linear_pdl`` against the fp32 product (whole, and as 2 K
slices' partials against ``split_k.linear_parts``), its configuration rule and the gates of ``chain_applies``; on a
GPU, the chain's kernels launched as programmatic dependent launches against the same kernels launched plainly (bit
for bit, in CUDA graphs and in the engine) and against cuBLAS.

CPU (CI): the GEMM under ``TRITON_INTERPRET=1`` (plain launches: the interpreter has no PDL) in fp16 and fp32, at
row counts from 1 to 64 and both of the rule's tile shapes, the rows in tiles (40-128 rows), ``SHAPE_TILES``'
invariants and its path through ``gemm_config``, the chain's gate on the o / down projections, and the engine's
wiring of the chain. GPU (``gpu``): bf16, Hopper (the chain's only home), at 1-128 rows.
"""
import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from kvroll import CompressionConfig, RolloutEngine, SamplingParams
from kvroll.kernels import add_rms_norm as arn
from kvroll.kernels import pdl_gemm
from kvroll.kernels import silu_mul as sm
from kvroll.kernels import split_k
from kvroll.rollout.graphs import batch_sizes

triton_ok = pdl_gemm.triton is not None and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")
needs_triton = pytest.mark.skipif(not triton_ok, reason="needs Triton on a GPU or TRITON_INTERPRET=1")
hopper = pytest.mark.skipif(not (torch.cuda.is_available() and pdl_gemm.gemm_available("cuda")),
                            reason="the PDL chain runs on compute capability 9.x only")


# the second dtype: fp32 under the interpreter (which has no bf16 arithmetic); bf16 on a GPU, where fp32 is not the
# chain's (chain_applies) and the rule's tiles do not fit fp32's shared memory at 64 rows
SECOND_DTYPE = torch.bfloat16 if torch.cuda.is_available() else torch.float32


@needs_triton
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 64])
@pytest.mark.parametrize("n", [2048, 8192])  # the rule's qkv-like (32 x 256 tiles) and gate_up-like shapes
@pytest.mark.parametrize("dtype", [torch.float16, SECOND_DTYPE])
def test_linear_pdl_against_the_fp32_product(rows, n, dtype):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=dev).manual_seed(rows + n)
    k = 256
    x = torch.randn(rows, 1, k, generator=gen, device=dev).to(dtype)
    weight = (torch.randn(n, k, generator=gen, device=dev) * 0.05).to(dtype)
    assert pdl_gemm.gemm_config(rows, n, k) is not None
    out = pdl_gemm.linear_pdl(x, weight, pdl=False)
    assert out.shape == (rows, 1, n) and out.dtype == dtype
    ref = x.double() @ weight.double().T
    tol = 1e-5 if dtype == torch.float32 else 8e-3 if dtype == torch.bfloat16 else 4e-3
    assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < tol
    if dtype == torch.float16:  # within a rounding of the product rounded once, as F.linear rounds it
        err, err_rounded = (out.double() - ref).abs().max(), (ref.to(dtype).double() - ref).abs().max()
        assert err <= 2 * err_rounded + 1e-3, (err, err_rounded)


@needs_triton
@pytest.mark.parametrize("rows", [1, 9, 64])
@pytest.mark.parametrize("k", [512, 2048])  # o-like (K / 2 <= 1,024: 128-wide steps) and down-like (256-wide)
def test_linear_pdl_split_partials_against_linear_parts(rows, k):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=dev).manual_seed(rows + k)
    x = torch.randn(rows, 1, k, generator=gen, device=dev).half()
    weight = (torch.randn(1024, k, generator=gen, device=dev) * 0.05).half()
    assert pdl_gemm.gemm_config(rows, 1024, k, 2) is not None
    out = pdl_gemm.linear_pdl(x, weight, pdl=False, parts=2)
    assert out.shape == (2, rows, 1, 1024) and out.dtype == torch.float32
    ref = split_k.linear_parts(x, weight, 2)  # each slice's product in fp32
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(out.sum(0), x.double() @ weight.double().T, rtol=1e-4, atol=1e-3, check_dtype=False)


@needs_triton
@pytest.mark.parametrize("rows, inter", [(1, 2048), (7, 2048), (16, 2048), (17, 4096), (64, 2048), (64, 4096)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_linear_pdl_silu_mul_epilogue(rows, inter, dtype):
    """gate_up's GEMM with SiLU * up in its epilogue (both of the rule's tiles: 64 x 128, and 128 x 128 past 16 rows
    where N = 2I gives 64 programs) equals ``silu_mul`` of the GEMM's output (the same products, rounded as
    ``silu_mul`` rounds them: on a GPU bit for bit), and HF's math on the fp64 product within a rounding."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu" and dtype == torch.bfloat16:
        pytest.skip("the interpreter has no bf16 arithmetic")
    gen = torch.Generator(device=dev).manual_seed(rows)
    k = 256
    x = torch.randn(rows, 1, k, generator=gen, device=dev).to(dtype)
    weight = (torch.randn(2 * inter, k, generator=gen, device=dev) * 0.1).to(dtype)
    cfg = pdl_gemm.gemm_config(rows, 2 * inter, k, silu_mul=True)
    assert cfg[0] == (128 if rows > 16 and inter == 4096 else 64)
    fused = pdl_gemm.linear_pdl(x, weight, pdl=False, silu_mul=True)
    assert fused.shape == (rows, 1, inter) and fused.dtype == dtype
    product = pdl_gemm.linear_pdl(x, weight, pdl=False, config=cfg)  # the same tile's products
    assert torch.equal(fused, sm.silu_mul(product))  # silu_mul's kernel on them (the same exp): bit for bit
    # and HF's rounding in the dtype: torch's exp against Triton's may round an activation at a boundary apart
    diff = (fused.float() - sm.silu_mul_torch(product).float()).abs()
    assert (diff <= 2 * fused.float().abs() * 2 ** -(7 if dtype == torch.bfloat16 else 10) + 1e-6).all()
    assert (diff > 0).float().mean() < 0.02
    ref = sm.silu_mul_torch((x.double() @ weight.double().T).to(dtype).double())  # HF's math, fp64
    assert ((fused.double() - ref).abs() <= 4 * ref.abs() * 2 ** -(8 if dtype == torch.bfloat16 else 11)
            + 1e-3).all()
    with pytest.raises(AssertionError, match="not a shape"):
        pdl_gemm.linear_pdl(x, weight, pdl=False, parts=2, silu_mul=True)
    with pytest.raises(AssertionError, match="BLOCK_N 16"):
        pdl_gemm.linear_pdl(x, weight, pdl=False, silu_mul=True, config=(16, 128, 4, 3))


@needs_triton
@pytest.mark.parametrize("rows, block_m", [(100, 32), (128, 64), (40, 16)])
def test_linear_pdl_row_tiles(rows, block_m):
    """The rows in tiles of BLOCK_M (config's fifth entry; the last tile partial where BLOCK_M does not divide them):
    the whole product, the 2 K slices' partials and the SiLU * up epilogue equal one tile of all rows'."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float16
    gen = torch.Generator(device=dev).manual_seed(rows)
    k = 256
    x = torch.randn(rows, 1, k, generator=gen, device=dev).to(dtype)
    weight = (torch.randn(1024, k, generator=gen, device=dev) * 0.05).to(dtype)
    ref = x.double() @ weight.double().T
    for parts, cfg in ((1, (64, 128, 4, 2)), (2, (32, 64, 4, 2))):
        tiled = pdl_gemm.linear_pdl(x, weight, pdl=False, parts=parts, config=(*cfg, block_m))
        whole = pdl_gemm.linear_pdl(x, weight, pdl=False, parts=parts, config=cfg)
        assert tiled.shape == whole.shape
        if dev == "cpu":  # the same K steps per output: the same sums (a GPU may pick other MMA instructions)
            assert torch.equal(tiled, whole)
        else:
            torch.testing.assert_close(tiled, whole, rtol=2e-3, atol=2e-3)
        got = tiled.double() if parts == 1 else tiled.double().sum(0)
        assert ((got - ref).abs().max() / ref.abs().max()).item() < 4e-3
    cfg = (64, 128, 4, 2, block_m)
    fused = pdl_gemm.linear_pdl(x, weight, pdl=False, silu_mul=True, config=cfg)
    assert torch.equal(fused, sm.silu_mul(pdl_gemm.linear_pdl(x, weight, pdl=False, config=cfg)))


def test_shape_tiles_are_measured_tiles_that_fit():
    """Every ``SHAPE_TILES`` entry: a range inside the chain's rows past the few-rows rule, tiles that divide N and
    K / parts, at least 64 programs over the range's rows, SiLU * up's halves of >= 32 columns, BLOCK_M a power of
    two >= 16 (``linear_pdl`` asserts it), and ``shape_tiles`` finds it at both ends of its range."""
    for (rng, n, k, parts, silu), cfg in pdl_gemm.SHAPE_TILES.items():
        block_n, block_k, warps, stages, block_m = cfg
        assert pdl_gemm.FEW_ROWS < rng[0] <= rng[1] <= pdl_gemm.MAX_ROWS, rng
        assert n % block_n == 0 and k % (parts * block_k) == 0, (n, k, parts, cfg)
        assert block_m >= 16 and block_m & (block_m - 1) == 0 and (not silu or block_n >= 64), cfg
        assert parts in (1, 2) and not (silu and parts != 1) and warps in (4, 8) and 2 <= stages <= 5, cfg
        for rows in rng:
            assert -(-rows // block_m) * parts * n // block_n >= 64, (n, k, rows, cfg)
            assert pdl_gemm.shape_tiles(rows, n, k, parts, silu) == cfg
            assert pdl_gemm.gemm_config(rows, n, k, parts, silu) == cfg
        assert pdl_gemm.shape_tiles(rng[1] + 1, n, k, parts, silu) is None


@needs_triton
def test_linear_pdl_takes_the_shape_tiles(monkeypatch):
    """``linear_pdl`` with no config past 64 rows takes ``gemm_config``'s ``SHAPE_TILES`` entry (5 entries: the rows
    in tiles): a small shape patched in at 65-80 rows, against the fp64 product; outside its range, no config."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    key = ((65, 80), 512, 256, 1, False)
    monkeypatch.setattr(pdl_gemm, "SHAPE_TILES", {key: (32, 128, 4, 2, 32)})  # 3 row tiles x 16 column tiles
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(70, 1, 256, generator=gen, device=dev).half()
    weight = (torch.randn(512, 256, generator=gen, device=dev) * 0.05).half()
    assert pdl_gemm.gemm_config(70, 512, 256) == (32, 128, 4, 2, 32)
    out = pdl_gemm.linear_pdl(x, weight, pdl=False)
    ref = x.double() @ weight.double().T
    assert out.shape == (70, 1, 512) and ((out.double() - ref).abs().max() / ref.abs().max()).item() < 4e-3
    with pytest.raises(AssertionError, match="not a shape"):
        pdl_gemm.linear_pdl(torch.zeros(81, 256, dtype=torch.float16, device=dev), weight, pdl=False)
    with pytest.raises(AssertionError, match="BLOCK_M 48"):
        pdl_gemm.linear_pdl(x, weight, pdl=False, config=(32, 128, 4, 2, 48))


def test_a_layer_chains_its_qkv_and_gate_up_or_neither(monkeypatch):
    """``fused_add_norm._chained``: a layer is chained where the chain's GEMM takes both its joined qkv and its
    joined gate_up (session 28's review): Qwen3-8B's layer at 8 and 48 rows; a layer with Qwen3-8B's qkv but
    Llama-3-8B's MLP (28,672 x 4,096) not at all, where before its qkv and o took the chain beside cuBLAS's MLP; a
    layer whose MLP is not kvroll's fused one by its qkv alone, as before. The attention module follows the layer's
    decision."""

    from kvroll.kernels import fused_add_norm
    from kvroll.kernels.fused_mlp import _FUSED as gate_up_attr
    from kvroll.kernels.fused_qkv_rotary import _FUSED as qkv_attr
    monkeypatch.setattr(pdl_gemm, "gemm_available", lambda device: True)

    def layer(qkv, gate_up):
        mlp = SimpleNamespace(**({gate_up_attr: (torch.empty(*gate_up, dtype=torch.bfloat16), None)}
                                 if gate_up else {}))
        return SimpleNamespace(self_attn=SimpleNamespace(**{qkv_attr: (torch.empty(*qkv, dtype=torch.bfloat16), None)}),
                               mlp=mlp)

    for rows in (8, 48):
        x = torch.zeros(rows, 1, 4096, dtype=torch.bfloat16)
        assert fused_add_norm._chained(layer((6144, 4096), (24576, 4096)), x)  # Qwen3-8B
        assert not fused_add_norm._chained(layer((6144, 4096), (28672, 4096)), x)  # Llama-3-8B's MLP
        assert fused_add_norm._chained(layer((6144, 4096), None), x)  # no fused MLP: the qkv decides
        assert not fused_add_norm._chained(layer((5120, 4096), (24576, 4096)), x)  # a qkv not measured
    x = torch.zeros(96, 1, 2048, dtype=torch.bfloat16)
    assert fused_add_norm._chained(layer((4096, 2048), (12288, 2048)), x)  # Qwen3-1.7B past 64 rows
    monkeypatch.setattr(pdl_gemm, "SILU_EPILOGUE", False)  # the MLP then asks for the plain gate_up
    assert fused_add_norm._chained(layer((4096, 2048), (12288, 2048)), x)
    assert not fused_add_norm._chained(layer((4096, 2048), (12288, 2048)), x[:0])  # no rows
    # the attention follows the layer's word (kvroll_chain), else its qkv weight alone
    from kvroll.kernels.fused_qkv_rotary import _takes_chain
    qkv = torch.empty(4096, 2048, dtype=torch.bfloat16)
    assert _takes_chain(x, qkv, None, None) and _takes_chain(x, qkv, None, True)
    assert not _takes_chain(x, qkv, None, False)
    assert not _takes_chain(x, torch.empty(5120, 2048, dtype=torch.bfloat16), None, True)


def test_project_chains_only_a_chained_layer(monkeypatch):
    """``split_k.project`` (o, down) takes the chain's GEMM only where its layer is chained: past 64 rows an o of
    Qwen3-1.7B's shape (2,048 x 2,048, a ``SHAPE_TILES`` entry) in a layer whose qkv is not (a shape the table does
    not hold) keeps cuBLAS's partials."""
    from torch import nn
    calls = []
    monkeypatch.setattr(pdl_gemm, "gemm_available", lambda device: True)
    monkeypatch.setattr(split_k, "linear_pdl", lambda x, w, pdl=None, parts=1: calls.append(parts) or
                        split_k.linear_parts(x, w, parts))
    o = nn.Linear(2048, 2048, bias=False).to(torch.bfloat16)
    x = torch.randn(96, 1, 2048).bfloat16()
    assert pdl_gemm.chain_applies(x, o.weight, parts=2)  # the shape alone would take it
    plain = split_k.project(o, x, 2)  # chain=False: the layer is not chained
    assert calls == [] and plain.shape == (2, 96, 1, 2048)
    chained = split_k.project(o, x, 2, chain=True)
    assert calls == [2] and torch.equal(plain, chained)
    assert not pdl_gemm.chain_applies(x, torch.zeros(2560, 2048, dtype=torch.bfloat16))  # a qkv not in the table


def test_gemm_config_rule(monkeypatch):
    assert pdl_gemm.chain_rows(1) and pdl_gemm.chain_rows(64) and pdl_gemm.chain_rows(128)
    assert not pdl_gemm.chain_rows(0) and not pdl_gemm.chain_rows(129)
    assert pdl_gemm.gemm_config(1, 4096, 2048) == (32, 256, 4, 4)  # qkv
    assert pdl_gemm.gemm_config(64, 4096, 2048) == (32, 256, 4, 4)
    assert pdl_gemm.gemm_config(8, 12288, 2048) == (32, 128, 4, 4)  # gate_up, few rows
    assert pdl_gemm.gemm_config(64, 12288, 2048) == (128, 128, 4, 3)
    assert pdl_gemm.gemm_config(65, 4096, 2048) == (64, 128, 4, 5, 64)  # past 64 rows: SHAPE_TILES' shapes only
    assert pdl_gemm.gemm_config(128, 2048, 6144, 2) == (64, 128, 4, 5, 64)  # down in 2 K slices
    assert pdl_gemm.gemm_config(128, 2560, 2048) is None  # a shape not measured past 64 rows
    assert pdl_gemm.gemm_config(64, 2560, 2048) == (32, 256, 4, 4)  # (at 64 rows the width rule takes it)
    assert pdl_gemm.gemm_config(128, 3072, 2048) == (64, 128, 4, 5, 64)  # Llama-3.2-1B's qkv (session 28)
    assert pdl_gemm.gemm_config(64, 3072, 2048) == (32, 256, 4, 4)  # (at 64 rows the width rule)
    assert pdl_gemm.gemm_config(129, 4096, 2048) is None  # 256 rows measured slower
    assert pdl_gemm.gemm_config(32, 6144, 2560) == (32, 256, 4, 4)  # Qwen3-4B's qkv: the width rule at <= 32 rows,
    assert pdl_gemm.gemm_config(33, 6144, 2560) == (64, 128, 4, 5, 64)  # its own tile at 33-64
    assert pdl_gemm.gemm_config(56, 19456, 2560, silu_mul=True) == (128, 64, 4, 4, 64)
    assert pdl_gemm.shape_tiles(64, 6144, 2560) == (64, 128, 4, 5, 64) and pdl_gemm.gemm_config(65, 6144, 2560) is None
    assert pdl_gemm.gemm_config(0, 4096, 2048) is None
    assert pdl_gemm.gemm_config(8, 4096, 2000) is None  # K not a multiple of the tile
    assert pdl_gemm.gemm_config(8, 4100, 2048) is None  # N not a multiple of the tile
    assert pdl_gemm.gemm_config(8, 1024, 2048) is None  # 32 programs: too few for the GPU
    assert pdl_gemm.gemm_config(32, 7168, 2048) is None  # 128-wide tiles: 56 programs, 64 needed
    assert pdl_gemm.gemm_config(64, 2048, 2048, 2) == (32, 128, 4, 5)  # o in 2 K slices
    assert pdl_gemm.gemm_config(8, 2048, 6144, 2) == (32, 256, 4, 5)  # down
    assert pdl_gemm.gemm_config(64, 2048, 6144, 2) == (32, 256, 4, 4)  # (5 stages do not fit 64 rows' tiles)
    assert pdl_gemm.gemm_config(64, 2048, 6144, 3) is None  # 2 slices only
    assert pdl_gemm.gemm_config(64, 512, 2048, 2) is None  # 32 programs
    assert pdl_gemm.gemm_config(8, 12288, 2048, silu_mul=True) == (64, 128, 4, 3)  # SiLU * up in the epilogue
    assert pdl_gemm.gemm_config(17, 12288, 2048, silu_mul=True) == (128, 128, 4, 3)
    assert pdl_gemm.gemm_config(64, 6144, 1024, silu_mul=True) == (64, 128, 4, 3)  # Qwen3-0.6B: 48 wide programs
    assert pdl_gemm.gemm_config(64, 12288, 2048, 2, silu_mul=True) is None
    assert pdl_gemm.gemm_config(65, 12288, 2048, silu_mul=True) == (128, 64, 4, 4, 64)
    assert pdl_gemm.gemm_config(128, 12288, 2048, 2, silu_mul=True) is None
    # session 30: the decode kernel a PDL launch in every chained layer; the rotary signals it at each program's end
    # where the early signal lost (session 28's rule, early_signal), at once elsewhere
    assert all(pdl_gemm.attention_pdl(slots, 8, group) for slots in range(1, 129) for group in (1, 2, 4, 8))
    assert not pdl_gemm.attention_pdl(129, 8, 2) and not pdl_gemm.rotary_signal_late(129, 8, 4)  # past the chain
    late = [slots for slots in range(1, 129) if pdl_gemm.rotary_signal_late(slots, 8, 2)]
    assert late == list(range(9, 64))  # 72-504 rows (~one wave); at 512 with 2 query heads per KV head: early
    late4 = [slots for slots in range(1, 129) if pdl_gemm.rotary_signal_late(slots, 8, 4)]
    assert late4 == list(range(9, 128))  # with 4: late up to 1,023 rows too
    assert not pdl_gemm.rotary_signal_late(1, 64, 4) and pdl_gemm.rotary_signal_late(2, 64, 4)  # 64 / 128 rows
    for slots in range(1, 129):
        for group in (1, 2, 3, 4, 8):
            assert pdl_gemm.rotary_signal_late(slots, 8, group) == (not pdl_gemm.early_signal(slots, 8, group))
    # the GEMM signals its successor right after its wait up to 64 rows (session 30), after its K loop past them
    assert all(pdl_gemm.gemm_signal_early(rows) for rows in (1, 8, 33, 64))
    assert not pdl_gemm.gemm_signal_early(65) and not pdl_gemm.gemm_signal_early(128)
    monkeypatch.setattr(pdl_gemm, "GEMM_SIGNAL_EARLY", False)
    assert not pdl_gemm.gemm_signal_early(8)
    monkeypatch.setattr(pdl_gemm, "ROTARY_LATE", False)  # session 28's rule: the early signal, plain where it lost
    assert not any(pdl_gemm.rotary_signal_late(slots, 8, 4) for slots in range(1, 129))
    assert pdl_gemm.attention_pdl(1, 8, 2) and pdl_gemm.attention_pdl(8, 8, 2) and pdl_gemm.attention_pdl(64, 8, 2)
    assert not any(pdl_gemm.attention_pdl(slots, 8, 2) for slots in (9, 16, 32, 48, 63))  # ~one wave: slower
    assert pdl_gemm.attention_pdl(128, 8, 2) and not pdl_gemm.attention_pdl(129, 8, 2)  # past the chain's rows
    # more than 2 query heads per KV head: plain at 512-1,023 rows (session 28), PDL at <= 64 and >= 1,024
    assert pdl_gemm.attention_pdl(64, 8, 1) and not pdl_gemm.attention_pdl(64, 8, 3)
    assert not pdl_gemm.attention_pdl(64, 8, 4) and not pdl_gemm.attention_pdl(63, 8, 4)  # 504 rows: one wave
    assert not pdl_gemm.attention_pdl(127, 8, 4) and pdl_gemm.attention_pdl(128, 8, 4)
    assert pdl_gemm.attention_pdl(8, 8, 8) and pdl_gemm.attention_pdl(1, 64, 4)
    monkeypatch.setattr(pdl_gemm, "SHAPE_CHAIN", False)  # sessions 24-26: 64 rows at most
    assert not pdl_gemm.chain_rows(65) and pdl_gemm.gemm_config(128, 4096, 2048) is None
    assert not pdl_gemm.attention_pdl(128, 8, 2) and pdl_gemm.gemm_config(64, 4096, 2048) == (32, 256, 4, 4)
    assert pdl_gemm.shape_tiles(48, 6144, 2560) is None  # (chain_applies then refuses Qwen3-4B's at 33-64 rows)
    monkeypatch.setattr(pdl_gemm, "ATTN_PDL", False)
    monkeypatch.setattr(pdl_gemm, "ROTARY_LATE", True)
    assert not pdl_gemm.attention_pdl(64, 8, 2) and not pdl_gemm.rotary_signal_late(16, 8, 2)
    monkeypatch.setattr(pdl_gemm, "PDL_CHAIN", False)
    assert not pdl_gemm.chain_rows(8) and pdl_gemm.gemm_config(8, 4096, 2048) is None


def test_h200_tiles(monkeypatch):
    """``H200_TILES`` (session 40): on an H200 only (its name), in its rows' ranges, Qwen3-1.7B's gate_up with SiLU * up
    and its down take the deeper pipelines; every entry's tile divides its shape into >= 64 programs and lies within
    the width rule's rows; DEVICE_TILES off, another GPU or no device keep the rule's tiles."""
    names = {0: "NVIDIA H200", 1: "NVIDIA H100 80GB HBM3"}
    monkeypatch.setattr(pdl_gemm, "_is_h200", lambda index: "H200" in names[index])
    h200, h100 = torch.device("cuda", 0), torch.device("cuda", 1)
    for (rng, n, k, parts, silu), cfg in pdl_gemm.H200_TILES.items():
        assert 1 <= rng[0] <= rng[1] <= pdl_gemm.WIDTH_ROWS and len(cfg) == 4
        assert n % cfg[0] == 0 and k % (parts * cfg[1]) == 0 and parts * n // cfg[0] >= 64
        for rows in rng:
            assert pdl_gemm.gemm_config(rows, n, k, parts, silu, h200) == cfg
            assert pdl_gemm.gemm_config(rows, n, k, parts, silu, h100) == pdl_gemm.gemm_config(rows, n, k, parts, silu)
        assert pdl_gemm.gemm_config(rng[0] - 1, n, k, parts, silu, h200) == pdl_gemm.gemm_config(rng[0] - 1, n, k,
                                                                                                  parts, silu)
    assert pdl_gemm.gemm_config(64, 12288, 2048, silu_mul=True, device=h200) == (128, 128, 4, 4)
    assert pdl_gemm.gemm_config(16, 12288, 2048, silu_mul=True, device=h200) == (64, 128, 4, 3)  # the rule's
    assert pdl_gemm.gemm_config(64, 12288, 2048, device=h200) == (128, 128, 4, 3)  # the plain gate_up: the rule's
    assert pdl_gemm.gemm_config(64, 2048, 6144, 2, device=h200) == (32, 128, 4, 8)
    assert pdl_gemm.gemm_config(32, 2048, 6144, 2, device=h200) == (32, 256, 4, 4)  # (no gain at 32 rows)
    assert pdl_gemm.gemm_config(64, 12288, 2048, silu_mul=True, device="cpu") == (128, 128, 4, 3)
    assert pdl_gemm.gemm_config(65, 12288, 2048, silu_mul=True, device=h200) == (128, 64, 4, 4, 64)  # SHAPE_TILES'
    assert pdl_gemm.gemm_config(17, 12288, 2048, silu_mul=True, device=h200) == (128, 128, 4, 4)  # the ranges' ends
    assert pdl_gemm.gemm_config(33, 2048, 6144, 2, device=h200) == (32, 128, 4, 8)
    monkeypatch.setattr(pdl_gemm, "DEVICE_TILES", False)
    assert pdl_gemm.gemm_config(64, 12288, 2048, silu_mul=True, device=h200) == (128, 128, 4, 3)
    assert pdl_gemm.h200_name("NVIDIA H200") and pdl_gemm.h200_name("NVIDIA H200 NVL")
    assert not any(pdl_gemm.h200_name(name) for name in ("NVIDIA GH200 480GB", "NVIDIA H100 80GB HBM3", "NVIDIA H20",
                                                         "NVIDIA H2000"))


def test_is_h200_reads_the_device_name(monkeypatch):
    """``_is_h200`` asks the device's properties for its name once per index (cached) and matches it as an H200's."""
    names = {0: "NVIDIA H200", 1: "NVIDIA GH200 480GB", 2: "NVIDIA H100 80GB HBM3"}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(name=names[index]))
    pdl_gemm._is_h200.cache_clear()
    try:
        assert [pdl_gemm._is_h200(i) for i in range(3)] == [True, False, False]
    finally:
        pdl_gemm._is_h200.cache_clear()


class _LaunchSpy:
    """Stands in for ``pdl_gemm._gemm_kernel``: records each launch's tile keywords, then launches the kernel."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.launches.append({key: kw[key] for key in ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages")})
            return self.kernel[grid](*args, **kw)
        return launch


@needs_triton
def test_linear_pdl_and_chain_applies_ask_for_the_device_tile(monkeypatch):
    """``linear_pdl`` (no config given) and ``chain_applies`` pass the input's device to ``gemm_config``, so an H200
    launches ``H200_TILES``' tile: here a stand-in ``device_tiles`` answers for this test's device with a tile the
    rule would not take, and the launch is seen to use it."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    asked = []

    def tiles(m, n, k, parts, silu_mul, device):
        asked.append(torch.device(device).type if device is not None else None)
        return (32, 64, 4, 2) if device is not None and torch.device(device).type == dev else None
    monkeypatch.setattr(pdl_gemm, "device_tiles", tiles)
    spy = _LaunchSpy(pdl_gemm._gemm_kernel)
    monkeypatch.setattr(pdl_gemm, "_gemm_kernel", spy)
    x = torch.randn(20, 1, 256, device=dev).half()
    weight = (torch.randn(2048, 256, device=dev) * 0.05).half()
    out = pdl_gemm.linear_pdl(x, weight, pdl=False)
    assert spy.launches == [{"BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 4, "num_stages": 2}]
    ref = x.double() @ weight.double().T
    assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < 4e-3
    asked.clear()
    pdl_gemm.chain_applies(torch.zeros(20, 1, 2048, dtype=torch.float16, device=dev),
                           torch.zeros(4096, 2048, dtype=torch.float16, device=dev))  # a width the chain takes
    assert asked == [torch.device(dev).type]


def test_chain_applies_gates(monkeypatch):
    x = torch.zeros(4, 1, 2048, dtype=torch.bfloat16)
    weight = torch.zeros(4096, 2048, dtype=torch.bfloat16)
    assert not pdl_gemm.chain_applies(x, weight)  # CPU: no PDL device
    monkeypatch.setattr(pdl_gemm, "gemm_available", lambda device: True)
    assert pdl_gemm.chain_applies(x, weight)
    assert not pdl_gemm.chain_applies(x, weight, bias=torch.zeros(2048, dtype=torch.bfloat16))
    assert not pdl_gemm.chain_applies(x.float(), weight.float())  # fp32: cuBLAS
    assert not pdl_gemm.chain_applies(x, weight.half())
    assert pdl_gemm.chain_applies(torch.zeros(128, 2048, dtype=torch.bfloat16), weight)  # a SHAPE_TILES shape
    assert not pdl_gemm.chain_applies(torch.zeros(129, 2048, dtype=torch.bfloat16), weight)
    other_qkv = torch.zeros(2560, 2048, dtype=torch.bfloat16)  # a width the rule takes, a shape not past 64 rows
    assert pdl_gemm.chain_applies(x, other_qkv)
    assert not pdl_gemm.chain_applies(torch.zeros(65, 2048, dtype=torch.bfloat16), other_qkv)
    llama_qkv = torch.zeros(3072, 2048, dtype=torch.bfloat16)  # in the table at 65-128 rows (session 28)
    assert pdl_gemm.chain_applies(torch.zeros(65, 2048, dtype=torch.bfloat16), llama_qkv)
    assert not pdl_gemm.chain_applies(torch.zeros(129, 2048, dtype=torch.bfloat16), llama_qkv)
    assert not pdl_gemm.chain_applies(x, weight.T.contiguous().T)  # column-major
    assert not pdl_gemm.chain_applies(x, torch.zeros(4096, 4096, dtype=torch.bfloat16)[:, :2048])  # strided rows
    for (n, k), parts, silu in (
            ((6144, 2560), 1, False), ((19456, 2560), 1, True), ((2560, 4096), 2, False), ((2560, 9728), 2, False),
            ((6144, 4096), 1, False), ((24576, 4096), 1, True), ((4096, 4096), 2, False), ((4096, 12288), 2, False)):
        # Qwen3-4B's (the first four), 8B's shapes: chained at <= FEW_ROWS rows, then (SHAPE_TILES) up to 64
        w = torch.zeros(n, k, dtype=torch.bfloat16)
        for rows in (32, 33, 57, 64):
            assert pdl_gemm.chain_applies(torch.zeros(rows, 1, k, dtype=torch.bfloat16), w, parts=parts,
                                          silu_mul=silu), (n, k, rows)
        assert not pdl_gemm.chain_applies(torch.zeros(65, 1, k, dtype=torch.bfloat16), w, parts=parts,
                                          silu_mul=silu), (n, k, parts)
    assert not pdl_gemm.chain_applies(torch.zeros(8, 1, 4096, dtype=torch.bfloat16),
                                      torch.zeros(28672, 4096, dtype=torch.bfloat16))  # Llama-3-8B's gate_up
    assert not pdl_gemm.chain_applies(torch.zeros(4, 1, 2816, dtype=torch.bfloat16),
                                      torch.zeros(6144, 2816, dtype=torch.bfloat16))  # a width never measured
    assert pdl_gemm.chain_applies(x[..., :1024], weight[:, :1024].contiguous())  # Qwen3-0.6B's hidden
    assert not pdl_gemm.chain_applies(torch.zeros(4, 1, 4096, dtype=torch.bfloat16)[..., ::2], weight)  # x strided
    assert pdl_gemm.chain_applies(x, weight, parts=2)
    assert pdl_gemm.chain_applies(torch.zeros(4, 6144, dtype=torch.bfloat16), torch.zeros(2048, 6144,
                                  dtype=torch.bfloat16), parts=2)  # down
    assert not pdl_gemm.chain_applies(torch.zeros(4, 6144, dtype=torch.bfloat16), torch.zeros(4096, 6144,
                                      dtype=torch.bfloat16))  # 6,144 wide: measured in 2 slices only
    assert pdl_gemm.chain_applies(x, weight, silu_mul=True)
    assert not pdl_gemm.chain_applies(x, weight, parts=2, silu_mul=True)
    qkv_4b = torch.zeros(6144, 2560, dtype=torch.bfloat16)
    assert pdl_gemm.chain_applies(torch.zeros(40, 2560, dtype=torch.bfloat16), qkv_4b)
    monkeypatch.setattr(pdl_gemm, "SHAPE_CHAIN", False)  # session 26's chain: Qwen3-4B's at <= 32 rows only
    assert not pdl_gemm.chain_applies(torch.zeros(40, 2560, dtype=torch.bfloat16), qkv_4b)
    assert pdl_gemm.chain_applies(torch.zeros(32, 2560, dtype=torch.bfloat16), qkv_4b)
    assert not pdl_gemm.chain_applies(torch.zeros(128, 2048, dtype=torch.bfloat16), weight)
    monkeypatch.setattr(pdl_gemm, "SHAPE_CHAIN", True)
    monkeypatch.setattr(pdl_gemm, "SILU_EPILOGUE", False)
    assert not pdl_gemm.chain_applies(x, weight, silu_mul=True) and pdl_gemm.chain_applies(x, weight)
    monkeypatch.setattr(pdl_gemm, "SPLIT_CHAIN", False)
    assert not pdl_gemm.chain_applies(x, weight, parts=2) and pdl_gemm.chain_applies(x, weight)
    monkeypatch.setattr(pdl_gemm, "PDL_CHAIN", False)
    assert not pdl_gemm.chain_applies(x, weight) and not pdl_gemm.pdl_available("cpu")


def test_pdl_never_on_cpu_or_the_interpreter():
    assert not pdl_gemm.gemm_available("cpu") and not pdl_gemm.pdl_available("cpu")
    assert pdl_gemm.launch_options(False) == {} and pdl_gemm.launch_options(True) == {"launch_pdl": True}


def _chain(x, residual, norm_w, w_qkv, w_gu, pdl):
    """add_rms_norm -> qkv -> add_rms_norm -> gate_up -> silu_mul, the chain's kernels (pdl: as PDL launches), the
    MLP as with ``SILU_EPILOGUE`` off."""
    launch = {"pdl": True} if pdl else {}
    summed, normed = arn.add_rms_norm(x, residual, norm_w, 1e-6, **launch)
    qkv = pdl_gemm.linear_pdl(normed, w_qkv, pdl=pdl)
    summed, normed = arn.add_rms_norm(qkv[..., :x.shape[-1]], summed, norm_w, 1e-6, **launch)
    return sm.silu_mul(pdl_gemm.linear_pdl(normed, w_gu, pdl=pdl), **launch)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("rows", [1, 8, 64, 100, 128])  # 100, 128: SHAPE_TILES' row tiles
def test_cuda_chain_pdl_equals_plain_launches_in_a_graph(rows):
    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 2048, device="cuda", generator=gen).bfloat16()
    residual = torch.randn(rows, 2048, device="cuda", generator=gen).bfloat16()
    norm_w = torch.rand(2048, device="cuda", generator=gen).bfloat16() + 0.5
    w_qkv = (torch.randn(4096, 2048, device="cuda", generator=gen) * 0.02).bfloat16()
    w_gu = (torch.randn(12288, 2048, device="cuda", generator=gen) * 0.02).bfloat16()
    plain = _chain(x, residual, norm_w, w_qkv, w_gu, pdl=False)
    # against cuBLAS and torch's ops: within a rounding of the products' order
    summed, normed = arn.add_rms_norm(x, residual, norm_w, 1e-6)
    for w in (w_qkv, w_gu):
        ref = F.linear(normed, w)
        assert ((pdl_gemm.linear_pdl(normed, w, pdl=False).float() - ref.float()).abs().max()
                <= 2 * (ref.float().abs().max() * 2 ** -8)).item()
    outs = [_chain(x, residual, norm_w, w_qkv, w_gu, pdl=True)]  # eager PDL launches
    for _ in range(2):
        static = torch.empty_like(plain)
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            static.copy_(_chain(x, residual, norm_w, w_qkv, w_gu, pdl=True))
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static.copy_(_chain(x, residual, norm_w, w_qkv, w_gu, pdl=True))
        graph.replay()
        torch.cuda.synchronize()
        outs.append(static.clone())
    for out in outs:
        assert torch.equal(out, plain)  # PDL orders the kernels as plain launches do: the same values


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("rows", [17, 40, 64])
def test_cuda_device_tiles_against_cublas(rows):
    """On this GPU's tiles (an H200's ``H200_TILES`` where it has them, else the rule's): Qwen3-1.7B's gate_up with
    SiLU * up equals the GEMM's products through ``silu_mul`` bit for bit and cuBLAS's within a rounding, and down's
    2 K slices' partials equal ``split_k.linear_parts``' within fp32's reach."""
    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 2048, device="cuda", generator=gen).bfloat16()
    w_gu = (torch.randn(12288, 2048, device="cuda", generator=gen) * 0.02).bfloat16()
    cfg = pdl_gemm.gemm_config(rows, 12288, 2048, silu_mul=True, device=x.device)
    fused = pdl_gemm.linear_pdl(x, w_gu, pdl=False, silu_mul=True)
    assert torch.equal(fused, sm.silu_mul(pdl_gemm.linear_pdl(x, w_gu, pdl=False, config=cfg)))
    ref = sm.silu_mul(F.linear(x, w_gu)).float()
    assert ((fused.float() - ref).abs() <= 4 * ref.abs() * 2 ** -8 + 1e-3).all()
    act = fused
    w_down = (torch.randn(2048, 6144, device="cuda", generator=gen) * 0.02).bfloat16()
    parts = pdl_gemm.linear_pdl(act, w_down, pdl=False, parts=2)
    torch.testing.assert_close(parts, split_k.linear_parts(act, w_down, 2), rtol=1e-4, atol=1e-3)
    if pdl_gemm.h200_name(torch.cuda.get_device_name(x.device)):  # the H200's tiles are the ones launched
        spy = _LaunchSpy(pdl_gemm._gemm_kernel)
        pdl_gemm._gemm_kernel = spy
        try:
            pdl_gemm.linear_pdl(x, w_gu, pdl=False, silu_mul=True)
            pdl_gemm.linear_pdl(act, w_down, pdl=False, parts=2)
        finally:
            pdl_gemm._gemm_kernel = spy.kernel
        assert spy.launches[0]["num_stages"] == 4 and spy.launches[0]["BLOCK_N"] == 128
        assert spy.launches[1]["num_stages"] == (8 if rows >= 33 else 4)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("batch", [3, 16, 96])
def test_cuda_engine_chain_pdl_equals_plain_launches(monkeypatch, batch):
    """Two layers of Qwen3-1.7B's shapes, random weights: all four projections take the chain's GEMM (o and down in
    2 K slices but the last down; at batch 96 with ``SHAPE_TILES``' row tiles), and the engine's greedy tokens and
    logprobs with PDL launches equal those with the same kernels launched plainly, bit for bit (CUDA graphs,
    LongFlow); against cuBLAS's projections they agree up to a rounding's reach. Each decode step's rotary signals
    the decode kernel late where ``rotary_signal_late`` says so (the graphs' steps of 16 and 32 slots), early
    elsewhere."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=512, hidden_size=2048, intermediate_size=6144, num_hidden_layers=2,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=1024,
                      eos_token_id=None, bos_token_id=None, pad_token_id=0)
    model = Qwen3ForCausalLM(cfg).eval().to("cuda", torch.bfloat16)
    calls, kernel = [], pdl_gemm.linear_pdl
    launches = []  # (kernel, pdl) of the other kernels: add_rms_norm (with partials or not), silu_mul, rotary

    def recorded(x, weight, pdl=None, parts=1, silu_mul=False):
        calls.append((tuple(weight.shape), parts, pdl, silu_mul, x.numel() // x.shape[-1]))
        return kernel(x, weight, pdl=pdl, parts=parts, silu_mul=silu_mul)
    for module in ("kvroll.kernels.fused_qkv_rotary", "kvroll.kernels.fused_mlp", "kvroll.kernels.split_k"):
        monkeypatch.setattr(f"{module}.linear_pdl", recorded)
    import kvroll.kernels.fused_add_norm as fan
    import kvroll.kernels.fused_mlp as fmlp
    import kvroll.kernels.rotary as rot

    signals = []  # (rows, late_signal) of each decode step's rotary launched in the chain (its cache write)
    attends = []  # (rows, chain_pdl) of each decode step's decode kernel
    import kvroll.rollout.cache as cache_module
    decode = cache_module.decode_attention

    def decode_recorded(q, *args, **kw):
        attends.append((q.shape[0], kw.get("chain_pdl", False)))
        return decode(q, *args, **kw)
    monkeypatch.setattr(cache_module, "decode_attention", decode_recorded)

    def recorder(name, fn, partials=None):
        def call(*args, **kw):
            launches.append((name + ("_partials" if partials and partials(*args) else ""), kw.get("pdl", False)))
            if name == "rotary" and kw.get("write") is not None and kw.get("pdl"):
                signals.append((args[1].shape[0], kw.get("late_signal", False)))
            return fn(*args, **kw)
        return call
    monkeypatch.setattr(fan, "add_rms_norm", recorder("add_rms_norm", fan.add_rms_norm,
                                                      lambda x, r, *rest: x.dim() == r.dim() + 1))
    monkeypatch.setattr(fmlp, "silu_mul", recorder("silu_mul", fmlp.silu_mul))
    monkeypatch.setattr(rot, "rotary", recorder("rotary", rot.rotary))
    params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = [[5, 9, 33, 7, 81], [2, 200, 14], [7] * 30]
    if batch > len(prompts):
        gen = torch.Generator().manual_seed(batch)
        prompts += [torch.randint(1, 512, (int(n),), generator=gen).tolist()
                    for n in torch.randint(3, 31, (batch - len(prompts),), generator=gen)]
    runs = {}
    for name, chain, launch in (("pdl", True, True), ("plain", True, False), ("cublas", False, True)):
        monkeypatch.setattr(pdl_gemm, "PDL_CHAIN", chain)
        monkeypatch.setattr(pdl_gemm, "PDL_LAUNCH", launch)
        calls.clear()
        launches.clear()
        signals.clear()
        attends.clear()
        engine = RolloutEngine(model, compression=CompressionConfig(policy="longflow", budget=32), max_batch=batch)
        assert engine.cuda_graphs
        runs[name] = engine.generate(prompts, params)
        if chain:  # qkv, gate_up whole; o, down in 2 slices
            assert {((4096, 2048), 1), ((12288, 2048), 1), ((2048, 2048), 2), ((2048, 6144), 2)} \
                <= {c[:2] for c in calls}
            assert {c[2] for c in calls} == {launch}
            assert {c[3] for c in calls if c[0] == (12288, 2048)} == {True}  # SiLU * up in gate_up's epilogue
            assert max(c[4] for c in calls) >= batch  # every row in one chained step (96: SHAPE_TILES')
        else:
            assert not calls
        kinds = {"add_rms_norm_partials", "rotary"}  # o and down always give partials here
        # decode steps (recorded while their graphs are captured); silu_mul: the prefill's (and cuBLAS's steps')
        assert kinds | {"silu_mul"} <= {k for k, _ in launches}
        pdl_kinds = {k for k, p in launches if p}
        assert pdl_kinds == (kinds if chain and launch else set()), pdl_kinds
        assert all(late == pdl_gemm.rotary_signal_late(rows, 8, 2) for rows, late in signals), signals
        assert bool(signals) == (chain and launch) and (not signals or max(r for r, _ in signals) == batch)
        # the decode kernel a PDL launch at every chained step (after the rotary's late signal at 128-511 rows)
        assert {slots for slots, _ in attends} == set(batch_sizes(batch))
        assert {pdl for _, pdl in attends} == {chain and launch}, attends
        # the late signal at the graphs' 16- and 32-slot steps (128 and 256 rows) of batches 16 and 96
        assert {rows for rows, late in signals if late} == ({16, 32} & set(batch_sizes(batch)) if chain and launch
                                                             else set())
    for a, b in zip(runs["pdl"], runs["plain"]):
        assert a.token_ids == b.token_ids
        assert torch.equal(torch.tensor(a.logprobs), torch.tensor(b.logprobs))
    early = 0  # rows whose greedy tokens leave cuBLAS's within 4 tokens (random weights: near-ties may flip)
    for a, b in zip(runs["pdl"], runs["cublas"]):
        n = next((i for i, (s, t) in enumerate(zip(a.token_ids, b.token_ids)) if s != t), len(a.token_ids))
        early += n < 4
        torch.testing.assert_close(torch.tensor(a.logprobs[:n]), torch.tensor(b.logprobs[:n]), atol=0.05, rtol=0.05)
    assert early <= len(prompts) // 20, early


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the chain's GEMM on CPU needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("epilogue", [True, False])
def test_engine_wiring_of_the_chain_on_cpu(monkeypatch, epilogue):
    """The chain's GEMM on CPU under the interpreter, its launches plain (the interpreter has no PDL): a tiny fp16
    Qwen3 whose qkv (2,048 x 256) and gate_up (4,096 x 256) take it. The fused layer chains both (the MLP told so
    by the layer, with PDL launches off, as on a GPU with ``PDL_LAUNCH = False``), gate_up with SiLU * up in its
    epilogue or, ``SILU_EPILOGUE`` off, followed by ``silu_mul``; the greedy run equals the one with cuBLAS's place
    taken by torch's matmul up to a rounding."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from kvroll.kernels import fused_add_norm, fused_mlp, fused_qkv_rotary

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=256, hidden_size=256, intermediate_size=2048, num_hidden_layers=2,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=64, max_position_embeddings=512,
                      eos_token_id=None, bos_token_id=None, pad_token_id=0)
    model = Qwen3ForCausalLM(cfg).eval().half()
    for module in (fused_mlp, fused_qkv_rotary, fused_add_norm):
        monkeypatch.setattr(module, "kernel_on_cpu", True)
    monkeypatch.setattr(pdl_gemm, "gemm_available", lambda device: True)
    monkeypatch.setattr(pdl_gemm, "PDL_LAUNCH", False)
    monkeypatch.setattr(pdl_gemm, "CHAIN_WIDTHS", {1: (256,), 2: ()})  # the tiny model's width
    monkeypatch.setattr(pdl_gemm, "SILU_EPILOGUE", epilogue)
    calls, kernel = [], pdl_gemm.linear_pdl
    silu_calls, silu_kernel = [], fused_mlp.silu_mul

    def recorded_silu(gate_up, pdl=False):
        silu_calls.append((tuple(gate_up.shape), pdl))
        return silu_kernel(gate_up, pdl=pdl)
    monkeypatch.setattr(fused_mlp, "silu_mul", recorded_silu)

    def recorded(x, weight, pdl=None, parts=1, silu_mul=False):
        calls.append((tuple(weight.shape), parts, pdl, silu_mul))
        return kernel(x, weight, pdl=pdl, parts=parts, silu_mul=silu_mul)
    for module in (fused_mlp, fused_qkv_rotary):
        monkeypatch.setattr(module, "linear_pdl", recorded)
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    runs = {}
    for chain in (True, False):
        monkeypatch.setattr(pdl_gemm, "PDL_CHAIN", chain)
        calls.clear()
        silu_calls.clear()
        engine = RolloutEngine(model, compression=CompressionConfig(policy="longflow", budget=16), max_batch=2,
                               fused_mlp=True, fused_qkv_rotary=True, fused_add_norm=True)
        runs[chain] = engine.generate([[5, 9, 33, 7, 81], [2, 200, 14]], params)
        # qkv, and gate_up (with SiLU * up in its epilogue, or silu_mul after it)
        assert set(calls) == ({((2048, 256), 1, False, False), ((4096, 256), 1, False, epilogue)} if chain else set())
        decode_silu = [c for c in silu_calls if c[0][-2] == 1]  # [slots, 1, 2I]: decode steps (prefills: [B, S, 2I])
        assert len(decode_silu) == (0 if chain and epilogue else 2 * 7), len(decode_silu)  # 2 layers, 7 steps
    for a, b in zip(runs[True], runs[False]):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=5e-3, rtol=5e-3)
