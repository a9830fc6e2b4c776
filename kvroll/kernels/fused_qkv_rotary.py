"""The attention prologue of a decode step in two kernels: one QKV matmul, then (Qwen3: q_norm, k_norm and) rotary.

HF's ``LlamaAttention`` / ``Qwen2Attention`` / ``Qwen3Attention`` / ``MistralAttention`` project q, k and v with
three matmuls of the same input (Qwen2: with biases), run Qwen3's ``q_norm`` / ``k_norm`` per head, then
``apply_rotary_pos_emb`` as ~10 small elementwise kernels. ``install_fused_qkv_rotary(model)`` gives each such
module one joined weight [Hq*D + 2*Hkv*D, H] whose row blocks ARE ``q_proj.weight``, ``k_proj.weight`` and
``v_proj.weight`` (the parameters' storage becomes views into it; the Parameter objects, their names and
``requires_grad`` stay), so an in-place ``param.copy_`` (``RolloutEngine.load_weights``, the weight sync's
``unpack``) updates the joined weight, and captured CUDA graphs stay valid. Biases are joined the same way.

    n = install_fused_qkv_rotary(model)   # the number of attention modules patched; 28 on Qwen3-1.7B
    model(..., kvroll_cache=cache)        # a CUDA no-grad decode step: x @ [Wq; Wk; Wv]^T -> (norms +) rotary

The decode path: ``F.linear`` against the joined weight (in a chained step the Triton GEMM of
``kvroll.kernels.pdl_gemm``, and the rotary kernel a PDL launch), the split into q/k/v as views, one ``rotary``
kernel for q and k with HF's cos/sin of the step reading q and k straight from the joined row (Qwen3: given q_norm's and
k_norm's weights and eps, the same program normalises each head first: no copy of the strided slices, no norm
launch) which, given kvroll's cache (``CompressedKVCache.rotary_write``), also writes the rotated keys and the
values into it (the cache write's kernel folded in); then the attention interface exactly as HF's forward calls it. Like ``fused_mlp``
the install is a class swap to a subclass of the HF class (``FusedQwen3Attention``) whose forward takes that path
only for a decode step of the engine (a ``kvroll_cache`` in decode mode) on CUDA inputs under no-grad (and, for
tests, CPU inputs when ``kernel_on_cpu`` is set under ``TRITON_INTERPRET=1``); prefill, training and any other call
run HF's own forward on the same weights. If a parameter no longer lies in the joined weight (its ``.data`` was
replaced, e.g. by ``module.to(...)`` after the install, or the module is a ``copy.deepcopy``) the module takes HF's
forward: correct, just not fused. Install on the model as it will run.

Numerics: ``rotary`` rounds as HF, its folded norms as ``rms_norm`` (see ``rotary.py``); the one matmul of
N = (Hq + 2 Hkv) D columns may accumulate in another order than three (cuBLAS picks its algorithm by shape), so on a
GPU q/k/v can differ from HF's by a rounding. ``RolloutEngine(fused_qkv_rotary=None)``, the default, enables it for a
model on CUDA (measured faster, docs/benchmarks/engine_throughput.md), not on CPU; True / False force it.

``kvroll_o_parts`` (> 1, passed only by the fused decoder layer, ``fused_add_norm``): the o projection, if a plain
bias-free ``Linear``, returns its fp32 partial sums over that many K slices (``kvroll.kernels.split_k``) for the
layer's ``add_rms_norm`` to add; it is removed from the keywords before anything else sees them. ``kvroll_chain``
(passed by the fused decoder layer too, its ``_chained``): False keeps qkv, the rotary kernel and o out of the PDL
chain whatever their shapes (a layer whose MLP the chain does not take); without it the qkv weight decides.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvroll.hf_compat import CACHE_KW, pop_cache
from kvroll.kernels.class_swap import ClassSwap, engine_decode_step, join_projections, joinable, views_intact
from kvroll.kernels.pdl_gemm import chain_applies, linear_pdl, pdl_available
from kvroll.kernels.rotary import rotary, triton
from kvroll.kernels.split_k import project

kernel_on_cpu = False  # tests: take the fused path on CPU tensors too (needs TRITON_INTERPRET=1)
_FUSED = "_kvroll_qkv"  # the instance attribute holding (weight [Nq + 2 Nkv, H], bias [Nq + 2 Nkv] or None)
FAMILIES = ("LlamaAttention", "Qwen2Attention", "Qwen3Attention", "MistralAttention")  # forwards this mirrors
_PROJECTIONS = ("q_proj", "k_proj", "v_proj")


def _views_intact(module: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """q/k/v_proj still read their row blocks of the joined buffers (host-side pointer checks, no sync)."""
    return views_intact(module, _PROJECTIONS, weight, bias)


def _sliding_window(module: nn.Module):
    """The ``sliding_window`` HF's forward passes: Qwen2/Qwen3 per layer, Mistral from the config, Llama none."""
    return getattr(module, "sliding_window", getattr(module.config, "sliding_window", None))


