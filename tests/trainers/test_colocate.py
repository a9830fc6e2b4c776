"""ColocatedWeights without a trainer: storage sharing across device spellings, copies, bucketed sync."""
from __future__ import annotations

import torch

from kvroll.trainers.colocate import ColocatedWeights, _buckets, weights_checksum

from .tiny_model import tiny_llama, tokenizer


def test_shares_storage_when_the_device_is_spelled_cpu_0():
    # Accelerate names a CPU rank's device "cpu:0"; parameters say "cpu". Same storage must still be shared.
    model = tiny_llama(tokenizer())
    weights = ColocatedWeights(model, device="cpu:0")
    assert weights.first_sync["copied"] == 0 and weights.first_sync["shared"] > 0
    assert weights_checksum(weights.engine_model) == weights_checksum(model)


def test_copies_another_dtype_and_follows_updates():
    model = tiny_llama(tokenizer())
    weights = ColocatedWeights(model, dtype=torch.bfloat16, device="cpu")
    assert weights.first_sync["shared"] == 0 and weights.first_sync["copied"] > 0
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.add_(1.0)
    assert weights_checksum(weights.engine_model) != weights_checksum(model, torch.bfloat16)
    weights.sync()
    assert weights_checksum(weights.engine_model) == weights_checksum(model, torch.bfloat16)


def test_buckets_keep_order_and_cap_size():
    named = [(f"p{i}", torch.empty(n)) for i, n in enumerate([3, 4, 10, 1, 1, 2])]
    buckets = list(_buckets(named, max_numel=5))
    assert [[name for name, _ in b] for b in buckets] == [["p0"], ["p1"], ["p2"], ["p3", "p4", "p5"]]
