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


def _cpu_worker(model, plan: BucketPlan | None = None, max_batch: int = 2) -> RolloutWorker:
    """A ``full`` fp32 CPU worker built from ``model``'s config, given ``plan`` when one is."""
    worker = RolloutWorker(model.config.to_dict(), CompressionConfig("full"), max_batch=max_batch, dtype="float32",
                           device="cpu")
    if plan is not None:
        worker.set_plan(plan)
    return worker


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
    worker = _cpu_worker(model, plan, max_batch=2)
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
    worker = _cpu_worker(small, max_batch=1)
    with pytest.raises(ValueError, match="same architecture"):
        worker.set_plan(BucketPlan.for_model(other))


def test_worker_rejects_a_plan_that_leaves_some_of_its_tensors_unsent():
    """The worker's model is built on empty memory: a plan without some of its tensors (a trainer with fewer
    layers) would leave them holding whatever that memory held, and the version would still read as verified."""
    big, fewer = tiny_model("llama", layers=3), tiny_model("llama")
    worker = _cpu_worker(big, max_batch=1)
    with pytest.raises(ValueError, match=r"has \['model.layers.2.*which the trainer does not send; both sides must"):
        worker.set_plan(BucketPlan.for_model(fewer))
    worker.set_plan(BucketPlan.for_model(big))  # the whole model's plan is taken


def _send_version_1(rank0, worker, plan, model, indices) -> list[int]:
    """Broadcast ``indices`` of version 1 from ``rank0`` to ``worker``; the buckets the pool would resend (those the
    worker reports unverified, None, or with other sums than were sent), as ``RolloutPool._send_verified`` counts."""
    import threading

    from kvroll.rollout.weight_sync import send_buckets

    received = {}
    thread = threading.Thread(target=lambda: received.update(worker.receive(1, indices)))
    thread.start()
    sent = send_buckets(rank0, plan, indices, plan.fetcher(model), "cpu")
    thread.join(timeout=60)
    return sorted(i for i in indices if received[i] is None or tuple(received[i]) != sent[i])


def _gloo_pair(worker, store_timeout_s=30):
    """Rank 0 here and ``worker`` on rank 1 of an in-process gloo sync group (as test_weight_sync.py builds one)."""
    import threading

    from kvroll.rollout.weight_sync import SyncGroup, open_store

    store = open_store("127.0.0.1", timeout_s=store_timeout_s)
    joined = threading.Thread(target=worker.join_group, args=("127.0.0.1", store.port, 1, 2, "gloo", 1, 30))
    joined.start()
    rank0 = SyncGroup("127.0.0.1", store.port, 0, 2, "gloo", generation=1, timeout_s=30, store=store)
    joined.join()
    return rank0


def test_a_damaged_bucket_keeps_the_worker_from_its_version_until_the_resend():
    """A bucket damaged on the way is loaded (in place) but not verified: the worker must not hold the version, and
    refuse to generate, until the resend arrives intact; then it holds it, counted as one sync."""
    model = tiny_model("llama", seed=1)
    plan = BucketPlan.for_model(model, bucket_bytes=40_000)
    worker = _cpu_worker(model, plan, max_batch=2)
    rank0 = _gloo_pair(worker)

    def attempt(indices):
        return _send_version_1(rank0, worker, plan, model, indices)

    try:
        assert attempt([0]) == [] and worker.version() == -1  # part of a version is not the version
        worker.inject_fault("corrupt", index=3, times=1)
        assert attempt(list(range(len(plan)))) == [3]
        assert worker.version() == -1
        with pytest.raises(StaleWeightsError):
            worker.generate([[1, 2]], SamplingParams(max_new_tokens=2), min_version=1)
        assert attempt([3]) == [] and worker.version() == 1 and worker.metrics()["syncs"] == 1
        assert attempt([3]) == [] and worker.version() == 1 and worker.metrics()["syncs"] == 1  # a resend, not a sync
        assert worker.checksum() == plan.checksums(model)
    finally:
        rank0.close()
        worker.group.close()


