"""The gated MLP of a decode step in three kernels: one gate+up matmul, ``silu_mul``, the down projection (two in a
decode step run as the chain of ``kvroll.kernels.pdl_gemm``: SiLU * up in the gate+up GEMM's epilogue).

HF's ``LlamaMLP`` / ``Qwen2MLP`` / ``Qwen3MLP`` / ``MistralMLP`` run ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``:
two matmuls of the same input, a SiLU and a multiply before the down projection, five kernels per layer per step.
``install_fused_mlp(model)`` gives each such module one concatenated weight [2I, H] whose two halves ARE
``gate_proj.weight`` and ``up_proj.weight`` (the parameters' storage becomes views into it; the Parameter objects,
their names and ``requires_grad`` stay), so an in-place ``param.copy_`` into either (``RolloutEngine.load_weights``,
the weight sync's ``unpack``) updates the fused weight too, and captured CUDA graphs stay valid. Biases
(``mlp_bias``) are joined the same way.

    n = install_fused_mlp(model)     # the number of MLPs patched; 28 on Qwen3-1.7B
    model(...)                       # CUDA + no-grad: x @ [Wg; Wu]^T -> silu_mul -> down_proj; else HF's forward

Like ``rmsnorm.install_fused_rmsnorm`` the install is a class swap to a subclass (``FusedQwen3MLP``) whose forward
takes the fused path for CUDA inputs under no-grad only (and, for tests, CPU inputs when ``kernel_on_cpu`` is set
under ``TRITON_INTERPRET=1``); with grad enabled or on CPU the module runs HF's own forward on the same weights.
If a parameter no longer lies in the fused weight (its ``.data`` was replaced, e.g. by ``module.to(...)`` after the
install, or the module is a ``copy.deepcopy``, which copies each parameter apart), the module takes HF's forward:
correct, just not fused. Install on the model as it will run.

Numerics: the one matmul of N = 2I columns may accumulate in another order than two of I (cuBLAS picks its
algorithm by shape), so on a GPU its bf16 outputs can differ from HF's by a rounding; ``silu_mul`` rounds as HF
does (see its module). ``RolloutEngine(fused_mlp=None)``, the default, enables it for a model on CUDA (measured
faster, docs/benchmarks/engine_throughput.md), not on CPU; True / False force it.

``kvroll_down_parts`` (> 1, passed only by the fused decoder layer, ``fused_add_norm``): the down projection, if a
plain bias-free ``Linear``, returns its fp32 partial sums over that many K slices (``kvroll.kernels.split_k``)
for the next ``add_rms_norm`` to add; otherwise, and on HF's forward, it is ignored. ``kvroll_chain`` (passed by the
fused decoder layer in a decode step it runs as the chain of PDL launches, ``kvroll.kernels.pdl_gemm``): gate_up
is the chain's Triton GEMM, where ``chain_applies``, with SiLU * up in its epilogue where its rule covers the shape
(``chain_applies(silu_mul=True)``; else, or with ``pdl_gemm.SILU_EPILOGUE`` off, ``silu_mul`` as a PDL launch after
it).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvroll.kernels.class_swap import ClassSwap, join_projections, joinable, views_intact
from kvroll.kernels.pdl_gemm import chain_applies, linear_pdl, pdl_available
from kvroll.kernels.silu_mul import silu_mul, triton
from kvroll.kernels.split_k import project

kernel_on_cpu = False  # tests: take the fused path on CPU tensors too (needs TRITON_INTERPRET=1)
_FUSED = "_kvroll_gate_up"  # the instance attribute holding (weight [2I, H], bias [2I] or None)
_PROJECTIONS = ("gate_proj", "up_proj")


def _fused_applies(x: torch.Tensor) -> bool:
    """The fused path serves CUDA inputs without autograd; everything else (training, CPU) takes HF's forward."""
    return (x.is_cuda or kernel_on_cpu) and not torch.is_grad_enabled()


def _views_intact(module: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """gate_proj / up_proj still read the halves of the fused buffers (host-side pointer checks, no sync)."""
    return views_intact(module, _PROJECTIONS, weight, bias)


def _fused_forward(self, x: torch.Tensor, kvroll_down_parts: int = 1, kvroll_chain: bool = False) -> torch.Tensor:
    weight, bias = getattr(self, _FUSED)
    if _fused_applies(x) and _views_intact(self, weight, bias):
        # a chained decode step's (kvroll.kernels.pdl_gemm): SiLU * up in the GEMM's epilogue where its rule
        # covers the shape, else the GEMM then silu_mul, both PDL launches
        if kvroll_chain and chain_applies(x, weight, bias, silu_mul=True):
            act = linear_pdl(x, weight, pdl=pdl_available(x.device), silu_mul=True)
        elif kvroll_chain and chain_applies(x, weight, bias):
            pdl = pdl_available(x.device)
            act = silu_mul(linear_pdl(x, weight, pdl=pdl), pdl=pdl)
        else:
            act = silu_mul(F.linear(x, weight, bias))  # [..., 2I] -> [..., I]
        return project(self.down_proj, act, kvroll_down_parts, kvroll_chain)  # [..., H] (or the layer's partials)
    return super(type(self), self).forward(x)  # the HF class's own forward


_SWAP = ClassSwap(_fused_forward)


def _is_silu(act) -> bool:
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"


def _is_gated_silu_mlp(module: nn.Module) -> bool:
    """HF's gated MLP: gate_proj, up_proj (same shape, both biased or neither), down_proj, a SiLU act_fn."""
    gate, up = getattr(module, "gate_proj", None), getattr(module, "up_proj", None)
    if not joinable([gate, up]) or not isinstance(getattr(module, "down_proj", None), nn.Linear):
        return False
    return gate.weight.shape == up.weight.shape and _is_silu(getattr(module, "act_fn", None))


def install_fused_mlp(model: nn.Module) -> int:
    """Fuse every HF gated-SiLU MLP of ``model`` for CUDA no-grad forwards; returns how many (see module doc).

    A second call patches nothing; without Triton nothing is patched. The fused weight is a plain attribute, not
    a parameter or buffer: ``named_parameters()`` / ``state_dict()`` keep HF's names and count each weight once.
    """
    if triton is None:
        return 0
    return _SWAP.install(model, _is_gated_silu_mlp, lambda m: join_projections(m, _PROJECTIONS, _FUSED))  # [2I, H]
