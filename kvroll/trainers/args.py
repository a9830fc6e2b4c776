"""The kvroll fields shared by ``GRPOConfig`` and ``RLOOConfig``, and their validation.

The fields are flat dataclass fields with help metadata, so TRL's parser reads them from YAML and the command line:

    use_kvroll: true
    kvroll_policy: rkv
    kvroll_budget: 1024
    kvroll_policy_kwargs: {}
    kvroll_mode: colocate
    kvroll_max_batch: 64
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvroll.config import CompressionConfig

KVROLL_MODES = ("colocate", "ray")
KVROLL_DTYPES = ("auto", "float32", "bfloat16", "float16")
# generation_kwargs keys kvroll understands (vLLM's and transformers' spellings of the same things).
GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "stop_token_ids", "ignore_eos",
                   "seed", "max_tokens", "max_new_tokens", "do_sample")


@dataclass
class KVRollArguments:
    """The switch and the engine settings; mixed into kvroll's ``GRPOConfig`` and ``RLOOConfig``."""

    use_kvroll: bool = field(
        default=False,
        metadata={"help": "Generate rollouts with kvroll's compressed-KV engine instead of `model.generate` (the "
                          "counterpart of `use_vllm`; the two are exclusive). Rollout logprobs are returned, so GRPO's "
                          "importance-sampling correction (`vllm_importance_sampling_*`) applies."})
    kvroll_policy: str = field(
        default="rkv",
        metadata={"help": "KV eviction policy (a name from kvroll's registry, e.g. 'rkv', 'longflow', 'snapkv', "
                          "'streaming', 'random', 'full')."})
    kvroll_budget: int | None = field(
        default=1024,
        metadata={"help": "Tokens each sequence keeps per KV head (the static cache budget). May be null for "
                          "policy 'full'."})
    kvroll_policy_kwargs: dict | str | None = field(
        default=None,
        metadata={"help": "Hyperparameters of the policy, overriding the paper defaults (a dict, or a JSON string "
                          "on the command line), e.g. '{\"granularity\": \"layer\"}'."})
    kvroll_mode: str = field(
        default="colocate",
        metadata={"help": "Where the engine runs: 'colocate' (in the trainer process, on its device, weights shared "
                          "or copied after each optimizer step). 'ray' (Ray rollout workers) is accepted by the "
                          "parser but lands with kvroll's Ray issue."})
    kvroll_max_batch: int | None = field(
        default=None,
        metadata={"help": "Engine slots (sequences decoded at once, the static cache's batch dimension). Default: "
                          "the rows one generation call hands this rank (per_device_train_batch_size * "
                          "steps_per_generation)."})
    kvroll_dtype: str = field(
        default="auto",
        metadata={"help": "Engine weight dtype: 'auto' (the training model's dtype; its parameters are shared with "
                          "the engine, so sync is free) or 'bfloat16' / 'float16' / 'float32' (an on-device copy, "
                          "refreshed after each optimizer step)."})


def validate_kvroll_args(args: Any) -> CompressionConfig | None:
    """Check the kvroll fields of a config (before any model loads); returns the CompressionConfig or None.

    Normalises ``kvroll_policy_kwargs`` and ``generation_kwargs`` given as JSON strings into dicts.
    """
    args.kvroll_policy_kwargs = _as_dict("kvroll_policy_kwargs", args.kvroll_policy_kwargs)
    if args.kvroll_mode not in KVROLL_MODES:
        raise ValueError(f"kvroll_mode={args.kvroll_mode!r} is invalid; choose one of {list(KVROLL_MODES)}.")
    if args.kvroll_dtype not in KVROLL_DTYPES:
        raise ValueError(f"kvroll_dtype={args.kvroll_dtype!r} is invalid; choose one of {list(KVROLL_DTYPES)}.")
    if args.kvroll_max_batch is not None and not (
            isinstance(args.kvroll_max_batch, int) and not isinstance(args.kvroll_max_batch, bool)
            and args.kvroll_max_batch >= 1):
        raise ValueError(f"kvroll_max_batch={args.kvroll_max_batch!r} is invalid: use an integer >= 1, or null for "
                         "the rows of one generation call.")
    if not args.use_kvroll:
        return None
    if getattr(args, "use_vllm", False):
        raise ValueError("use_kvroll=True and use_vllm=True are exclusive: both replace the trainer's rollout "
                         "backend. Set use_vllm=False to generate with kvroll, or use_kvroll=False for vLLM.")
    if getattr(args, "use_transformers_continuous_batching", False):
        raise ValueError("use_kvroll=True and use_transformers_continuous_batching=True are exclusive; set "
                         "use_transformers_continuous_batching=False.")
    if args.kvroll_mode == "ray":
        raise NotImplementedError(
            "kvroll_mode='ray' (rollouts in Ray workers) is not available yet: it lands with kvroll's Ray "
            "rollout-pool issue. Use kvroll_mode='colocate' (the engine runs in the trainer process).")
    try:
        compression = CompressionConfig(args.kvroll_policy, args.kvroll_budget, **args.kvroll_policy_kwargs)
    except (TypeError, ValueError) as err:
        raise ValueError(f"Invalid kvroll settings (kvroll_policy={args.kvroll_policy!r}, "
                         f"kvroll_budget={args.kvroll_budget!r}, kvroll_policy_kwargs={args.kvroll_policy_kwargs!r})"
                         f": {err}") from err
    args.generation_kwargs = _as_dict("generation_kwargs", args.generation_kwargs)
    unknown = sorted(set(args.generation_kwargs) - set(GENERATION_KEYS))
    if unknown:
        raise ValueError(f"generation_kwargs keys {unknown} are not supported with use_kvroll=True; kvroll "
                         f"understands {list(GENERATION_KEYS)}.")
    if getattr(args, "loss_type", None) == "vespo" and getattr(args, "vllm_importance_sampling_correction", False) \
            and args.vllm_importance_sampling_mode not in ("token_truncate", "token_mask"):
        raise ValueError("loss_type='vespo' with use_kvroll=True needs vllm_importance_sampling_mode "
                         f"'token_truncate' or 'token_mask', got {args.vllm_importance_sampling_mode!r}.")
    return compression


def _as_dict(name: str, value) -> dict:
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError as err:
            raise ValueError(f"{name}={value!r} is not valid JSON: {err}. Pass a JSON object, e.g. '{{}}'.") from err
    if not isinstance(value, dict):
        raise ValueError(f"{name}={value!r} must be a dict (or a JSON object string).")
    return dict(value)
