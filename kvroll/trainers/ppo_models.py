"""The module PPO trains: the policy and its value function, either a separate value model or a head on the policy.

    model = PolicyAndValue(policy, ValueModel.from_model(policy, copy_weights=True))  # a separate value model
    model = PolicyAndValue(policy)                                                    # a value head on the policy
    logits, values = model(input_ids, attention_mask, logits_to_keep=T + 1)           # [B, T+1, V], [B, T+1]

One module, so the optimizer, DeepSpeed and checkpoints see both halves; kvroll's rollout engine reads
``model.policy`` only. Positions follow the attention mask (left padding does not shift them), as in generation.
"""
from __future__ import annotations

import copy

import torch
from torch import nn


def positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that skip left padding: 0 at each row's first real token."""
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


def value_head(hidden_size: int) -> nn.Linear:
    """A scalar head, initialised small (std 1/sqrt(hidden+1), as OpenAI's lm-human-preferences) so the first values
    are near 0."""
    head = nn.Linear(hidden_size, 1)
    nn.init.normal_(head.weight, std=1.0 / (hidden_size + 1) ** 0.5)
    nn.init.zeros_(head.bias)
    return head


class ValueModel(nn.Module):
    """A transformer backbone (e.g. ``LlamaModel``) and a scalar head: a value for every position."""

    def __init__(self, backbone: nn.Module):
        super().__init__()
        self.backbone = backbone
        self.score = value_head(backbone.config.hidden_size)

    @classmethod
    def from_model(cls, model: nn.Module, copy_weights: bool) -> ValueModel:
        """The backbone of ``model`` (a causal LM or a base model); ``copy_weights`` for a model trained elsewhere
        too (the policy)."""
        backbone = getattr(model, "base_model", model)
        value = cls(copy.deepcopy(backbone) if copy_weights else backbone)
        score = getattr(model, "score", None)  # a sequence-classification (reward) model: TRL's old PPO used its head
        if isinstance(score, nn.Linear) and score.out_features == 1:
            value.score = copy.deepcopy(score) if copy_weights else score
        return value

    def forward(self, input_ids, attention_mask, position_ids) -> torch.Tensor:
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               use_cache=False).last_hidden_state  # [B, L, H]
        return self.score(hidden.to(self.score.weight.dtype)).squeeze(-1)  # [B, L]


class PolicyAndValue(nn.Module):
    """``policy`` (a causal LM) and ``value_model`` (a ``ValueModel``), or a ``value_head`` on the policy's last
    hidden state when ``value_model`` is None."""

    def __init__(self, policy: nn.Module, value_model: ValueModel | None = None):
        super().__init__()
        self.policy = policy
        self.config = policy.config  # transformers' Trainer reads model.config
        if value_model is None:
            self.value_head = value_head(policy.config.hidden_size)
        else:
            self.value_model = value_model

    @property
    def shared(self) -> bool:
        return not hasattr(self, "value_model")

    def forward(self, input_ids, attention_mask, logits_to_keep: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [B, K, V], values [B, K]) for the last K = ``logits_to_keep`` positions."""
        position_ids = positions(attention_mask)
        out = self.policy(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          logits_to_keep=logits_to_keep, output_hidden_states=self.shared, use_cache=False)
        if self.shared:
            hidden = out.hidden_states[-1][:, -logits_to_keep:]
            values = self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1)
        else:
            values = self.value_model(input_ids, attention_mask, position_ids)[:, -logits_to_keep:]
        return out.logits, values

    # Trainer and TRL's generation helper switch checkpointing through these, with the keywords of the installed
    # transformers: 5.17 passes every_n_layers and offload to gradient_checkpointing_enable; later versions call
    # activation_checkpointing_enable where a model has one. Each backbone takes them as they come.
    @property
    def is_gradient_checkpointing(self) -> bool:
        return any(getattr(m, "gradient_checkpointing", False) for m in self.policy.modules())

    is_activation_checkpointing = is_gradient_checkpointing

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None, **kwargs) -> None:
        for model in self._backbones():
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gradient_checkpointing_kwargs, **kwargs)

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs=None, **kwargs) -> None:
        for model in self._backbones():
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=activation_checkpointing_kwargs,
                                                  **kwargs)

    def gradient_checkpointing_disable(self) -> None:
        for model in self._backbones():
            model.gradient_checkpointing_disable()

    def activation_checkpointing_disable(self) -> None:
        for model in self._backbones():
            model.activation_checkpointing_disable()

    def _backbones(self) -> list[nn.Module]:
        return [self.policy] if self.shared else [self.policy, self.value_model.backbone]


def value_source(value_model, args, policy):
    """Where the value model starts from: ``value_model``, else ``args.value_model_name_or_path``, else the policy
    (its path, or the module itself, which is then copied). ``"smollm2"`` becomes the embedded model's directory."""
    from kvroll.rollout.model import EMBEDDED, resolve

    source = value_model if value_model is not None else args.value_model_name_or_path
    if source is None:
        return policy
    return str(resolve(source)) if source == EMBEDDED else source


def check_value_model(policy, value, field_name: str, trust_remote_code: bool = False) -> None:
    """Raise ValueError unless the value model's hidden size and vocabulary match the policy's (configs only)."""
    if value is policy:
        return
    configs = [_config(m, trust_remote_code).get_text_config() for m in (policy, value)]
    for name in ("hidden_size", "vocab_size"):
        ours, theirs = (getattr(c, name, None) for c in configs)
        if ours != theirs:
            shown = value if isinstance(value, str) else type(value).__name__
            raise ValueError(
                f"{field_name}={shown!r} has {name}={theirs}, the policy has {name}={ours}: the value model reads "
                "the policy's tokens and is initialised from the given model, so both must match. Use a model of "
                "the policy's family and size, or leave it unset to start the value model from the policy.")


def _config(model, trust_remote_code: bool):
    if isinstance(model, str):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    return model.config
