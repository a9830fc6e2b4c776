"""Group cutting and sharing across ranks (pure functions of the adapter)."""
from __future__ import annotations

import pytest

from kvroll.trainers.adapter import _group_chunks, _mix_seed, _share


def test_groups_of_identical_consecutive_prompts():
    rows = [[1]] * 4 + [[2]] * 4 + [[1]] * 4
    assert _group_chunks(rows, 4) == [(0, 4), (4, 4), (8, 4)]


def test_adjacent_duplicate_groups_are_split_at_the_group_size():
    rows = [[5, 6]] * 8 + [[7]] * 4  # the same prompt drawn twice in a row
    assert _group_chunks(rows, 4) == [(0, 4), (4, 4), (8, 4)]


def test_ragged_runs_fall_back_to_smaller_chunks():
    rows = [[1]] * 3 + [[2]] * 5
    assert _group_chunks(rows, 4) == [(0, 3), (3, 4), (7, 1)]


def test_sharing_whole_groups_across_ranks():
    chunks = [(0, 4), (4, 4), (8, 4)]  # 12 rows over 2 ranks of 6: the middle group straddles them
    shares = _share(chunks, 2)
    assert sorted(i for share in shares for i in share) == [0, 1, 2]
    assert shares == [[0, 1], [2]]
    assert _share(chunks, 1) == [[0, 1, 2]]
    assert _share(chunks, 4) == [[0], [1], [2], []]  # fewer groups than ranks: some ranks idle


def test_seeds_differ_per_call_and_rank():
    seeds = {_mix_seed(0, call, rank, 4) for call in range(3) for rank in range(2)}
    assert len(seeds) == 6 and _mix_seed(1, 0, 0, 4) == _mix_seed(1, 0, 0, 4)


def test_sampling_params_follow_the_config_with_processed_logprobs(tmp_path):
    """Every sampling field reaches the engine, TRL's EOS ids stop it besides the configured ones, and the logprobs
    are the sampled distribution's (what TRL asks vLLM for): with only temperature 1 and no top-k/top-p/min-p, the
    2-step runs cannot tell a dropped field or raw logprobs from the right ones."""
    from types import SimpleNamespace

    from kvroll.trainers import RLOOConfig
    from kvroll.trainers.adapter import KVRollGeneration

    args = RLOOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False,
                      per_device_train_batch_size=4, num_generations=4, gradient_accumulation_steps=3,
                      max_completion_length=12, temperature=0.7, top_p=0.9, top_k=5, min_p=0.05,
                      repetition_penalty=1.1, generation_kwargs={"stop_token_ids": [7]}, seed=3, use_kvroll=True,
                      kvroll_policy="longflow", kvroll_budget=16)
    generation = SimpleNamespace(args=args, trainer=SimpleNamespace(eos_token_ids=[2]), calls=1, rank=0)
    s = KVRollGeneration._sampling(generation, seed_offset=4)
    assert (s.max_new_tokens, s.temperature, s.top_p, s.top_k, s.min_p, s.repetition_penalty) == (
        12, 0.7, 0.9, 5, 0.05, 1.1)
    assert set(s.stop_token_ids) == {2, 7} and not s.ignore_eos and s.logprobs_mode == "processed"
    assert s.seed == _mix_seed(3, 1, 0, 4)
    # the engine's default slots: the rows of one generation call (steps_per_generation = gradient accumulation)
    assert KVRollGeneration._rows_per_call(generation) == 4 * 3


def test_each_generation_call_samples_with_a_new_seed(tmp_path):
    """TRL calls generate() once per generation and again in GRPO's tool loop (num_generations=1): each call's
    SamplingParams draw from a seed of their own, or every step (and every tool turn) would repeat its draws."""
    from collections import defaultdict
    from types import SimpleNamespace

    import torch

    from kvroll.config import CompressionConfig
    from kvroll.trainers import GRPOConfig
    from kvroll.trainers.adapter import KVRollGeneration

    args = GRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False,
                      per_device_train_batch_size=2, num_generations=2, max_completion_length=4, use_kvroll=True,
                      kvroll_policy="full", seed=3)
    model = torch.nn.Module()
    model.config = SimpleNamespace(num_hidden_layers=1, hidden_size=8, num_attention_heads=2, num_key_value_heads=1)
    trainer = SimpleNamespace(args=args, model=model, eos_token_ids=[2],
                              accelerator=SimpleNamespace(process_index=0, num_processes=1, device=torch.device("cpu"),
                                                          unwrap_model=lambda m: m),
                              _metrics={"train": defaultdict(list)})
    generation = KVRollGeneration(trainer, CompressionConfig("full"))
    seeds = []

    def generate(prompts, sampling, n):
        seeds.append(sampling.seed)
        return [SimpleNamespace(token_ids=[5, 2], logprobs=[-1.0, -0.5]) for _ in prompts for _ in range(n)]

    generation.engine = SimpleNamespace(generate=generate, kv_cache_bytes=lambda: 0)
    generation.weights = SimpleNamespace(dtype=torch.float32)
    for _ in range(2):
        generation.generate([[7, 8]] * 2, num_generations=2)
    generation.generate([[7, 8, 5, 2, 9]], num_generations=1)  # a tool turn
    assert len(seeds) == 3 and len(set(seeds)) == 3


