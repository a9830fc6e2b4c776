"""The kvroll fields shared by ``GRPOConfig`` and ``RLOOConfig``, and their validation.

The fields are flat dataclass fields with help metadata, so TRL's parser reads them from YAML and the command line:

    use_kvroll: true
    kvroll_policy: rkv
    kvroll_budget: 1024
    kvroll_policy_kwargs: {}
    kvroll_mode: colocate
    kvroll_max_batch: 64
    kvroll_correction: none     # or sparse_rl (GRPO/PPO: with vllm_importance_sampling_mode: token_truncate)
"""
from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field, fields
from typing import Any
from urllib.parse import urlparse

import numpy as np

from kvroll.checks import as_int, plain
from kvroll.config import CompressionConfig
from kvroll.rollout.sampling import MIN_TEMPERATURE, finite_number
from kvroll.trainers.correction import CORRECTIONS, REJECTION_STATISTICS

KVROLL_MODES = ("colocate", "ray")
KVROLL_DTYPES = ("auto", "float32", "bfloat16", "float16")
_BUDGET_DEFAULT = 1024  # kvroll_budget's
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
        default=_BUDGET_DEFAULT,
        metadata={"help": "Tokens each sequence keeps per KV head (the static cache budget). May be null for "
                          "policy 'full'."})
    kvroll_policy_kwargs: dict | str | None = field(
        default=None,
        metadata={"help": "Hyperparameters of the policy, overriding the paper defaults (a dict, or a JSON string "
                          "on the command line), e.g. '{\"granularity\": \"layer\"}'."})
    kvroll_mode: str = field(
        default="colocate",
        metadata={"help": "Where the engine runs: 'colocate' (in the trainer process, on its device, weights shared "
                          "or copied after each optimizer step) or 'ray' (kvroll_num_workers Ray actors on their own "
                          "GPUs or nodes; trainer rank 0 broadcasts versioned, checksummed weights to them after "
                          "each optimizer step)."})
    kvroll_num_workers: int = field(
        default=1, metadata={"help": "Ray mode: number of rollout workers (one engine each)."})
    kvroll_gpus_per_worker: float | None = field(
        default=None,
        metadata={"help": "Ray mode: GPUs per worker; fractions share a GPU (e.g. 0.5 beside the trainer), 0 runs "
                          "the workers on CPU. Default: 1 when the cluster has a GPU per worker, else 0."})
    kvroll_ray_address: str | None = field(
        default=None,
        metadata={"help": "Ray mode: the cluster to join (HOST:PORT, 'auto', or ray://HOST:PORT). Default: join the "
                          "cluster running on this machine, else start a local one."})
    kvroll_worker_timeout_s: float = field(
        default=600.0,
        metadata={"help": "Ray mode: seconds a worker may take for one rollout shard or sync call before it is "
                          "killed, replaced and its work re-submitted."})
    kvroll_sync_bucket_mb: int = field(
        default=1024,
        metadata={"help": "Ray mode: size of the flat buckets the weights travel in (MB); packing bucket k+1 "
                          "overlaps sending bucket k."})
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
    kvroll_correction: str = field(
        default="none",
        metadata={"help": "Correction of the rollout/trainer mismatch on top of TRL's: 'none' (TRL's importance "
                          "sampling alone, as configured by `vllm_importance_sampling_*`) or 'sparse_rl' (Sparse-RL, "
                          "arXiv 2601.10079: rollouts whose statistic `kvroll_rejection_statistic` exceeds "
                          "`kvroll_rejection_threshold` get zero weight in the policy loss, the others TRL's "
                          "per-token truncated importance ratio; needs vllm_importance_sampling_mode="
                          "'token_truncate' in GRPO and PPO; RLOO, which has no importance sampling, gets the "
                          "rejection alone). Logs kvroll/rejected_fraction."})
    kvroll_rejection_statistic: str = field(
        default="mean_abs_log_ratio",
        metadata={"help": "What kvroll_correction='sparse_rl' compares with the threshold, per rollout, over its "
                          "completion tokens, with d_t = logp_trainer - logp_rollout: 'mean_abs_log_ratio' (mean "
                          "|d_t|) or 'abs_mean_log_ratio' (|mean d_t|, the length-normalised sequence log "
                          "importance ratio). Both in nats per token."})
    kvroll_rejection_threshold: float = field(
        default=0.3,
        metadata={"help": "kvroll_correction='sparse_rl': a rollout whose statistic exceeds this (nats per token, "
                          "> 0) is rejected. Full-KV rollouts sit near 0.01-0.03 (numerics); SmolLM2-135M at a "
                          "46-token cache spans 0.01-0.47 per rollout, about a fifth above 0.3."})


