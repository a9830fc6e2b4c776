"""The decoder layer of a decode step with its two residual adds fused into the RMSNorms that follow them.

HF's ``LlamaDecoderLayer`` / ``Qwen2DecoderLayer`` / ``Qwen3DecoderLayer`` / ``MistralDecoderLayer`` run (the four
forwards are the same code in transformers 5.17):

    residual = hidden; hidden = input_layernorm(hidden); hidden, _ = self_attn(hidden, ...)
    hidden = residual + hidden; residual = hidden; hidden = post_attention_layernorm(hidden)   # add + norm
    hidden = mlp(hidden); hidden = residual + hidden

``install_fused_add_norm(model)`` swaps each such layer's class to a subclass (``FusedQwen3DecoderLayer``) whose
forward, for an engine decode step (a ``kvroll_cache`` in decode mode) on CUDA inputs under no-grad (and, for
tests, CPU inputs when ``kernel_on_cpu`` is set under ``TRITON_INTERPRET=1``), runs the middle line as one
``add_rms_norm`` kernel, reading the norm's weight and epsilon at each call (no copy of any weight, so ``.to``,
``deepcopy`` and weight syncs need nothing). The MLP's residual add goes into the next layer's ``input_layernorm``
the same way: every layer but the last returns its MLP output alone and leaves the residual stream on the step's
cache object (``kvroll_cache``); the next layer (which such a step always runs next: HF's layer loop) sums the two
in its ``add_rms_norm``; the last layer adds as HF does, so the model's final norm gets HF's hidden state. Every keyword (attention mask, position ids and embeddings, the cache,
``kvroll_cache``, ``use_cache``) reaches ``self_attn`` exactly as HF passes it; the attention handles its own
sliding window. Prefill, training and any other call run HF's own forward.

    n = install_fused_add_norm(model)   # the number of decoder layers patched; 28 on Qwen3-1.7B

Split-K (``kvroll/kernels/split_k.py``): where the attention (``fused_qkv_rotary``) or the MLP (``fused_mlp``) is
kvroll's fused module too, the layer asks it for the o / down projection's fp32 partial sums over 2 K slices (one
batched cuBLAS call with twice the programs, at the rows ``split_k_parts`` measured faster; in the chain of PDL
launches, ``kvroll.kernels.pdl_gemm.linear_pdl``) and its ``add_rms_norm`` adds them, rounded once as the
projection's output; the last layer's down projection stays whole. Where the layer's qkv and gate_up take the
chain's GEMM (``_chained``), the two ``add_rms_norm`` calls are PDL launches and the MLP is told to chain its gate_up
too.

Numerics: ``add_rms_norm`` rounds as HF's add and ``rms_norm`` (see its module); on a GPU its output is the unfused
path's (HF's add, then the fused RMSNorm kernel) bit for bit. A split-K projection's output is ``F.linear``'s with
its K reduction in another order: equal up to a rounding. ``RolloutEngine(fused_add_norm=None)``, the default,
enables it for a model on CUDA (measured faster, docs/benchmarks/engine_throughput.md), not on CPU; True / False
force it.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules.module import _global_forward_hooks

from kvroll.hf_compat import CACHE_KW, pop_cache
from kvroll.kernels.add_rms_norm import add_rms_norm, triton
from kvroll.kernels.class_swap import ClassSwap, engine_decode_step
from kvroll.kernels.fused_mlp import _FUSED as _GATE_UP
from kvroll.kernels.fused_qkv_rotary import _FUSED as _QKV
from kvroll.kernels.pdl_gemm import chain_applies, pdl_available
from kvroll.kernels.rmsnorm import _is_hf_rmsnorm
from kvroll.kernels.split_k import split_k_parts

kernel_on_cpu = False  # tests: take the fused path on CPU tensors too (needs TRITON_INTERPRET=1)
FAMILIES = ("LlamaDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer", "MistralDecoderLayer")


def _fused_forward(self, hidden_states, attention_mask=None, position_ids=None, use_cache=False,
                   position_embeddings=None, **kwargs):
    past_key_values, kwargs = pop_cache(kwargs)  # ``past_key_values`` or (transformers >= 5.24) ``cache``
    if not engine_decode_step(hidden_states, kwargs, kernel_on_cpu):
        return super(type(self), self).forward(
            hidden_states, attention_mask=attention_mask, position_ids=position_ids, **{CACHE_KW: past_key_values},
            use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)  # the HF class's own forward
    step, index = kwargs["kvroll_cache"], self.self_attn.layer_idx
    norm = self.input_layernorm
    # the adds + norms in the chain of PDL launches (kvroll.kernels.pdl_gemm), where this step's layer is chained
    stream = hidden_states if index == 0 else step.kvroll_residual
    chained = _chained(self, stream)
    pdl = chained and pdl_available(stream.device)
    if index == 0:  # the embeddings: nothing pending (a step that raised part-way leaves nothing behind either)
        residual, normed = hidden_states, norm(hidden_states)
    else:  # hidden_states is the previous layer's MLP output; its residual stream waits on the step's cache
        residual, normed = add_rms_norm(hidden_states, step.kvroll_residual, norm.weight, norm.variance_epsilon,
                                        pdl=pdl)
    rows = residual.numel() // residual.shape[-1]
    o_parts = _parts(self.self_attn, _QKV, "o_proj", rows, "o")  # split-K partials for the add below (split_k.py)
    asks = {"kvroll_chain": chained} if hasattr(self.self_attn, _QKV) else {}  # kvroll's attention follows the layer
    if o_parts > 1:
        asks["kvroll_o_parts"] = o_parts
    hidden_states, _ = self.self_attn(
        hidden_states=normed, attention_mask=attention_mask, position_ids=position_ids,
        **{CACHE_KW: past_key_values}, use_cache=use_cache, position_embeddings=position_embeddings, **kwargs,
        **asks)
    norm = self.post_attention_layernorm
    residual, hidden_states = add_rms_norm(hidden_states, residual, norm.weight, norm.variance_epsilon, pdl=pdl)
    last = index == self.self_attn.config.num_hidden_layers - 1
    down_parts = 1 if last else _parts(self.mlp, _GATE_UP, "down_proj", rows, "down")
    mlp_kw = {"kvroll_down_parts": down_parts} if down_parts > 1 else {}
    if chained and hasattr(self.mlp, _GATE_UP):  # kvroll's fused MLP: gate_up (with SiLU * up) in the chain
        mlp_kw["kvroll_chain"] = True
    out = self.mlp(hidden_states, **mlp_kw)
    if last:
        step.kvroll_residual = None
        return residual + out  # HF's hidden state, for the model's final norm
    step.kvroll_residual = residual
    return out  # the MLP's output, or its down projection's fp32 partials [P, B, 1, H]: the next add_rms_norm's


def _chained(layer, x: torch.Tensor) -> bool:
    """Whether this decode step runs ``layer`` as the chain (``kvroll.kernels.pdl_gemm``): its attention is kvroll's
    fused module, the chain's GEMM takes its joined qkv weight at x's rows (x [..., H], the residual stream: shape,
    dtype, rows) and, where the MLP is kvroll's fused one, its joined gate_up too (with SiLU * up in the epilogue or
    plain, as the MLP asks). A model sharing only its attention's shapes with a measured one (Llama-3-8B's qkv and o
    are Qwen3-8B's, its MLP's are not) keeps cuBLAS and plain launches: such a mixed layer was never measured. Its
    kernels are PDL launches where ``pdl_available`` too."""
    fused = getattr(layer.self_attn, _QKV, None)
    if fused is None or not chain_applies(x, *fused):
        return False
    gate_up = getattr(layer.mlp, _GATE_UP, None)
    return gate_up is None or chain_applies(x, *gate_up, silu_mul=True) or chain_applies(x, *gate_up)


def _parts(module, fused_attr: str, proj: str, rows: int, kind: str) -> int:
    """K slices for ``module``'s projection ``proj`` where ``module`` is kvroll's fused swap (it alone takes the
    keyword that asks for them) with no forward hook (a hook would see the partials as its output), in half precision
    on a GPU, per ``split_k_parts``; 1 otherwise."""
    linear = getattr(module, proj, None)
    if not hasattr(module, fused_attr) or not isinstance(linear, nn.Linear) or module._forward_hooks \
            or module._forward_pre_hooks or _global_forward_hooks:
        return 1
    if linear.weight.is_cuda and linear.weight.dtype not in (torch.float16, torch.bfloat16):
        return 1  # fp32 on a GPU: correct but not measured
    return split_k_parts(rows, linear.out_features, linear.in_features, kind)


_SWAP = ClassSwap(_fused_forward)


def _is_hf_decoder_layer(module: nn.Module) -> bool:
    """One of HF's four decoder layers, its two norms HF RMSNorms (fused or not)."""
    return type(module).__name__ in FAMILIES and _is_hf_rmsnorm(getattr(module, "post_attention_layernorm", None)) \
        and _is_hf_rmsnorm(getattr(module, "input_layernorm", None))


def install_fused_add_norm(model: nn.Module) -> int:
    """Fuse every HF decoder layer's two adds + norms for CUDA no-grad decode steps; returns how many.

    A second call patches nothing; without Triton nothing is patched. A class swap rather than a bound method on
    the instance, which would be a reference cycle keeping a dropped engine's weights until gc runs.
    """
    if triton is None:
        return 0
    return _SWAP.install(model, _is_hf_decoder_layer)