def _takes_chain(hidden_states, weight, bias, layer_chained: bool | None) -> bool:
    """Whether qkv, the rotary kernel and o join the PDL chain (pdl_gemm.py): where the chain's GEMM takes the
    joined qkv weight and the decoder layer, when it says (``fused_add_norm``: ``kvroll_chain``, its ``_chained``,
    which also asks for the MLP's gate_up), chains the layer."""
    return layer_chained is not False and chain_applies(hidden_states, weight, bias)


def _decode_forward(self, hidden_states, position_embeddings, attention_mask, past_key_values, weight, bias,
                    o_parts=1, layer_chained=None, **kwargs):
    input_shape = hidden_states.shape[:-1]  # [B, 1]
    chain = _takes_chain(hidden_states, weight, bias, layer_chained)
    pdl = chain and pdl_available(hidden_states.device)
    qkv = linear_pdl(hidden_states, weight, pdl=pdl) if chain else F.linear(hidden_states, weight, bias)
    q, k, v = (t.view(*input_shape, -1, self.head_dim) for t in  # [B, 1, H, D] views of the joined row
               qkv.split([self.q_proj.out_features, self.k_proj.out_features, self.v_proj.out_features], dim=-1))
    norms = {}
    if getattr(self, "q_norm", None) is not None:  # Qwen3: per-head RMSNorm before rotary, in the rotary kernel
        norms = dict(q_norm=(self.q_norm.weight, self.q_norm.variance_epsilon),
                     k_norm=(self.k_norm.weight, self.k_norm.variance_epsilon))
    writer = getattr(past_key_values, "rotary_write", None)  # kvroll's cache: rotary + cache write, one kernel
    q_rot = writer(self.layer_idx, q, k, v, *position_embeddings, pdl=pdl, **norms) if writer is not None else None
    if q_rot is not None:
        query = q_rot.transpose(1, 2)
        key, value = past_key_values.k[self.layer_idx], past_key_values.v[self.layer_idx]  # what update returns
    else:
        q, k = rotary(q, k, *position_embeddings, **norms)
        query, key, value = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, 1, D], HF's layout
        key, value = past_key_values.update(key, value, self.layer_idx)
    interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, None)
    out, weights = interface(self, query, key, value, attention_mask, dropout=0.0, scaling=self.scaling,
                             sliding_window=_sliding_window(self), **kwargs)
    return project(self.o_proj, out.reshape(*input_shape, -1).contiguous(), o_parts, chain), weights  # (partials)


def _fused_forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
    past_key_values, kwargs = pop_cache(kwargs)  # ``past_key_values`` or (transformers >= 5.24) ``cache``
    o_parts = kwargs.pop("kvroll_o_parts", 1)  # the fused decoder layer's asks (never reach HF's forward)
    layer_chained = kwargs.pop("kvroll_chain", None)
    weight, bias = getattr(self, _FUSED)
    if engine_decode_step(hidden_states, kwargs, kernel_on_cpu) and past_key_values is not None and \
            _views_intact(self, weight, bias):
        return _decode_forward(self, hidden_states, position_embeddings, attention_mask, past_key_values, weight,
                               bias, o_parts, layer_chained, **kwargs)
    return super(type(self), self).forward(hidden_states=hidden_states, position_embeddings=position_embeddings,
                                           attention_mask=attention_mask, **{CACHE_KW: past_key_values}, **kwargs)


_SWAP = ClassSwap(_fused_forward)


def _is_hf_attention(module: nn.Module) -> bool:
    """One of HF's four attention classes with three same-dtype projections, all biased or none."""
    if type(module).__name__ not in FAMILIES:
        return False
    return joinable([getattr(module, name, None) for name in _PROJECTIONS])


def install_fused_qkv_rotary(model: nn.Module) -> int:
    """Fuse every HF attention prologue of ``model`` for CUDA no-grad decode steps; returns how many (module doc).

    A second call patches nothing; without Triton nothing is patched. The joined weight is a plain attribute, not
    a parameter or buffer: ``named_parameters()`` / ``state_dict()`` keep HF's names and count each weight once.
    """
    if triton is None:
        return 0
    return _SWAP.install(model, _is_hf_attention,  # joined weight [Hq*D + 2*Hkv*D, H]
                         lambda m: join_projections(m, _PROJECTIONS, _FUSED))