def test_a_bucket_of_another_shape_is_refused_by_name():
    """The names match, a shape does not (another intermediate_size): unpacking refuses with the tensor's name and
    both shapes, not with torch's own message from ``copy_`` (or a broadcast into the model)."""
    import copy

    from transformers import LlamaForCausalLM

    model = tiny_model("llama")
    config = copy.deepcopy(model.config)
    config.intermediate_size = 96
    wide = LlamaForCausalLM(config).eval()
    plan = BucketPlan.for_model(wide, bucket_bytes=1 << 16)
    worker = _cpu_worker(model, plan, max_batch=1)  # the same names
    index = next(i for i, bucket in enumerate(plan.buckets) if any("mlp" in spec.name for spec in bucket))
    with plan.fetch(wide, index) as tensors:
        buffer = plan.pack(index, tensors, plan.new_buffer(index, "cpu"))
    worker.begin_sync(1)
    with pytest.raises(ValueError, match=r"mlp\.\w+\.weight' has shape .* on the worker, .* on the trainer"):
        worker.load_bucket(index, buffer)


def test_finish_sync_without_begin_sync_is_refused():
    """``finish_sync`` marks weights verified: only the version whose sync ``begin_sync`` opened."""
    model = tiny_model("llama")
    plan = BucketPlan.for_model(model)
    worker = _cpu_worker(model, plan, max_batch=1)
    with pytest.raises(RuntimeError, match=r"finish_sync\(2\) without begin_sync\(2\)"):
        worker.finish_sync(2)
    assert worker.version() == -1
    worker.begin_sync(1)
    with pytest.raises(RuntimeError, match=r"finish_sync\(2\) without begin_sync\(2\)"):
        worker.finish_sync(2)
    assert worker.version() == -1


def test_checksum_sees_two_words_of_the_last_partial_row_trade_places():
    """The words after the last full 1024-word row (the tail) count in the column sums too: two of them trading
    places changes the checksum (their row sum alone does not)."""
    words = torch.arange(1, 1024 + 10, dtype=torch.int64)  # one full row and a 9-word tail
    base = bucket_checksum(words.view(torch.uint8))
    swapped = words.clone()
    swapped[[1024, 1030]] = swapped[[1030, 1024]].clone()
    assert bucket_checksum(swapped.view(torch.uint8)) != base


def test_checksum_sees_every_single_flipped_bit_of_a_word():
    """A changed word must change the checksum whatever its row, column and bit: with even weights a flipped top bit
    (2**63: the sign of the word's last float) in an odd row and odd column wrapped to zero in both sums, and a bf16
    or fp32 weight changed sign, or its exponent jumped (bit 62: -0.0157 became -5.3e36), unseen."""
    model = tiny_model("llama")
    plan = BucketPlan.for_model(model, bucket_bytes=1 << 20)
    with plan.fetch(model, 0) as tensors:
        buffer = plan.pack(0, tensors, plan.new_buffer(0, "cpu"))
    assert buffer.numel() // 8 > 8 * 1024  # rows 0..7 are full rows
    base = bucket_checksum(buffer)
    for row, col in ((1, 1), (3, 3), (7, 7), (1, 1023), (7, 511)):
        for bit in range(56, 64):  # the word's last byte: the high bits, where the wrapping sums lose them
            flipped = buffer.clone()
            flipped[(row * 1024 + col) * 8 + 7] ^= 1 << (bit - 56)
            assert bucket_checksum(flipped) != base, (row, col, bit)


