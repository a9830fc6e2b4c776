"""RolloutWorker without Ray: built from a config, fed through the bucket plan, it generates as an engine built on
the trainer's own model does; it refuses stale or unsynced weights; checksums catch a single flipped byte."""
from __future__ import annotations

import copy

import pytest
import torch

from kvroll import CompressionConfig, RolloutEngine, SamplingParams
from kvroll.rollout.weights import BucketPlan, bucket_checksum
from kvroll.rollout.worker import RolloutWorker, StaleWeightsError

from ..conftest import lora_model, tiny_model

PROMPTS = [[1, 2, 3, 4, 5, 6], [9, 8, 7], [4, 4, 4, 4]]


def _feed(worker: RolloutWorker, model, plan: BucketPlan, version: int):
    worker.begin_sync(version)
    sums = []
    for index in range(len(plan)):
        with plan.fetch(model, index) as tensors:
            buffer = plan.pack(index, tensors, plan.new_buffer(index, "cpu"))
        sums.append(bucket_checksum(buffer))
        assert worker.load_bucket(index, buffer) == sums[-1]
    worker.finish_sync(version)
    return sums


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_worker_from_config_generates_like_the_engine(family):
    model = tiny_model(family)
    plan = BucketPlan.for_model(model, bucket_bytes=1 << 16)
    assert len(plan) > 1  # several buckets, so the layout across buckets is exercised
    assert {"model.rotary_emb.inv_freq"} <= set(plan.names())  # buffers travel too: a meta-built model has none
    worker = RolloutWorker(model.config.to_dict(), CompressionConfig("longflow", 16), max_batch=4, dtype="float32",
                           device="cpu", generation_config=model.generation_config.to_dict())
    worker.set_plan(plan)
    sums = _feed(worker, model, plan, version=1)
    assert worker.checksum() == sums == plan.checksums(model)
    sampling = SamplingParams(max_new_tokens=20, temperature=0.8, seed=3)
    got = worker.generate(PROMPTS, sampling, n=2, min_version=1)
    want = RolloutEngine(model, compression=CompressionConfig("longflow", 16), max_batch=4).generate(
        PROMPTS, sampling, n=2)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    torch.testing.assert_close([c.logprobs for c in got], [c.logprobs for c in want])
    assert all(c.weight_version == 1 for c in got)


def test_a_lora_model_reaches_the_worker_merged_under_base_names():
    peft = pytest.importorskip("peft")
    model = lora_model(peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj"]))
    merged = copy.deepcopy(model).merge_and_unload().eval()  # peft's own merge, the independent reference
    plan = BucketPlan.for_model(model, bucket_bytes=1 << 16)
    assert plan.names() == BucketPlan.for_model(merged, bucket_bytes=1 << 16).names()  # no lora_A/B, base_layer
    worker = RolloutWorker(model.config.to_dict(), CompressionConfig("full"), max_batch=4, dtype="float32",
                           device="cpu", generation_config=model.generation_config.to_dict())
    worker.set_plan(plan)
    sums = _feed(worker, model, plan, version=1)
    assert worker.checksum() == sums == plan.checksums(merged) != plan.checksums(copy.deepcopy(model).unload())
    sampling = SamplingParams(max_new_tokens=20, temperature=0.0)
    got = worker.generate(PROMPTS, sampling, min_version=1)
    want = RolloutEngine(merged, compression=CompressionConfig("full"), max_batch=4).generate(PROMPTS, sampling)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]


def test_worker_refuses_stale_and_in_flux_weights():
    model = tiny_model("llama")
    plan = BucketPlan.for_model(model)
    worker = RolloutWorker(model.config.to_dict(), CompressionConfig("full"), max_batch=2, dtype="float32",
                           device="cpu")
    worker.set_plan(plan)
    with pytest.raises(StaleWeightsError, match="version -1"):
        worker.generate([[1, 2]], SamplingParams(max_new_tokens=2), min_version=0)  # never synced
    _feed(worker, model, plan, version=3)
    with pytest.raises(StaleWeightsError, match="version 3, the trainer's is 4"):
        worker.generate([[1, 2]], SamplingParams(max_new_tokens=2), min_version=4)
    worker.begin_sync(4)  # weights in flux until finish_sync
    with pytest.raises(StaleWeightsError):
        worker.generate([[1, 2]], SamplingParams(max_new_tokens=2), min_version=3)


def test_checksum_sees_one_flipped_byte_and_moved_words():
    model = tiny_model("llama")
    plan = BucketPlan.for_model(model, dtype=torch.bfloat16)
    with plan.fetch(model, 0) as tensors:
        buffer = plan.pack(0, tensors, plan.new_buffer(0, "cpu"))
    assert buffer.numel() % 8 == 0 and buffer.numel() == plan.sizes[0]
    base = bucket_checksum(buffer)
    for position in (0, buffer.numel() // 3, buffer.numel() - 1):
        flipped = buffer.clone()
        flipped[position] ^= 1
        assert bucket_checksum(flipped) != base
    words = buffer.clone().view(torch.int64)
    words[[5, 9000]] = words[[9000, 5]].clone()  # two words trade places
    if not torch.equal(words, buffer.view(torch.int64)):
        assert bucket_checksum(words.view(torch.uint8)) != base
    # two distinct words of one 1024-word row trade places, then two of one column (the row and column weights)
    for a, b in ((0, 1023), (0, 1024)):
        words = buffer.clone().view(torch.int64)
        distinct = next(i for i in range(a, words.numel() - (b - a)) if int(words[i]) != int(words[i + b - a]))
        words[[distinct, distinct + b - a]] = words[[distinct + b - a, distinct]].clone()
        assert (distinct % 1024 == (distinct + b - a) % 1024) == (b - a == 1024)  # same column / same row
        assert bucket_checksum(words.view(torch.uint8)) != base, (a, b)
    # bf16 packing halves the float bytes and round-trips exactly through unpack
    target = tiny_model("llama").to(torch.bfloat16)
    plan.unpack(0, buffer, dict(target.named_parameters()) | dict(target.named_buffers()))
    name = plan.buckets[0][0].name
    torch.testing.assert_close(dict(target.named_parameters())[name], dict(model.named_parameters())[name].to(
        torch.bfloat16), rtol=0, atol=0)


def test_worker_rejects_a_plan_for_another_architecture():
    small, other = tiny_model("llama"), tiny_model("llama", layers=3)
    worker = RolloutWorker(small.config.to_dict(), CompressionConfig("full"), max_batch=1, dtype="float32",
                           device="cpu")
    with pytest.raises(ValueError, match="same architecture"):
        worker.set_plan(BucketPlan.for_model(other))