def test_ignore_eos_keeps_trls_eos_ids_out_of_the_stop_ids(tmp_path):
    """generation_kwargs ignore_eos: the rollout runs past EOS (only the given stop ids stop it), so the adapter must
    not put TRL's EOS ids back among the stop ids."""
    from types import SimpleNamespace

    from kvroll.trainers import RLOOConfig
    from kvroll.trainers.adapter import KVRollGeneration

    args = RLOOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False,
                      per_device_train_batch_size=4, num_generations=4, max_completion_length=12, use_kvroll=True,
                      kvroll_policy="longflow", kvroll_budget=16,
                      generation_kwargs={"ignore_eos": True, "stop_token_ids": [7]})
    generation = SimpleNamespace(args=args, trainer=SimpleNamespace(eos_token_ids=[2]), calls=0, rank=0)
    s = KVRollGeneration._sampling(generation, seed_offset=4)
    assert s.ignore_eos and set(s.stop_token_ids) == {7}



def test_generate_returns_each_row_its_own_prompts_samples_and_logs_their_lengths(tmp_path):
    """One rank, a fake engine whose completion names its prompt and sample: rows come back in order, a group's rows
    are distinct samples, a prompt drawn twice in a row is two groups, and the KV accounting reads each row's own
    prompt length (prompts of 2, 5 and 3 tokens; a completion of 2 tokens writes p + 1 tokens)."""
    from types import SimpleNamespace

    from kvroll.trainers import RLOOConfig

    args = RLOOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False,
                      per_device_train_batch_size=8, num_generations=2, max_completion_length=4, use_kvroll=True,
                      kvroll_policy="full")

    def generate(prompts, sampling, n):
        return [SimpleNamespace(token_ids=[len(p), s], logprobs=[-1.0, -0.5]) for p in prompts for s in range(n)]

    generation, trainer = _fake_generation(args, generate)
    rows = [[7, 8]] * 2 + [[1, 2, 3, 4, 5]] * 2 + [[9, 9, 9]] * 2 + [[9, 9, 9]] * 2
    prompt_ids, completions, logprobs, extra = generation.generate(rows, num_generations=2)
    assert prompt_ids == rows and extra is None
    assert completions == [[2, 0], [2, 1], [5, 0], [5, 1], [3, 0], [3, 1], [3, 0], [3, 1]]
    assert logprobs == [[[-1.0], [-0.5]]] * 8 and generation.last_logprobs == logprobs
    per_token = 1 * 2 * 1 * 4 * 4  # layers x K,V x KV heads x head_dim x fp32 bytes
    written = 2 * (2 + 1) + 2 * (5 + 1) + 4 * (3 + 1)
    assert trainer._metrics["train"]["kvroll/kv_bytes_full_equivalent"] == [per_token * written]


def test_a_tool_turn_under_full_stops_at_the_models_last_position(tmp_path):
    """TRL's tool loop re-sends prompt + completion + tool result (kept under max_position_embeddings) with
    num_generations=1 and keeps at most max_completion_length tokens over all turns. Under 'full' the engine
    refuses prompt + max_new_tokens past the positions, so the adapter caps such a row at the last position (as vLLM
    stops at max_model_len): a 58-token conversation under 64 positions gets 6 new tokens, a 4-token prompt all 16."""
    from types import SimpleNamespace

    from kvroll.trainers import GRPOConfig

    args = GRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False,
                      per_device_train_batch_size=2, num_generations=2, max_completion_length=16, use_kvroll=True,
                      kvroll_policy="full")

    def generate(prompts, sampling, n):  # the real engine's check (kvroll.rollout.model.check_generation_length)
        assert max(len(p) for p in prompts) + sampling.max_new_tokens <= 64, "past max_position_embeddings"
        return [SimpleNamespace(token_ids=[5] * sampling.max_new_tokens, logprobs=[-1.0] * sampling.max_new_tokens)
                for p in prompts for _ in range(n)]

    generation, _ = _fake_generation(args, generate, max_position_embeddings=64)
    with pytest.warns(UserWarning, match=r"under 'full' rows of 58 tokens get at most 6 new tokens \(not "
                                         r"max_completion_length=16\): the model's max_position_embeddings=64"):
        _, completions, logprobs, _ = generation.generate([[7] * 58, [1] * 4], num_generations=1)
    assert [len(c) for c in completions] == [6, 16] and [len(lp) for lp in logprobs] == [6, 16]


def _fake_generation(args, generate, **config):
    """A KVRollGeneration over a stand-in trainer (one rank, CPU) and engine: ``generate(prompts, sampling, n)``
    answers for the engine; ``config`` adds fields to the model's config. Returns (generation, trainer)."""
    from collections import defaultdict
    from types import SimpleNamespace

    import torch

    from kvroll.config import CompressionConfig
    from kvroll.trainers.adapter import KVRollGeneration

    model = torch.nn.Module()  # the adapter walks its module tree (check_mergeable)
    model.config = SimpleNamespace(num_hidden_layers=1, hidden_size=8, num_attention_heads=2, num_key_value_heads=1,
                                   **config)
    trainer = SimpleNamespace(args=args, model=model, eos_token_ids=[2],
                              accelerator=SimpleNamespace(process_index=0, num_processes=1, device=torch.device("cpu"),
                                                          unwrap_model=lambda m: m),
                              _metrics={"train": defaultdict(list)})
    generation = KVRollGeneration(trainer, CompressionConfig("full"))
    generation.engine = SimpleNamespace(generate=generate, kv_cache_bytes=lambda: 0)
    generation.weights = SimpleNamespace(dtype=torch.float32)
    return generation, trainer
