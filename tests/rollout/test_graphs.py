"""The windowed decode loop (sync every k steps), live-slot compaction and, on a GPU, CUDA-graph replay.

CPU: the loop with ``sync_every > 1`` and compaction into smaller batches gives the same greedy tokens as one
step at a time and as one prompt at a time. GPU (``gpu``): graphs replay the eager engine's greedy tokens.
"""
import random

from types import SimpleNamespace

import pytest
import torch

from kvroll import CompressionConfig, RolloutEngine, SamplingParams
from kvroll.rollout.graphs import batch_sizes, plain_head
from tests.conftest import tiny_model


def prompts_of(count, seed, low=3, high=30):
    rng = random.Random(seed)
    return [[rng.randrange(1, 256) for _ in range(rng.randint(low, high))] for _ in range(count)]


def test_batch_sizes_cover_every_live_count():
    assert batch_sizes(1) == [1]
    assert batch_sizes(6) == [1, 2, 4, 6]
    assert batch_sizes(8) == [1, 2, 4, 8]


def test_plain_head_is_none_for_a_head_or_model_with_a_hook(tiny_llama):
    """A forward hook (e.g. one casting the head's output to fp32) would be skipped by ``head_sample``, which
    multiplies the hidden states by the head's weight itself: such a model keeps its own head."""
    assert plain_head(tiny_llama) is tiny_llama.lm_head.weight
    for module in (tiny_llama, tiny_llama.lm_head):
        for register in (module.register_forward_hook, module.register_forward_pre_hook):
            handle = register(lambda *args: None)
            assert plain_head(tiny_llama) is None
            handle.remove()
    assert plain_head(tiny_llama) is tiny_llama.lm_head.weight


def _fake_event_graphs(monkeypatch, slots, **class_attrs):
    """``EventGraphs`` over a fake CPU cache: eager events land in ``cache.eager`` (their slots), captures in
    ``captured`` and replays in ``replayed`` (both as (count, first slot of a span or None)); ``class_attrs`` set
    on the class for the test (``max_graphs``, ``span_min``, ...)."""
    from kvroll.rollout.graphs import EventGraphs

    cache = SimpleNamespace(slots=slots, k=torch.zeros(1), eager=[], event_counts=None)
    cache.compress_slots = lambda due: cache.eager.append(list(due))
    captured, replayed = [], []

    def capture(self, count, first=None):
        captured.append((count, first))
        return SimpleNamespace(replay=lambda: replayed.append((count, first)))

    monkeypatch.setattr(EventGraphs, "_capture", capture)
    for name, value in class_attrs.items():
        monkeypatch.setattr(EventGraphs, name, value)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)  # no CUDA here: the slots copy stays on CPU
    return EventGraphs(cache), cache, captured, replayed


def test_event_graphs_capture_a_recurring_key_and_stop_at_max_graphs(monkeypatch):
    """An event key seen once runs eagerly, the second time it is captured and later replayed; past
    ``max_graphs`` graphs a new key always runs eagerly (LagKV's and Hard-KV's (count, sizes) keys are many)."""
    events, cache, captured, replayed = _fake_event_graphs(monkeypatch, 4, max_graphs=2)
    for due, sizes in [([0], [3]), ([0], [3]), ([1], [3]), ([0, 2], [0, 1]), ([0, 2], [0, 1]), ([1, 3], [1, 1]),
                       ([1, 3], [1, 1]), ([2], None), ([2], None), ([3], [3])]:
        events.run(due, sizes)
    assert captured == [(1, None), (2, None)]  # (1, (3,)) and (2, (0, 1)): then the cap
    # a capture runs nothing, so the second sight replays at once; [1] and [3] with sizes (3,) share a graph
    assert replayed == [(1, None), (1, None), (2, None), (1, None)]
    assert set(events.graphs) == {(1, (3,)), (2, (0, 1))}
    assert cache.eager == [[0], [0, 2], [1, 3], [1, 3], [2], [2]]
    assert events.eager_counts == {(1, (3,)), (2, (0, 1))}  # nothing remembered past the cap


