"""The weights a rollout engine holds, read from a training model: its own tensors, or a PEFT LoRA model merged.

    base = base_model(model)                      # the transformers model whose class and config the engine copies
    for name, source in named_sources(model):    # base names: no "base_model.model.", ".base_layer", lora_A/B
        with gathered(source.params):             # (weights.py) full ZeRO-3 tensors, LoRA A/B included
            tensor = source.value()               # the tensor itself, or W + Σ scale·B@A in fp32 (a new tensor)

A plain model's sources are its parameters and buffers, named as ``named_parameters`` names them. For a PEFT LoRA
model (a ``PeftModel`` or a model with LoRA layers injected) they are what TRL sends vLLM after ``merge_adapter``:
each LoRA layer's base weight under the base name, with the active adapters' deltas added, and a
``modules_to_save`` module's active copy in place of the original. The merge is computed, never applied, so the
trainer's model is not touched (merging and unmerging in place would leave bf16 rounding in the base weights).
LoRA dropout does not enter: like any rollout backend, the engine runs the eval-mode forward. What the merge
cannot express is refused with a ``ValueError`` naming the module: LoRA variants (DoRA, …), ``lora_bias``, layer
types other than ``Linear`` / ``Embedding`` (conv, quantized bases), trainable tokens, non-LoRA tuners, prompt
learning, and an adapter on one of two tied weights (the engine keeps ``tie_word_embeddings`` ties).
"""
from __future__ import annotations

import functools
import sys
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True, eq=False)
class LoraDelta:
    """One adapter's contribution to a base weight: ``scale · B @ A`` (transposed when ``transpose``)."""

    a: torch.Tensor  # [r, in] (Linear) / [r, num_embeddings] (Embedding)
    b: torch.Tensor  # [out, r] / [embedding_dim, r]
    scale: float
    transpose: bool  # fan_in_fan_out Linear, and every Embedding: the weight is stored as (B @ A).T

    def value(self) -> torch.Tensor:
        delta = whole(self.b).float() @ whole(self.a).float()  # peft's order of operations, in fp32
        return (delta.T if self.transpose else delta) * self.scale