def validate_kvroll_args(args: Any) -> CompressionConfig | None:
    """Check the kvroll fields of a config (before any model loads); returns the CompressionConfig or None.

    Normalises ``kvroll_policy_kwargs`` and ``generation_kwargs`` given as JSON strings into dicts.
    """
    if not isinstance(args.use_kvroll, bool):  # TRL's parser turns 'true'/'false' into bools; Python callers may not
        raise ValueError(f"use_kvroll={args.use_kvroll!r} is invalid: use True or False (a bool, not "
                         f"{type(args.use_kvroll).__name__}).")
    args.kvroll_policy_kwargs = _as_dict("kvroll_policy_kwargs", args.kvroll_policy_kwargs)
    if args.kvroll_mode not in KVROLL_MODES:
        raise ValueError(f"kvroll_mode={args.kvroll_mode!r} is invalid; choose one of {list(KVROLL_MODES)}.")
    if args.kvroll_dtype not in KVROLL_DTYPES:
        raise ValueError(f"kvroll_dtype={args.kvroll_dtype!r} is invalid; choose one of {list(KVROLL_DTYPES)}.")
    if args.kvroll_max_batch is not None and not (as_int(args.kvroll_max_batch) is not None
                                                  and args.kvroll_max_batch >= 1):
        raise ValueError(f"kvroll_max_batch={args.kvroll_max_batch!r} is invalid: use an integer >= 1, or null for "
                         "the rows of one generation call.")
    if args.kvroll_max_batch is not None:
        args.kvroll_max_batch = as_int(args.kvroll_max_batch)
    if as_int(args.kvroll_budget) is not None:  # a numpy budget as a Python int (to_json_string, run.json, Ray)
        args.kvroll_budget = as_int(args.kvroll_budget)
    _check_correction(args)
    if not args.use_kvroll:
        _warn_unused(args)
        return None
    if getattr(args, "use_vllm", False):
        raise ValueError("use_kvroll=True and use_vllm=True are exclusive: both replace the trainer's rollout "
                         "backend. Set use_vllm=False to generate with kvroll, or use_kvroll=False for vLLM.")
    for name in ("use_transformers_continuous_batching", "use_transformers_paged"):  # the second: TRL's old alias
        if getattr(args, name, False):  # (checked here, before TRL's __post_init__ copies the alias to the first)
            raise ValueError(f"use_kvroll=True and {name}=True are exclusive: both replace the trainer's rollout "
                             f"backend; set {name}=False.")
    if getattr(args, "vllm_structured_outputs_regex", None) is not None:
        raise ValueError("vllm_structured_outputs_regex is not supported with use_kvroll=True (kvroll does not "
                         "constrain decoding); unset it, or set use_kvroll=False.")
    length = args.max_completion_length
    if not positive(length, True):
        raise ValueError(f"max_completion_length={length!r} is invalid with use_kvroll=True: use an integer >= 1, "
                         "the tokens generated per completion (e.g. 256).")
    temperature = getattr(args, "temperature", 1.0)
    if not sampling_temperature(temperature):
        raise ValueError(f"temperature={temperature!r} is invalid with use_kvroll=True: use a finite sampling "
                         f"temperature >= {MIN_TEMPERATURE} (e.g. 1.0). The trainer divides the logits by it (0 gives "
                         "NaN losses), and kvroll would sample greedily: a group of identical completions has no "
                         "advantage to learn from.")
    _check_ray_fields(args)
    if args.kvroll_policy == "full" and args.kvroll_budget == _BUDGET_DEFAULT:
        args.kvroll_budget = None  # the field's default, not the user's: no warning that 'full' ignores it
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
    _check_sampling(args)
    if getattr(args, "loss_type", None) == "vespo" and getattr(args, "vllm_importance_sampling_correction", False) \
            and args.vllm_importance_sampling_mode not in ("token_truncate", "token_mask"):
        raise ValueError("loss_type='vespo' with use_kvroll=True needs vllm_importance_sampling_mode "
                         f"'token_truncate' or 'token_mask', got {args.vllm_importance_sampling_mode!r}.")
    return compression


