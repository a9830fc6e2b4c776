"""The engine's decode-step fusions, checked, resolved and installed in one place (``RolloutEngine(...,
fused_mlp=, fused_qkv_rotary=, fused_add_norm=, fused_sampling=)``, ``RolloutPool``'s and the bench's fields of
those names).

    check_fusions({"fused_mlp": True, "fused_qkv_rotary": None, "fused_add_norm": False})  # ValueError if not
    resolve_fusions(switches, device)     # None ("auto", the default) -> on for a CUDA model, off elsewhere
    install_fusions(model, {"fused_mlp": True, ...})                      # class swaps (each module)

Default on CUDA: the three module fusions since session 10 (on the H200, Qwen3-1.7B architecture,
docs/benchmarks/engine_throughput.md, faster for every policy and batch measured, +6% to +32% tokens/s, none
slower), the sampler since session 12 (every row of the same benchmark faster: the step 2-8% shorter).

Each one swaps HF modules for subclasses that take the fused path for CUDA no-grad (decode) forwards only; on CPU,
under autograd and in prefill the model runs HF's own forwards.
"""
from __future__ import annotations

import torch
from torch import nn

from kvroll.kernels.fused_add_norm import install_fused_add_norm
from kvroll.kernels.fused_mlp import install_fused_mlp
from kvroll.kernels.fused_qkv_rotary import install_fused_qkv_rotary

# name -> (installer, what True does, what False keeps)
FUSIONS = {
    "fused_mlp": (install_fused_mlp, "one gate+up matmul and a fused SiLU·mul kernel on CUDA", "HF's MLP"),
    "fused_qkv_rotary": (install_fused_qkv_rotary, "one QKV matmul and a fused rotary kernel per decode step on "
                         "CUDA", "HF's attention prologue"),
    "fused_add_norm": (install_fused_add_norm, "the residual add fused into the post-attention RMSNorm per decode "
                       "step on CUDA", "HF's decoder layer"),
}


# Not a module swap: the decode step's sampler, the draw, logprob and finite check in two Triton kernels
# (kvroll/kernels/sample.py; taken when no top-k / top-p / min-p / repetition penalty is set).
SAMPLING = "fused_sampling"
SWITCHES = (*FUSIONS, SAMPLING)  # every switch: RolloutEngine / RolloutPool keywords, bench fields
_TEXT = {name: (on, off) for name, (_, on, off) in FUSIONS.items()} | {
    SAMPLING: ("the draw, its logprob and the finite check in two Triton kernels when no top-k / top-p / min-p / "
               "repetition penalty is set (at <= 64 rows with the output head's matmul in the first)",
               "torch's sampler")}


def check_fusions(switches: dict, owner: str = "RolloutEngine") -> None:
    """A ``ValueError`` naming the field, the value and the fix for any switch not a bool or None."""
    for name, value in switches.items():
        on, off = _TEXT[name]
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"{owner}.{name}={value!r} is invalid: pass True ({on}), False ({off}) or None "
                             "(the default: on for a model on CUDA, off elsewhere).")


def resolve_fusions(switches: dict, device) -> dict:
    """Each switch as a bool: None (auto) is on for a model on CUDA, where every fusion is measured faster, and
    off elsewhere (the fused paths serve CUDA decode steps only, so a CPU model keeps HF's modules untouched)."""
    on = torch.device(device).type == "cuda"
    return {name: on if value is None else value for name, value in switches.items()}


def install_fusions(model: nn.Module, switches: dict) -> None:
    """Install every module fusion switched on (an installer patches nothing twice); the sampler needs none."""
    for name, value in switches.items():
        if value and name in FUSIONS:
            FUSIONS[name][0](model)
