"""How the fused kernels reach an HF model: each matching module's class becomes a subclass of its HF class whose
``forward`` takes the fused path or else the HF class's own forward (``rmsnorm``, ``fused_mlp``,
``fused_qkv_rotary``, ``fused_add_norm``). A class swap rather than a bound method stored on the instance, which
would be a reference cycle (module -> method -> module) keeping a dropped engine's weights in GPU memory until
the garbage collector runs.

    SWAP = ClassSwap(_fused_forward)                    # one per fusion: its subclasses, one per HF class
    n = SWAP.install(model, matches, prepare=None)      # patched modules; a second call patches nothing
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn


class ClassSwap:
    """The subclasses (``Fused<HF class name>``) of one fused ``forward``, made once per HF class."""

    def __init__(self, forward: Callable):
        self.forward = forward
        self.classes: dict[type, type] = {}

    def subclass(self, cls: type) -> type:
        if cls not in self.classes:
            self.classes[cls] = type(f"Fused{cls.__name__}", (cls,), {"forward": self.forward,
                                                                      "__module__": cls.__module__})
        return self.classes[cls]

    def install(self, model: nn.Module, matches: Callable[[nn.Module], bool],
                prepare: Callable[[nn.Module], None] | None = None) -> int:
        """Swap every module of ``model`` that ``matches`` (after ``prepare(module)``); returns how many."""
        patched = 0
        for module in model.modules():
            if type(module) in self.classes.values() or not matches(module):
                continue
            if prepare is not None:
                prepare(module)
            module.__class__ = self.subclass(type(module))
            patched += 1
        return patched


def engine_decode_step(x: torch.Tensor, kwargs: dict, on_cpu: bool) -> bool:
    """An engine decode step (a ``kvroll_cache`` in decode mode) on CUDA (or CPU when ``on_cpu``, for tests under
    the interpreter) without autograd; prefill, training and CPU take HF's forward."""
    cache = kwargs.get("kvroll_cache")
    return (x.is_cuda or on_cpu) and not torch.is_grad_enabled() and getattr(cache, "mode", None) == "decode"


def joinable(projs: list) -> bool:
    """Linear layers that can share one joined weight: same dtype, device and input size, all biased or none."""
    if not all(isinstance(p, nn.Linear) for p in projs):
        return False
    first = projs[0]
    return all(p.weight.dtype == first.weight.dtype and p.weight.device == first.weight.device and
               p.weight.shape[1] == first.weight.shape[1] and (p.bias is None) == (first.bias is None)
               for p in projs)


def join_projections(module: nn.Module, names: tuple, attr: str) -> None:
    """Join the ``names`` projections' weights (and biases) with ``join_rows``; store (weight, bias|None) as
    ``module.<attr>``, a plain attribute, so ``named_parameters()`` / ``state_dict()`` keep HF's names."""
    projs = [getattr(module, name) for name in names]
    bias = join_rows([p.bias for p in projs]) if projs[0].bias is not None else None
    setattr(module, attr, (join_rows([p.weight for p in projs]), bias))


def views_intact(module: nn.Module, names: tuple, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """The ``names`` projections still read their row blocks of the joined buffers (host-side pointer checks, no
    device sync); False once a ``.data`` was replaced (``module.to(...)``, a ``deepcopy``)."""
    start = 0
    for name in names:
        proj = getattr(module, name)
        if proj.weight.data_ptr() != weight[start:].data_ptr() or \
                (bias is not None and proj.bias.data_ptr() != bias[start:].data_ptr()):
            return False
        start += proj.weight.shape[0]
    return True


@torch.no_grad()
def join_rows(params: list[nn.Parameter]) -> torch.Tensor:
    """One buffer [p0; p1; ...] along dim 0; each parameter's storage becomes its block (same Parameter object,
    name and ``requires_grad``), so an in-place ``copy_`` into a parameter updates the joined buffer."""
    joined = torch.cat([p.detach() for p in params])
    start = 0
    for p in params:
        p.data = joined[start: start + p.shape[0]]
        start += p.shape[0]
    return joined