def test_event_graphs_forget_keys_seen_once_past_max_seen(monkeypatch):
    """The keys seen once (not yet captured) are host memory that a long run of ever-new keys would grow: past
    ``max_seen`` of them they are forgotten, and a key then needs two more sights to be captured."""
    events, cache, captured, _ = _fake_event_graphs(monkeypatch, 4, max_seen=3)
    for size in (1, 2, 3, 4, 1):  # the 4th key clears the three before it: size 1 runs eagerly again
        events.run([0], [size])
        assert len(events.eager_counts) <= 3
    assert captured == [] and events.eager_counts == {(1, (4,)), (1, (1,))}
    events.run([0], [1])  # its second sight since it was forgotten: captured
    assert captured == [(1, None)] and set(events.graphs) == {(1, (1,))}
    assert len(cache.eager) == 5


def test_event_graphs_split_an_event_at_a_multiple_of_span_min(monkeypatch):
    """An in-phase event's count drifts as rows finish; split at its last multiple of ``span_min`` it reuses the
    keys of the two parts, and each part's compression sees its own sizes (``cache.event_counts``)."""
    from kvroll.rollout.graphs import EventGraphs

    events, cache, captured, _ = _fake_event_graphs(monkeypatch, 16, span_min=3)
    cache.event_counts = ["engine's"]
    cache.compress_slots = lambda due: cache.eager.append((list(due), cache.event_counts))
    assert EventGraphs.parts([4, 5, 6], [0, 1, 1]) == [([4, 5, 6], [0, 1, 1])]
    assert EventGraphs.parts([0, 1, 2, 3, 4, 5, 7], [0, 1, 1, 1, 1, 1, 1]) == [
        ([0, 1, 2, 3, 4, 5], [0, 1, 1, 1, 1, 1]), ([7], [1])]
    assert EventGraphs.parts([0, 1], None) == [([0, 1], None)]
    events.run([0, 1, 2, 3, 4, 5, 6], [1] * 7)  # both parts eager, each with its own sizes
    assert cache.eager == [([0, 1, 2, 3, 4, 5], [1] * 6), ([6], [1])]
    assert cache.event_counts == ["engine's"]  # restored
    events.run([0, 1, 2, 3, 4, 5, 6, 7], [1] * 8)  # 8 = 6 + 2: the 6 recur (captured), the 2 are new
    events.run([0, 1, 2, 3, 4, 5, 9], [1] * 7)  # 6 + 1: both recur
    assert captured == [(6, 0), (1, None)]
    assert set(events.graphs) == {("span", 0, (6, (1,) * 6)), (1, (1,))}
    assert cache.eager[-1] == ([6, 7], [1, 1])


def test_event_graphs_capture_a_large_contiguous_event_over_its_span(monkeypatch):
    """An event on ``span_min`` or more slots that are one ascending range gets its own graph, captured over that
    span (the policies then read views, not gathered copies); the same count elsewhere, or not contiguous, does
    not share it."""
    events, cache, captured, replayed = _fake_event_graphs(monkeypatch, 8, span_min=3)
    for due in ([2, 3, 4], [2, 3, 4], [2, 3, 4], [4, 5, 6], [4, 5, 6], [0, 2, 4], [0, 2, 4], [1, 2], [5, 6]):
        events.run(due, None)
    assert captured == [(3, 2), (3, 4), (3, None), (2, None)]
    assert replayed == [(3, 2), (3, 2), (3, 4), (3, None), (2, None)]
    assert set(events.graphs) == {("span", 2, 3), ("span", 4, 3), 3, 2}
    assert cache.eager == [[2, 3, 4], [4, 5, 6], [0, 2, 4], [1, 2]]
    assert events.slots[:2].tolist() == [5, 6]  # an index graph reads its slots from the buffer
    events.run([2, 3, 4], None)  # a span graph reads none: the buffer keeps what the last index event wrote
    assert replayed[-1] == (3, 2) and events.slots[:3].tolist() == [5, 6, 4]