# How a rollout's SamplingParams fields are read from the config (``sampling_settings``), one conversion each.
SAMPLING_CONVERSIONS = {
    "max_new_tokens": int, "temperature": float, "top_p": float, "top_k": lambda v: int(v or 0),
    "min_p": lambda v: float(v or 0.0), "repetition_penalty": float, "stop_token_ids": lambda v: tuple(v or ()),
    "ignore_eos": bool, "seed": int,
}


def sampling_settings(args) -> dict[str, tuple[Any, str]]:
    """Per ``SamplingParams`` field, (its value, converted, and where it came from): the trainer's fields,
    overridden by ``generation_kwargs`` (vLLM's ``max_tokens`` or HF's ``max_new_tokens``; ``do_sample: false`` is
    temperature 0), as the adapter samples a rollout. A conversion that fails raises naming the source."""
    kwargs = dict(args.generation_kwargs or {})

    def pick(key, default, field=None):
        return (kwargs[key], f"generation_kwargs[{key!r}]") if key in kwargs else (default, field or key)

    if "max_tokens" in kwargs and "max_new_tokens" in kwargs and kwargs["max_tokens"] != kwargs["max_new_tokens"]:
        raise ValueError(f"generation_kwargs sets max_tokens={kwargs['max_tokens']!r} and max_new_tokens="
                         f"{kwargs['max_new_tokens']!r} with use_kvroll=True: they are vLLM's and transformers' names "
                         "for one length; keep one.")
    length = "max_tokens" if "max_tokens" in kwargs else "max_new_tokens"
    raw = {"max_new_tokens": pick(length, args.max_completion_length, "max_completion_length"),
           "temperature": pick("temperature", getattr(args, "temperature", 1.0)),
           "top_p": pick("top_p", getattr(args, "top_p", 1.0)), "top_k": pick("top_k", getattr(args, "top_k", 0)),
           "min_p": pick("min_p", getattr(args, "min_p", None)),
           "repetition_penalty": pick("repetition_penalty", getattr(args, "repetition_penalty", 1.0)),
           "stop_token_ids": pick("stop_token_ids", None), "ignore_eos": pick("ignore_eos", False),
           "seed": pick("seed", getattr(args, "seed", 0))}
    if not isinstance(kwargs.get("do_sample", True), (bool, np.bool_)):  # "false" would be read as sampling
        raise ValueError(f"generation_kwargs['do_sample']={kwargs['do_sample']!r} is invalid with use_kvroll=True: "
                         "it must be True or False (a bool, not a string).")
    if kwargs.get("do_sample", True) is False:
        raw["temperature"] = (0.0, "generation_kwargs['do_sample']")
    out = {}
    for name, (value, source) in raw.items():
        try:  # a conversion that would change the value (2.7 -> 2, "false" -> True) is refused, as a failing one
            converted = SAMPLING_CONVERSIONS[name](value)
            kept = value is None or name == "stop_token_ids" or _same_value(value, converted)
        except (TypeError, ValueError):
            kept = False
        if not kept:
            raise ValueError(f"{source}={value!r} is invalid with use_kvroll=True: it must be "
                             f"{_KINDS.get(name, 'a number')} (SamplingParams.{name}).") from None
        out[name] = (converted, source)
    return out


_KINDS = {"stop_token_ids": "a list of token ids", "ignore_eos": "True or False", "max_new_tokens": "an integer",
          "top_k": "an integer", "seed": "an integer"}


def _same_value(value, converted) -> bool:
    """Whether a conversion kept the value: equal, both bools or neither, and a NaN stays a NaN (for the range
    checks to name); numpy scalars count as numbers."""
    if isinstance(value, (bool, np.bool_)) != isinstance(converted, (bool, np.bool_)):
        return False
    if isinstance(value, str):
        return False
    try:
        return bool(value == converted) or (value != value and converted != converted)
    except (TypeError, ValueError):
        return False


