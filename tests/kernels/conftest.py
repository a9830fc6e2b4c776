"""Kernel-test set-up: make Triton 3.6's interpreter run loops with tensor bounds under NumPy >= 2.3.

The interpreter (``TRITON_INTERPRET=1``) holds scalars as 1-element arrays and converts a loop bound with
``int(array)``, which NumPy 2.3 rejects for arrays of one dimension; compiled kernels are unaffected.

And what the tests of the decode-step fusion switches (``kvroll.kernels.fusions.FUSIONS``) share: their tiny models and
greedy runs, and ``kernel_on_cpu``, the fixture that takes a switch's fused path on CPU and records its kernel's calls.
"""
import importlib
import os

import pytest
import torch

from kvroll import RolloutEngine, SamplingParams
from tests.conftest import tiny_model

ALL_OFF = dict(fused_mlp=False, fused_qkv_rotary=False, fused_add_norm=False, fused_sampling=False)  # HF's modules
# (CUDA turns the first three on by default since session 10: a test of one switch names the others off)

if os.environ.get("TRITON_INTERPRET") == "1":
    try:
        from triton.runtime import interpreter as _interp
    except ImportError:  # pragma: no cover - no Triton: the kernel tests skip themselves
        _interp = None
    if _interp is not None and not getattr(_interp, "_kvroll_index_patch", False):
        _patch_tensor = _interp._patch_lang_tensor

        def _patch_lang_tensor(tensor, scope):
            _patch_tensor(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

        _interp._patch_lang_tensor = _patch_lang_tensor
        _interp._kvroll_index_patch = True


# The decode-step fusion switches (kvroll.kernels.fusions.FUSIONS): their tests' models, runs and kernel hook.
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]
PROMPTS = [[5, 9, 33, 7, 81], [2, 200, 14]]
COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=512, eos_token_id=None,
              bos_token_id=None, pad_token_id=0)


def model_of(family: str, seed: int = 0, window: int | None = None):
    """A tiny random model: ``tiny_model``'s Llama / Qwen3, Qwen2 with random (non-zero) q/k/v biases, Mistral;
    ``window`` sets a sliding window on every layer (Mistral, Qwen2)."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if family in ("llama", "qwen3"):
        return tiny_model(family, seed=seed)
    torch.manual_seed(seed)
    if family == "mistral":
        model = MistralForCausalLM(MistralConfig(sliding_window=window, **COMMON))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(use_sliding_window=window is not None, sliding_window=window,
                                             max_window_layers=0, **COMMON))
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_()
    model.generation_config.eos_token_id = None
    return model.eval()


def generate(model, policy, prompts=PROMPTS, params=GREEDY, **switches):
    engine = RolloutEngine(model, compression=policy, max_batch=2, **switches)
    return engine, engine.generate(prompts, params)


def assert_same_greedy(on, off):
    assert [r.token_ids for r in on] == [r.token_ids for r in off]
    for a, b in zip(on, off):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=1e-4)


# switch -> (the kernel its module calls, what a call of it is recorded as)
KERNEL_CALLS = {
    "fused_mlp": ("silu_mul", lambda gate_up, pdl=False: tuple(gate_up.shape)),
    "fused_qkv_rotary": ("rotary", lambda q, k, cos, sin, pdl=False, **norms: (tuple(q.shape), tuple(sorted(norms)))),
    "fused_add_norm": ("add_rms_norm", lambda x, r, w, eps, pdl=False: tuple(x.shape)),
}


def record_kernel_on_cpu(monkeypatch, fusion: str) -> list:
    """Switch ``fusion``'s fused path on for CPU no-grad inputs too (its module's ``kernel_on_cpu``; the kernel runs
    under ``TRITON_INTERPRET=1``) and return the list of its kernel's calls: ``fused_mlp``: the joined [gate | up]
    shape given to ``silu_mul``; ``fused_qkv_rotary``: the q shape given to ``rotary`` and the names of the norms,
    ((slots, 1, Hq, D), ("k_norm", "q_norm") or ()); ``fused_add_norm``: the x shape given to ``add_rms_norm``.
    The kernels then run on CPU tensors, which only the interpreter can: elsewhere (a GPU machine without
    ``TRITON_INTERPRET=1``, where they would get CPU pointers) the test skips; its ``gpu`` twins run the paths on CUDA."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the fused path on CPU tensors runs under TRITON_INTERPRET=1 only")
    module = importlib.import_module(f"kvroll.kernels.{fusion}")
    name, record = KERNEL_CALLS[fusion]
    calls, kernel = [], getattr(module, name)

    def recorded(*args, **kwargs):
        calls.append(record(*args, **kwargs))
        return kernel(*args, **kwargs)

    monkeypatch.setattr(module, "kernel_on_cpu", True)
    monkeypatch.setattr(module, name, recorded)
    return calls


@pytest.fixture
def fusion(request):
    """The switch a test module is about (its ``FUSION``); the switch-generic tests parametrize this name."""
    return request.module.FUSION


@pytest.fixture
def kernel_on_cpu(monkeypatch, fusion):
    """``record_kernel_on_cpu`` for the test's switch: its fused path on CPU too, and the calls of its kernel."""
    return record_kernel_on_cpu(monkeypatch, fusion)