@pytest.mark.parametrize("value", [0, -2, True, 2.0])
def test_sync_every_rejects_non_positive_and_non_int(tiny_llama, value):
    with pytest.raises(ValueError, match=f"RolloutEngine.sync_every={value!r} is invalid"):
        RolloutEngine(tiny_llama, sync_every=value)


def _stop_token_finishing_early(model, prompts, max_new):
    """A token that the first greedy sequence emits early: makes sequences end at different steps."""
    ref = RolloutEngine(model, max_batch=len(prompts)).generate(prompts, SamplingParams(max_new_tokens=max_new,
                                                                                         temperature=0.0))
    return ref[0].token_ids[len(ref[0].token_ids) // 4]


@pytest.mark.parametrize("policy,budget", [("full", None), ("longflow", 24), ("streaming", 20)])
def test_windows_and_compaction_keep_greedy_tokens(policy, budget):
    model = tiny_model("qwen3")
    prompts = prompts_of(7, seed=1)
    stop = _stop_token_finishing_early(model, prompts, 30)
    params = SamplingParams(max_new_tokens=30, temperature=0.0, stop_token_ids=(stop,))
    config = CompressionConfig(policy, budget=budget)
    stepwise = RolloutEngine(model, compression=config, max_batch=5, sync_every=1).generate(prompts, params)
    windowed_engine = RolloutEngine(model, compression=config, max_batch=5, sync_every=8)
    windowed = windowed_engine.generate(prompts, params)
    assert [r.token_ids for r in windowed] == [r.token_ids for r in stepwise]
    assert [r.finish_reason for r in windowed] == [r.finish_reason for r in stepwise]
    assert {r.finish_reason for r in windowed} == {"stop", "length"}  # uneven ends: refills, compaction
    for prompt, result in zip(prompts, windowed):  # independent of which slot / batch ran it
        alone = RolloutEngine(model, compression=config, max_batch=1).generate([prompt], params)[0]
        assert alone.token_ids == result.token_ids
        assert alone.logprobs == pytest.approx(result.logprobs, rel=1e-4, abs=1e-5)


def test_a_stop_id_past_the_vocabulary_never_stops_and_is_accepted():
    model = tiny_model("qwen3")
    prompts = prompts_of(3, seed=4)
    stop = _stop_token_finishing_early(model, prompts, 20)
    runs = []
    for stops in ((stop,), (stop, model.config.vocab_size, 2**64)):  # the last two can never be sampled
        params = SamplingParams(max_new_tokens=20, temperature=0.0, stop_token_ids=stops)
        runs.append(RolloutEngine(model, max_batch=3, sync_every=8).generate(prompts, params))
    assert [r.token_ids for r in runs[1]] == [r.token_ids for r in runs[0]]
    assert [r.finish_reason for r in runs[1]] == [r.finish_reason for r in runs[0]]


def test_compaction_moves_live_slots_to_the_front(tiny_llama):
    prompts = prompts_of(4, seed=2)
    engine = RolloutEngine(tiny_llama, compression=CompressionConfig("longflow", budget=32), max_batch=4)
    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    engine.generate(prompts, params)
    run_cache = engine.cache
    before = run_cache.k[:, 3].clone(), run_cache.pos[:, 3].clone(), int(run_cache.cur_pos[3])
    run_cache.move_slot(3, 0)
    assert torch.equal(run_cache.k[:, 0], before[0]) and torch.equal(run_cache.pos[:, 0], before[1])
    assert int(run_cache.cur_pos[0]) == before[2]
    view = run_cache.slot_view(2)
    assert view.k.shape[1] == 2 and view.k.data_ptr() == run_cache.k.data_ptr()


def test_periodic_policy_windows_stop_at_compression(tiny_llama):
    prompts = prompts_of(3, seed=3, low=10, high=20)
    params = SamplingParams(max_new_tokens=40, temperature=0.0)
    config = CompressionConfig("snapkv", budget=16, window=4, buffer=8)  # compresses every 8 steps
    stepwise = RolloutEngine(tiny_llama, compression=config, max_batch=3, sync_every=1).generate(prompts, params)
    windowed = RolloutEngine(tiny_llama, compression=config, max_batch=3, sync_every=16).generate(prompts, params)
    assert [r.token_ids for r in windowed] == [r.token_ids for r in stepwise]


def _gpu_qwen3():
    """A small random Qwen3 in bf16 on CUDA (GQA 4, head_dim 64), EOS off: the graph tests' model."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)
    model = Qwen3ForCausalLM(config).to("cuda", torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    return model


@pytest.mark.gpu
@pytest.mark.parametrize("policy,budget,kwargs", [
    ("full", None, {}), ("longflow", 40, {}), ("longflow", 40, {"granularity": "layer"}), ("h2o", 40, {}),
    ("snapkv", 24, {"window": 4, "buffer": 16}), ("rkv", 24, {"window": 4, "buffer": 8}),
    ("lagkv", 28, {"lag": 4, "sink_tokens": 4}),
    ("hardkv", 24, {"interval": 8, "window": 4, "sink_tokens": 2, "min_keep": 2, "p": 0.6}),
    ("hardkv", 24, {"interval": 8, "window": 4, "sink_tokens": 2, "min_keep": 2, "base": "rkv"}),
])
def test_cuda_graph_engine_equals_eager_greedy(policy, budget, kwargs):
    model = _gpu_qwen3()
    prompts = [[random.Random(i).randrange(1, 512) for _ in range(10 + 7 * i)] for i in range(6)]
    eager_probe = RolloutEngine(model, max_batch=4, cuda_graphs=False, sync_every=1)
    probe = eager_probe.generate(prompts, SamplingParams(max_new_tokens=64, temperature=0.0))
    stop = probe[0].token_ids[16]
    params = SamplingParams(max_new_tokens=64, temperature=0.0, stop_token_ids=(stop,))
    comp = CompressionConfig(policy, budget=budget, **kwargs)
    eager = RolloutEngine(model, compression=comp, max_batch=4, cuda_graphs=False).generate(prompts, params)
    graphed_engine = RolloutEngine(model, compression=comp, max_batch=4, cuda_graphs=True)
    graphed = graphed_engine.generate(prompts, params)
    assert graphed_engine._runner.graphs, "no CUDA graph was captured"
    if policy in ("rkv", "lagkv", "hardkv"):  # out-of-phase rows: events of one slot (and size) recur, replayed
        assert graphed_engine._runner.events.graphs, "no compression event was captured"
    assert [r.token_ids for r in graphed] == [r.token_ids for r in eager]
    sampled = SamplingParams(max_new_tokens=32, temperature=1.0, seed=5)
    again = [graphed_engine.generate(prompts, sampled) for _ in range(2)]
    assert [r.token_ids for r in again[0]] == [r.token_ids for r in again[1]]  # the seed drives the graphs


@pytest.mark.gpu
@pytest.mark.parametrize("policy,budget,kwargs", [
    ("snapkv", 24, {"window": 4, "buffer": 16}), ("rkv", 24, {"window": 4, "buffer": 8}),
    ("hardkv", 24, {"interval": 8, "window": 4, "sink_tokens": 2, "min_keep": 2, "p": 0.6}),
])
def test_in_phase_events_replayed_over_their_span_equal_eager(policy, budget, kwargs):
    """40 rows of one prompt length fill up together: their events hold every slot, one contiguous range, so
    they replay graphs captured over that span (``EventGraphs.span_min``); greedy tokens equal the eager engine's."""
    model = _gpu_qwen3()
    prompts = [[random.Random(i).randrange(1, 512) for _ in range(12)] for i in range(40)]
    params = SamplingParams(max_new_tokens=64, temperature=0.0)
    comp = CompressionConfig(policy, budget=budget, **kwargs)
    eager = RolloutEngine(model, compression=comp, max_batch=40, cuda_graphs=False).generate(prompts, params)
    graphed_engine = RolloutEngine(model, compression=comp, max_batch=40, cuda_graphs=True)
    graphed = graphed_engine.generate(prompts, params)
    assert any(isinstance(key, tuple) and key[0] == "span" for key in graphed_engine._runner.events.graphs)
    assert [r.token_ids for r in graphed] == [r.token_ids for r in eager]


@pytest.mark.gpu
def test_cuda_graphs_replay_the_processed_logprobs():
    """Sampling with every processor (the torch sampler inside the graphs): a captured step bakes the logprobs mode
    in (``graph_key``), so raw and processed runs of one engine draw the same tokens with their own logprobs, and
    the graphs' processed logprobs are the eager engine's."""
    model = _gpu_qwen3()
    prompts = [[random.Random(i).randrange(1, 512) for _ in range(10 + 5 * i)] for i in range(4)]
    given = dict(max_new_tokens=32, temperature=0.8, top_k=40, top_p=0.8, min_p=0.05, repetition_penalty=1.3,
                 seed=3, ignore_eos=True)
    comp = CompressionConfig("longflow", budget=24)
    graphed_engine = RolloutEngine(model, compression=comp, max_batch=4, cuda_graphs=True)
    runs = {mode: graphed_engine.generate(prompts, SamplingParams(logprobs_mode=mode, **given))
            for mode in ("raw", "processed")}
    assert graphed_engine._runner.graphs, "no CUDA graph was captured"
    eager = RolloutEngine(model, compression=comp, max_batch=4, cuda_graphs=False).generate(
        prompts, SamplingParams(logprobs_mode="processed", **given))
    assert [r.token_ids for r in runs["raw"]] == [r.token_ids for r in runs["processed"]] \
        == [r.token_ids for r in eager]
    got = torch.tensor([lp for r in runs["processed"] for lp in r.logprobs])
    assert torch.allclose(got, torch.tensor([lp for r in eager for lp in r.logprobs]), atol=1e-4)
    assert (got - torch.tensor([lp for r in runs["raw"] for lp in r.logprobs])).abs().max() > 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_cuda_defaults_full_greedy_equals_hf_generate(family):
    """The engine as a CUDA user gets it (graphs, every decode fusion and the fused sampler on by default), ``full``
    and fp32 (cuBLAS without TF32): greedy tokens equal HF ``generate``'s, token for token, at every prompt length."""
    from tests.kernels.conftest import model_of
    from tests.rollout.test_engine import hf_greedy

    model = model_of(family).to("cuda").eval()
    engine = RolloutEngine(model, max_batch=4)
    assert engine.cuda_graphs and engine.fused_sampling and engine.fused_mlp and engine.fused_qkv_rotary \
        and engine.fused_add_norm
    prompts = [[random.Random(i).randrange(1, model.config.vocab_size) for _ in range(3 + 5 * i)] for i in range(4)]
    got = engine.generate(prompts, SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True))
    reference = model_of(family).to("cuda").eval()  # the same weights, untouched by the engine's module swaps
    assert [r.token_ids for r in got] == [hf_greedy(reference, p, 24) for p in prompts]