@dataclass(frozen=True, eq=False)
class Source:
    """Where one engine tensor comes from: a training tensor, plus the LoRA deltas merged into it."""

    tensor: torch.Tensor  # the trainer's parameter or buffer (a LoRA layer's base weight)
    deltas: tuple[LoraDelta, ...] = ()
    # A LoRA layer's base weight or a modules_to_save tensor: what the engine holds there can stop being ``tensor``
    # (set_adapter, disable_adapter, merge/unmerge_adapter), so an engine must not share its storage.
    adaptable: bool = False

    @property
    def params(self) -> list[torch.Tensor]:
        """Every training tensor the value reads (what a ZeRO-3 gather must include)."""
        return [self.tensor] + [t for d in self.deltas for t in (d.a, d.b)]

    def value(self) -> torch.Tensor:
        """The tensor itself, or its merged value in fp32 (a new tensor; cast by the copy into the engine)."""
        if not self.deltas:
            return whole(self.tensor)
        merged = whole(self.tensor).float()
        for delta in self.deltas:
            merged = merged + delta.value()  # out of place: ``.float()`` of an fp32 weight is the weight itself
        return merged

    def same_as(self, other: "Source") -> bool:
        return self.tensor is other.tensor and len(self.deltas) == len(other.deltas) and all(
            x.a is y.a and x.b is y.b and x.scale == y.scale and x.transpose == y.transpose
            for x, y in zip(self.deltas, other.deltas))


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s full value, detached: a ZeRO-3 parameter whose partition this rank holds whole (``held_whole``) is
    read from that partition, without a gather; any other tensor is itself (inside ``gathered`` a partitioned
    parameter is full)."""
    if held_whole(tensor):
        return tensor.ds_tensor.detach().narrow(0, 0, tensor.ds_numel).view(tensor.ds_shape)
    return tensor.detach()


def held_whole(tensor: torch.Tensor) -> bool:
    """A partitioned ZeRO-3 parameter whose partition group is this rank alone, its partition in memory: every
    element is in ``ds_tensor`` (DeepSpeed's layout: the flat parameter, padded at the end), so reading it needs
    neither DeepSpeed's gather nor the re-partitioning after it (about half of a one-GPU trainer's sync time, see
    docs/benchmarks/ray_weight_sync.md). The same on every rank of a group, so ranks in lockstep agree on it."""
    status, part = getattr(tensor, "ds_status", None), getattr(tensor, "ds_tensor", None)
    if status is None or part is None or status.name != "NOT_AVAILABLE":
        return False
    if getattr(tensor, "ds_zero_partition_world_size", None) != 1 or part.numel() < tensor.ds_numel:
        return False
    if part.device != tensor.device:  # offloaded (offload_param: cpu): DeepSpeed's gather brings it to the device
        return False
    location, part_status = getattr(part, "final_location", None), getattr(part, "status", None)
    return (location is None or location.name != "nvme") and not hasattr(part, "ds_quant_scale") \
        and (part_status is None or part_status.name == "AVAILABLE")


def base_model(model: nn.Module) -> nn.Module:
    """The transformers model under a PEFT wrapper (its LoRA layers inside), else ``model`` itself."""
    peft = sys.modules.get("peft")
    if peft is None:
        return model
    if isinstance(model, peft.PeftModel):
        if model.active_peft_config.is_prompt_learning:
            raise ValueError(f"kvroll: the PEFT model uses {model.peft_type} (prompt learning), whose virtual "
                             "tokens cannot be merged into weights; use LoRA, or set use_kvroll=False.")
        return model.get_base_model()
    if isinstance(model, getattr(peft, "PeftMixedModel", ())):
        model = model.base_model
    if isinstance(model, _peft_classes().tuner):
        return model.model
    return model


def named_sources(model: nn.Module, kind: str = "parameters",
                  remove_duplicate: bool = True) -> list[tuple[str, Source]]:
    """``kind`` ("parameters" or "buffers") of the engine model ``model`` stands for, by base name (module doc).

    Tied tensors appear once unless ``remove_duplicate`` is false, as ``named_parameters`` does.
    """
    out, first = [], {}  # first: id(the base model's own tensor) -> (name, Source) where it first appeared
    for name, tensor_kind, source, origin in _walk(base_model(model), ""):
        if tensor_kind != kind:
            continue
        if origin in first:
            tied_name, tied = first[origin]
            if not source.same_as(tied):
                raise ValueError(f"kvroll: {tied_name!r} and {name!r} are tied in the model (tie_word_embeddings, "
                                 f"or peft's layer_replication) but the PEFT adapter changes one of them; the rollout "
                                 "engine keeps them tied. Leave them out of target_modules / modules_to_save, untie "
                                 "the embeddings, or drop layer_replication.")
            if remove_duplicate:
                continue
        else:
            first[origin] = (name, source)
        out.append((name, source))
    return out


def check_mergeable(model: nn.Module) -> None:
    """Raise the ``ValueError`` ``named_sources`` would raise for ``model`` (an unmergeable PEFT adapter), at once.

    A walk of the module tree, no tensor math: trainers and the Ray pool call it before loading workers or engines.
    """
    named_sources(model)
    named_sources(model, "buffers")


def _walk(module: nn.Module, prefix: str):
    """(name, "parameters"|"buffers", Source, id of the base model's own tensor there), in module order."""
    peft = _peft_classes() if "peft" in sys.modules else None
    if peft is not None and type(module) in peft.lora_layers:
        deltas = _lora_deltas(module, prefix)
        for name, kind, source, origin in _walk(module.base_layer, prefix):
            if kind == "parameters" and name == prefix + "weight":
                source = Source(source.tensor, deltas, adaptable=True)
            yield name, kind, source, origin
        return
    if peft is not None and type(module) is peft.saved:
        original = {n: id(t) for n, t in _own_tensors(module.original_module, prefix)}
        for name, kind, source, _ in _walk(_saved_copy(module, prefix), prefix):
            yield name, kind, Source(source.tensor, source.deltas, adaptable=True), \
                original.get(name, id(source.tensor))
        return
    if peft is not None and isinstance(module, peft.unsupported):
        raise ValueError(f"kvroll cannot merge the PEFT layer {prefix.rstrip('.') or 'model'!r} "
                         f"({type(module).__module__}.{type(module).__name__}): only LoRA on Linear and Embedding "
                         "layers and modules_to_save are supported. Use a plain LoRA config, or use_kvroll=False.")
    for name, param in module._parameters.items():
        if param is not None:
            yield prefix + name, "parameters", Source(param), id(param)
    for name, buffer in module._buffers.items():
        if buffer is not None:
            yield prefix + name, "buffers", Source(buffer), id(buffer)
    for name, child in module._modules.items():
        if child is not None:
            yield from _walk(child, f"{prefix}{name}.")


def _lora_deltas(layer, prefix: str) -> tuple[LoraDelta, ...]:
    """The deltas of a LoRA layer's active, unmerged adapters (what its forward adds), checked for support."""
    where = prefix.rstrip(".")
    if layer.merged and layer.disable_adapters:
        raise ValueError(f"kvroll: the LoRA layer {where!r} is merged and disabled at once; unmerge it "
                         "(model.unmerge_adapter()) before training with use_kvroll.")
    if layer.merged or layer.disable_adapters:
        return ()  # the forward uses the base layer alone (which holds any merged adapters)
    embedding = isinstance(layer, _peft_classes().lora_layers[1])
    deltas = []
    for adapter in layer.active_adapters:
        if adapter not in (layer.lora_embedding_A if embedding else layer.lora_A):
            continue
        if adapter in layer.lora_variant:
            raise ValueError(f"kvroll cannot merge adapter {adapter!r} of {where!r}: it is a LoRA variant "
                             f"({type(layer.lora_variant[adapter]).__name__}, e.g. use_dora=True); use plain LoRA.")
        if layer.lora_bias.get(adapter):
            raise ValueError(f"kvroll cannot merge adapter {adapter!r} of {where!r}: lora_bias=True is not "
                             "supported; set lora_bias=False.")
        if embedding:
            a, b, transpose = layer.lora_embedding_A[adapter], layer.lora_embedding_B[adapter], True
        else:
            a, b, transpose = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight, layer.fan_in_fan_out
        deltas.append(LoraDelta(a, b, float(layer.scaling[adapter]), bool(transpose)))
    return tuple(deltas)


def _saved_copy(wrapper, prefix: str) -> nn.Module:
    """The module a ``modules_to_save`` wrapper runs now (its forward's choice)."""
    if wrapper.disable_adapters or not wrapper.active_adapters:
        return wrapper.original_module
    if len(wrapper.active_adapters) > 1:
        raise ValueError(f"kvroll: {prefix.rstrip('.')!r} (modules_to_save) has several active adapters "
                         f"{wrapper.active_adapters}; activate one.")
    return wrapper.modules_to_save[wrapper.active_adapters[0]] if wrapper.active_adapters[0] in \
        wrapper.modules_to_save else wrapper.original_module


def _own_tensors(module: nn.Module, prefix: str):
    yield from module.named_parameters(prefix.rstrip("."), remove_duplicate=False)
    yield from module.named_buffers(prefix.rstrip("."), remove_duplicate=False)


@dataclass(frozen=True)
class _PeftClasses:
    tuner: type
    lora_layers: tuple[type, type]  # (Linear, Embedding): exact types; subclasses (quantized, …) merge otherwise
    saved: type
    unsupported: tuple[type, ...]  # any other tuner layer or auxiliary wrapper


@functools.cache
def _peft_classes() -> _PeftClasses:
    from peft.tuners import lora
    from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper, ModulesToSaveWrapper

    return _PeftClasses(BaseTuner, (lora.Linear, lora.Embedding), ModulesToSaveWrapper,
                        (BaseTunerLayer, AuxiliaryTrainingWrapper))
