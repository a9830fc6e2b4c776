"""The rollout metrics the adapter logs every generation, and the step timer that gives the rollout's share.

    stats = rollout_metrics(prompt_lengths, completions, max_new_tokens=32, stop_ids={2}, capacity=88,
                            bytes_per_token=kv_bytes_per_token(model.config, torch.bfloat16))
    trainer.add_callback(StepTimer(generation))      # kvroll/rollout_share, kvroll/step_seconds

Per-row KV accounting. A row of prompt length p and completion length c writes w = p + c - 1 tokens to its cache
(the last sampled token is never fed back). A slot holds at most ``capacity`` tokens: the budget, plus the buffer
for ``rkv`` / ``snapkv`` and the interval for ``hardkv`` (``policy.capacity``; unbounded for ``full``); a longer
prompt is compressed at prefill to ``prompt_keep`` tokens (``cache.prefill_limit()``: budget - 1 for the step
policies), so the row holds h = min(min(p, prompt_keep) + c - 1, capacity). Summed over the step's rows (every
rank's; in the adapter's local mode, GRPO tools or environments on several colocated processes, over the logging
rank's own rows, since that mode has no collective):

* ``kvroll/kv_bytes_full_equivalent`` = bytes_per_token x sum(w): what full KV holds for these rows at their end;
* ``kvroll/kv_bytes`` = bytes_per_token x sum(h): what the compressed cache holds for them;
* ``kvroll/evicted_tokens`` = sum(w - h): the tokens that did not fit, which the policy evicted.
  Exact for the step policies (``longflow``, ``h2o``, ``streaming``, ``random``); a buffered policy compresses to
  the budget when its buffer fills, so it evicted up to ``capacity - budget`` more per row than counted here.
* ``kvroll/kv_ratio`` = kv_bytes / kv_bytes_full_equivalent.

``bytes_per_token`` = layers x 2 x kv_heads x head_dim x dtype bytes (K and V of one token in every layer).
``kvroll/kv_cache_mib`` (logged by the adapter) is apart: the cache the engines allocated, all slots.
"""
from __future__ import annotations

import time

from transformers import TrainerCallback


def kv_bytes_per_token(config, dtype) -> int:
    """K + V bytes of one token in every layer of a model with this HF ``config``, stored as ``dtype``."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element = dtype.itemsize if hasattr(dtype, "itemsize") else int(dtype)
    return config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * element


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation between order statistics (numpy's default)."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def rollout_metrics(prompt_lengths: list[int], completions: list[list[int]], max_new_tokens: int, stop_ids,
                    capacity: int | None, bytes_per_token: int, prompt_keep: int | None = None) -> dict[str, float]:
    """Completion lengths, truncation and per-row KV accounting (module doc) of one generation's rows;
    ``prompt_keep`` None: prompts are kept whole at prefill."""
    lengths = [len(ids) for ids in completions]
    stop_ids = set(stop_ids)
    truncated = [len(ids) >= max_new_tokens and (not ids or ids[-1] not in stop_ids) for ids in completions]
    written = [p + c - 1 for p, c in zip(prompt_lengths, lengths)]
    kept = [p if prompt_keep is None else min(p, prompt_keep) for p in prompt_lengths]
    held = [k + c - 1 if capacity is None else min(k + c - 1, capacity) for k, c in zip(kept, lengths)]
    full_bytes, kv_bytes = bytes_per_token * sum(written), bytes_per_token * sum(held)
    return {
        "kvroll/completion_length/mean": sum(lengths) / len(lengths),
        "kvroll/completion_length/p50": percentile(lengths, 50),
        "kvroll/completion_length/p90": percentile(lengths, 90),
        "kvroll/completion_length/max": max(lengths),
        "kvroll/truncated_fraction": sum(truncated) / len(truncated),
        "kvroll/kv_bytes": kv_bytes,
        "kvroll/kv_bytes_full_equivalent": full_bytes,
        "kvroll/kv_ratio": kv_bytes / max(full_bytes, 1),
        "kvroll/evicted_tokens": sum(written) - sum(held),
    }


class StepTimer(TrainerCallback):
    """Times each optimizer step and logs ``kvroll/step_seconds`` and ``kvroll/rollout_share`` (the rollout
    seconds the adapter counted in the step over its wall time) before the step's logs are written."""

    def __init__(self, generation):
        self.generation, self.start = generation, None

    def on_step_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()
        self.generation.step_rollout_seconds = 0.0

    def on_step_end(self, args, state, control, **kwargs):
        if self.start is None:
            return
        seconds = time.perf_counter() - self.start
        self.generation._log("kvroll/step_seconds", seconds)
        self.generation._log("kvroll/rollout_share", self.generation.step_rollout_seconds / max(seconds, 1e-9))
        self.start = None