def test_a_slot_freed_below_live_ones_is_read_by_slot():
    """The last prompts of a run: the sequence in slot 1 stops early with nothing left to refill it, while slots 2
    and 3 run on in the same batch (4 slots: no compaction moves them). Each live slot's tokens are its own column
    of the window (not the column of its rank among the live slots), so every completion is the prompt's alone."""
    model = tiny_model("qwen3")
    greedy = SamplingParams(max_new_tokens=24, temperature=0.0)
    for seed in range(20):  # a stop token that ends prompt 1 early and no other
        prompts = prompts_of(4, seed=100 + seed)
        alone = [RolloutEngine(model, max_batch=1).generate([p], greedy)[0].token_ids for p in prompts]
        stop = alone[1][3]
        if all(stop not in ids for i, ids in enumerate(alone) if i != 1) and stop not in alone[1][:3]:
            break
    else:
        pytest.fail("no prompt set with a stop token of prompt 1 alone")
    params = SamplingParams(max_new_tokens=24, temperature=0.0, stop_token_ids=(stop,))
    got = RolloutEngine(model, max_batch=4, sync_every=2).generate(prompts, params)
    assert [r.finish_reason for r in got] == ["length", "stop", "length", "length"]
    assert got[1].token_ids == alone[1][:4]
    assert [r.token_ids for r in got[2:]] == alone[2:] and got[0].token_ids == alone[0]