def _check_sampling(args) -> None:
    """The rollout's sampling settings, checked as ``SamplingParams`` checks them, before any model loads; each error
    names the field or ``generation_kwargs`` key it came from. A setting that samples greedily is refused as the
    ``temperature`` field is: a group of identical completions has no advantage to learn from."""
    def given(source, value):  # as the user wrote it
        key = source[len("generation_kwargs['"):-2] if source.startswith("generation_kwargs[") else None
        return args.generation_kwargs[key] if key is not None else getattr(args, source, value)

    settings = sampling_settings(args)
    value, source = settings["temperature"]
    if source != "temperature" and not sampling_temperature(value):
        raise ValueError(f"{source}={given(source, value)!r} is invalid with use_kvroll=True: kvroll would sample "
                         f"{'greedily' if value == 0 else 'at it'}, while the trainer scores at temperature="
                         f"{getattr(args, 'temperature', 1.0)!r}; a group of identical completions has no advantage "
                         f"to learn from. Use a finite temperature >= {MIN_TEMPERATURE}, or drop it from "
                         "generation_kwargs.")
    length, source = settings["max_new_tokens"]
    if source != "max_completion_length" and length > args.max_completion_length:
        raise ValueError(f"{source}={given(source, length)!r} is invalid with use_kvroll=True: it is longer than "
                         f"max_completion_length={args.max_completion_length!r}, which sizes the trainer's "
                         f"completions and kvroll's cache; raise max_completion_length to {length}, or drop it "
                         "from generation_kwargs.")
    for name, (value, source) in settings.items():
        if name == "seed":  # any integer: the adapter mixes it with the call and the rank into the engine's range
            continue
        reason = sampling_refusal(name, value)
        if reason is not None:
            raise ValueError(f"{source}={given(source, value)!r} is invalid with use_kvroll=True: {reason}")


def sampling_refusal(name: str, value) -> str | None:
    """Why ``SamplingParams`` refuses ``name=value`` (its message after "is invalid"), or None where it takes it."""
    from kvroll.rollout.sampling import SamplingParams

    try:
        SamplingParams(**{name: value})
    except (TypeError, ValueError) as err:
        return str(err).split(" is invalid", 1)[-1].lstrip(":; ")
    return None


def _check_correction(args) -> None:
    if args.kvroll_correction not in CORRECTIONS:
        raise ValueError(f"kvroll_correction={args.kvroll_correction!r} is invalid; choose one of "
                         f"{list(CORRECTIONS)}.")
    if args.kvroll_rejection_statistic not in REJECTION_STATISTICS:
        raise ValueError(f"kvroll_rejection_statistic={args.kvroll_rejection_statistic!r} is invalid; choose one of "
                         f"{list(REJECTION_STATISTICS)}.")
    threshold = args.kvroll_rejection_threshold
    if not (finite_number(threshold) and threshold > 0):
        raise ValueError(f"kvroll_rejection_threshold={threshold!r} is invalid: use a number of nats per token > 0 "
                         "(e.g. 0.3).")
    if args.kvroll_correction == "none":
        return
    fix = "or set kvroll_correction='none'"
    if not args.use_kvroll:
        raise ValueError(f"kvroll_correction={args.kvroll_correction!r} corrects kvroll's rollouts, but "
                         f"use_kvroll=False: set use_kvroll=True, {fix}.")
    if hasattr(args, "vllm_importance_sampling_correction"):  # GRPO and PPO; RLOO has no importance sampling
        if not args.vllm_importance_sampling_correction:
            raise ValueError(f"kvroll_correction={args.kvroll_correction!r} reweights the kept rollouts with the "
                             "importance ratio, but vllm_importance_sampling_correction=False: set it to True, "
                             f"{fix}.")
        if args.vllm_importance_sampling_mode != "token_truncate":
            raise ValueError(f"kvroll_correction={args.kvroll_correction!r} reweights the kept rollouts per token "
                             "(TRL's truncated importance sampling), but vllm_importance_sampling_mode="
                             f"{args.vllm_importance_sampling_mode!r}: set vllm_importance_sampling_mode="
                             f"'token_truncate', {fix}.")
    if getattr(args, "loss_type", None) == "vespo":
        raise ValueError(f"kvroll_correction={args.kvroll_correction!r} cannot drop rows under loss_type='vespo' "
                         f"(VESPO reads the importance ratio as a log-weight, not a loss weight): choose another "
                         f"loss_type, {fix}.")