def test_a_bucket_whose_carried_checksum_is_damaged_is_reported_unverified_and_its_resend_completes(monkeypatch):
    """The worker checks each bucket against the checksum it carries (its trailer) and generates only once every
    bucket passed; the pool resends what the workers report as differing from its own sums. A trailer damaged on the
    way (the payload intact) must be reported too: reported as the payload's (equal to the sender's) checksum, the
    pool counted the worker current while the worker refused every shard as stale."""
    import threading

    import kvroll.rollout.weight_sync as ws
    from kvroll.rollout.weight_sync import SyncGroup, open_store

    model = tiny_model("llama", seed=1)
    plan = BucketPlan.for_model(model, bucket_bytes=40_000)
    worker = _cpu_worker(model, plan, max_batch=2)
    store = open_store("127.0.0.1", timeout_s=30)
    joined = threading.Thread(target=worker.join_group, args=("127.0.0.1", store.port, 1, 2, "gloo", 1, 30))
    joined.start()
    rank0 = SyncGroup("127.0.0.1", store.port, 0, 2, "gloo", generation=1, timeout_s=30, store=store)
    joined.join()
    seal, damaged = ws._seal, []

    def damage_trailer(plan, index, message, times):
        checksum = seal(plan, index, message, times)
        if index == 2 and not damaged:
            message[plan.sizes[index]] ^= 1
            damaged.append(index)
        return checksum

    monkeypatch.setattr(ws, "_seal", damage_trailer)

    def attempt(indices):
        return _send_version_1(rank0, worker, plan, model, indices)

    try:
        assert attempt(list(range(len(plan)))) == [2] and damaged == [2]
        assert worker.version() == -1  # the worker does not hold version 1 yet
        assert attempt([2]) == [] and worker.version() == 1  # the resend completes it
        assert worker.checksum() == plan.checksums(model)
    finally:
        rank0.close()
        worker.group.close()


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_on_cuda_a_worker_takes_the_trainers_plan_and_its_checksums_equal_the_cpus(family):
    """On CUDA the engine installs its fusions (class swaps, joined projections) on the worker's model: its tensors
    must still be the trainer's names, every one sent (``set_plan``), and the checksums computed on the GPU must
    equal the CPU's of the same bytes; the worker then generates as an engine on the trainer's model does."""
    model = tiny_model(family).to(torch.bfloat16)
    plan = BucketPlan.for_model(model, bucket_bytes=1 << 16)
    worker = RolloutWorker(model.config.to_dict(), CompressionConfig("longflow", 16), max_batch=4, dtype="bfloat16",
                           device="cuda", generation_config=model.generation_config.to_dict())
    worker.set_plan(plan)
    sums = _feed(worker, model, plan, version=1)  # packed and summed on the CPU, loaded and summed on the GPU
    assert worker.checksum() == sums == plan.checksums(model)
    sampling = SamplingParams(max_new_tokens=12, temperature=0.0)
    want = RolloutEngine(model.cuda(), compression=CompressionConfig("longflow", 16), max_batch=4).generate(
        PROMPTS, sampling)
    assert [c.token_ids for c in worker.generate(PROMPTS, sampling, min_version=1)] == [c.token_ids for c in want]


def test_a_lora_plan_casts_the_merged_weights_to_the_workers_dtype():
    peft = pytest.importorskip("peft")
    model = lora_model(peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    merged = copy.deepcopy(model).merge_and_unload()
    plan = BucketPlan.for_model(model, dtype=torch.bfloat16)
    weights = {spec.dtype for bucket in plan.buckets for spec in bucket if spec.name.endswith(".weight")}
    assert weights == {torch.bfloat16}
    assert plan.checksums(model) == plan.checksums(merged)  # the merge in fp32, then one cast, as for a plain model


def test_each_completion_records_the_version_the_worker_holds_not_the_one_asked_for():
    """Completion.weight_version is the verified version generated with (docs/ray.md, Results): a worker holding a
    newer version than the caller's minimum records its own."""
    model = tiny_model("llama")
    plan = BucketPlan.for_model(model)
    worker = _cpu_worker(model, plan, max_batch=2)
    _feed(worker, model, plan, version=3)
    got = worker.generate([[1, 2]], SamplingParams(max_new_tokens=2, seed=0), n=2, min_version=1)
    assert [c.weight_version for c in got] == [3, 3]
