"""What each decode-step fusion switch (``FUSIONS``: ``fused_mlp``, ``fused_qkv_rotary``, ``fused_add_norm``) must do
alike, one test per behaviour parametrized over the switches: auto by default (off on CPU) and validated, the installed model and
an engine with the switch freed without the garbage collector, the greedy tokens past a sliding window, after
``load_weights`` (the two switches that join weights) and with the switches on together. Each fused kernel's own
checks (its install, its fp32 reference, odd shapes, the kernel calls of a decode step, the GPU tests) are in
``test_<switch>.py``.

CPU (CI): ``kernel_on_cpu`` (tests/kernels/conftest.py) widens the parametrized switch's fused path to CPU tensors;
the kernels run under ``TRITON_INTERPRET=1``.
"""
import os

import pytest
import torch

from kvroll import CompressionConfig, RolloutEngine, SamplingParams
from kvroll.kernels import add_rms_norm, rotary, silu_mul
from kvroll.kernels.fusions import FUSIONS
from tests.conftest import freed_without_gc
from tests.kernels.conftest import (FAMILIES, GREEDY, PROMPTS, assert_same_greedy, generate, model_of,
                                    record_kernel_on_cpu)

triton_ok = all(k.triton is not None for k in (silu_mul, rotary, add_rms_norm)) and \
    (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")
needs_triton = pytest.mark.skipif(not triton_ok, reason="needs Triton on a GPU or TRITON_INTERPRET=1")
POLICIES = {"full": CompressionConfig("full"), "longflow": CompressionConfig("longflow", budget=12)}
SWAPS = {  # switch -> the module of a decoder layer it swaps for a fused subclass
    "fused_mlp": lambda layer: layer.mlp,
    "fused_qkv_rotary": lambda layer: layer.self_attn,
    "fused_add_norm": lambda layer: layer,
}
JOINING = ["fused_mlp", "fused_qkv_rotary"]  # the switches that join projection weights into one matmul


def swapped(model, fusion):
    return [SWAPS[fusion](layer) for layer in model.model.layers]


@pytest.mark.parametrize("fusion,family,hf_class", [("fused_mlp", "llama", "LlamaMLP"),
                                                    ("fused_qkv_rotary", "qwen3", "Qwen3Attention"),
                                                    ("fused_add_norm", "qwen2", "Qwen2DecoderLayer")])
def test_engine_switch_is_auto_by_default_off_on_cpu_and_validated(fusion, family, hf_class):
    """The default (None) is off for a CPU model: its modules stay HF's classes; on CUDA it is on
    (``resolve_fusions``, below)."""
    model = model_of(family)
    engine = RolloutEngine(model, compression=CompressionConfig("full"), max_batch=2)
    assert getattr(engine, fusion) is False and all(type(m).__name__ == hf_class for m in swapped(model, fusion))
    for bad in (1, "yes", 0.0):
        with pytest.raises(ValueError, match=fusion):
            RolloutEngine(model_of("llama"), max_batch=2, **{fusion: bad})


@pytest.mark.parametrize("fusion,family", [("fused_mlp", "llama"), ("fused_qkv_rotary", "qwen2"),
                                           ("fused_add_norm", "mistral")])
def test_installed_model_is_freed_without_the_garbage_collector(fusion, family):
    def build():
        model = model_of(family)
        FUSIONS[fusion][0](model)
        return model, [swapped(model, fusion)[0]]

    assert freed_without_gc(build)


@needs_triton
@pytest.mark.parametrize("fusion", FUSIONS)
def test_engine_with_the_switch_is_freed_without_the_garbage_collector(fusion, kernel_on_cpu):
    def build():
        engine = RolloutEngine(model_of("qwen3"), max_batch=2, **{fusion: True})
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True))
        return engine, [swapped(engine.model, fusion)[0]]

    assert freed_without_gc(build)


@needs_triton
@pytest.mark.parametrize("family", ["mistral", "qwen2"])
@pytest.mark.parametrize("fusion", FUSIONS)
def test_sliding_window_ring_unchanged_by_the_switch(fusion, family, kernel_on_cpu):
    """``full`` past a window of 8 (the ring of the last W positions) decodes through the fused path too (the
    keywords still reach the attention)."""
    params = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
    _, off = generate(model_of(family, window=8), CompressionConfig("full"), params=params)
    engine, on = generate(model_of(family, window=8), CompressionConfig("full"), params=params, **{fusion: True})
    assert engine.cache.capacity == 8 and kernel_on_cpu
    assert_same_greedy(on, off)


@needs_triton
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
@pytest.mark.parametrize("fusion", JOINING)
def test_engine_load_weights_reaches_the_fused_path(fusion, family, kernel_on_cpu):
    """After ``load_weights`` of another model's weights the fused engine generates what that model generates (the
    weights reach the joined matmul)."""
    prompts = PROMPTS[:1]
    engine = RolloutEngine(model_of(family, seed=0), max_batch=1, **{fusion: True})
    before = engine.generate(prompts, GREEDY)[0].token_ids
    other = model_of(family, seed=1)
    assert engine.load_weights(other.named_parameters()) == len(list(other.parameters()))
    after = engine.generate(prompts, GREEDY)[0].token_ids
    expected = RolloutEngine(model_of(family, seed=1), max_batch=1).generate(prompts, GREEDY)[0].token_ids
    assert after == expected and after != before and kernel_on_cpu


TOGETHER = [pytest.param(tuple(FUSIONS), family, policy, id=f"all-{family}-{policy}")
            for family in FAMILIES for policy in POLICIES]
TOGETHER += [pytest.param(tuple(JOINING), family, "longflow", id=f"mlp+qkv-{family}-longflow")
             for family in ("qwen2", "qwen3")]


@needs_triton
@pytest.mark.parametrize("fusions,family,policy", TOGETHER)
def test_switches_on_together_equal_off(fusions, family, policy, monkeypatch):
    """All three switches on, and the two that join weights (MLP, QKV) without the third: every swapped module fused,
    every kernel called, the greedy tokens and logprobs of no switch."""
    calls = {fusion: record_kernel_on_cpu(monkeypatch, fusion) for fusion in fusions}
    _, off = generate(model_of(family), POLICIES[policy])
    engine, on = generate(model_of(family), POLICIES[policy], **dict.fromkeys(fusions, True))
    for fusion in fusions:
        assert getattr(engine, fusion) and calls[fusion]
        assert all(type(m).__name__.startswith("Fused") for m in swapped(engine.model, fusion))
    assert_same_greedy(on, off)


def test_auto_switches_resolve_on_for_cuda_only_and_explicit_ones_stay():
    from kvroll.kernels.fusions import resolve_fusions

    auto = {name: None for name in FUSIONS}
    assert resolve_fusions(auto, "cuda") == {name: True for name in FUSIONS}
    assert resolve_fusions(auto, torch.device("cuda", 1)) == {name: True for name in FUSIONS}
    assert resolve_fusions(auto, "cpu") == {name: False for name in FUSIONS}
    forced = {"fused_mlp": False, "fused_qkv_rotary": True, "fused_add_norm": None}
    assert resolve_fusions(forced, "cuda") == {"fused_mlp": False, "fused_qkv_rotary": True, "fused_add_norm": True}
    assert resolve_fusions(forced, "cpu") == {"fused_mlp": False, "fused_qkv_rotary": True, "fused_add_norm": False}