def _check_ray_fields(args) -> None:
    if not positive(args.kvroll_num_workers, True):
        raise ValueError(f"kvroll_num_workers={args.kvroll_num_workers!r} is invalid: use an integer >= 1.")
    gpus = args.kvroll_gpus_per_worker
    if gpus is not None and not ((positive(gpus, False) or gpus == 0) and finite_number(gpus)):
        raise ValueError(f"kvroll_gpus_per_worker={gpus!r} is invalid: use a finite number >= 0 (fractions share a "
                         "GPU), or null for 1 GPU per worker when the cluster has them.")
    if not (positive(args.kvroll_worker_timeout_s, False) and finite_number(args.kvroll_worker_timeout_s)):
        raise ValueError(f"kvroll_worker_timeout_s={args.kvroll_worker_timeout_s!r} is invalid: use a finite number "
                         "of seconds > 0 (e.g. 600; Ray's waits take no infinite timeout).")
    if not positive(args.kvroll_sync_bucket_mb, True):
        raise ValueError(f"kvroll_sync_bucket_mb={args.kvroll_sync_bucket_mb!r} is invalid: use an integer >= 1.")
    args.kvroll_num_workers, args.kvroll_sync_bucket_mb = as_int(args.kvroll_num_workers), as_int(
        args.kvroll_sync_bucket_mb)
    # numpy numbers as Python's (run.json, Ray)
    args.kvroll_gpus_per_worker, args.kvroll_worker_timeout_s = plain(args.kvroll_gpus_per_worker), plain(
        args.kvroll_worker_timeout_s)
    if args.kvroll_mode == "ray":  # colocate ignores the address (and warns below)
        _check_ray_address(args.kvroll_ray_address)
    else:
        changed = _changed_fields(args, RAY_FIELDS)
        if changed:
            warnings.warn(f"{', '.join(changed)} {'is' if len(changed) == 1 else 'are'} ignored: only "
                          f"kvroll_mode='ray' uses the Ray fields, and kvroll_mode={args.kvroll_mode!r}. Set "
                          "kvroll_mode: ray for Ray rollout workers, or drop them.", UserWarning, stacklevel=2)


def _warn_unused(args: Any) -> None:
    """use_kvroll=False: a warning naming the kvroll fields set away from their defaults, which TRL's own rollouts
    ignore (kvroll_correction, which would change the loss, is an error in ``_check_correction`` instead)."""
    names = [f.name for f in fields(KVRollArguments) if f.name.startswith("kvroll_")
             and not f.name.startswith(("kvroll_correction", "kvroll_rejection"))
             and not (f.name == "kvroll_policy_kwargs" and not args.kvroll_policy_kwargs)]  # (None normalised to {})
    unused = _changed_fields(args, names)
    if unused:
        warnings.warn(f"{', '.join(unused)} {'is' if len(unused) == 1 else 'are'} ignored: use_kvroll=False "
                      "generates with TRL's own path. Set use_kvroll=True to roll out with kvroll, or drop them.",
                      UserWarning, stacklevel=3)


def _changed_fields(args: Any, names) -> list[str]:
    """``name=value`` of each of ``KVRollArguments``' fields ``names`` that ``args`` sets away from its default."""
    defaults = {f.name: f.default for f in fields(KVRollArguments)}
    return [f"{name}={getattr(args, name)!r}" for name in names if getattr(args, name) != defaults[name]]


def positive(value, integer: bool) -> bool:
    """A number > 0, Python's or numpy's (an integer with ``integer``), not a bool."""
    if integer:
        return as_int(value) is not None and value > 0
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_)) \
        and value > 0


RAY_FIELDS = ("kvroll_num_workers", "kvroll_gpus_per_worker", "kvroll_ray_address", "kvroll_worker_timeout_s",
              "kvroll_sync_bucket_mb")


def _check_ray_address(address) -> None:
    """What ``kvroll.rollout.cluster.connect`` joins: null/'' (here, else a new local cluster), 'auto', HOST:PORT
    or ray://HOST[:PORT] (Ray Client)."""
    if address is None or address in ("", "auto"):
        return
    problem = None
    if not isinstance(address, str):
        problem = f"of type {type(address).__name__}, not a string"
    else:
        parsed = urlparse(address if "://" in address else f"ray://{address}")
        try:
            port = parsed.port
        except ValueError:  # not a number, or out of range
            port, problem = None, "its port is not a number in 1..65535"
        if port == 0:
            problem = "its port is not a number in 1..65535"
        if problem is None and (parsed.scheme != "ray" or not parsed.hostname or parsed.path or parsed.query):
            problem = "not HOST:PORT"
        elif problem is None and port is None and "://" not in address:
            problem = "no port"
    if problem:
        raise ValueError(f"kvroll_ray_address={address!r} is invalid ({problem}): use HOST:PORT (the head's GCS "
                         "port, e.g. 10.0.0.1:6379, as scripts/ray_cluster.sh head prints), ray://HOST:PORT, 'auto', "
                         "or null to join the cluster running here, else start a local one.")


def sampling_temperature(value) -> bool:
    """A number (not a bool) a trainer can divide its logits by: >= ``MIN_TEMPERATURE``, the engine's smallest
    sampling temperature (0, the engine's greedy, is not one)."""
    return finite_number(value) and value >= MIN_TEMPERATURE


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
