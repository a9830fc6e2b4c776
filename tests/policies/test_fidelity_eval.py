"""The teacher-forced replay drives the engine exactly like generate; the fidelity metrics and CLI."""
import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import kvroll.bench.fidelity
from kvroll import CompressionConfig, RolloutEngine, SamplingParams
from kvroll.cli import main
from kvroll.bench.fidelity import fidelity_metrics, run_fidelity, to_markdown
from kvroll.rollout.replay import greedy_reference, kl_and_agreement


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(2)
    config = LlamaConfig(vocab_size=89, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
    gen = torch.Generator().manual_seed(3)
    return LlamaForCausalLM(config).eval(), [torch.randint(0, 89, (n,), generator=gen).tolist() for n in (30, 12)]


@pytest.mark.parametrize("policy, kwargs", [("rkv", {"buffer": 16}), ("hardkv", {"interval": 16, "window": 8}),
                                            ("lagkv", {"lag": 8}), ("h2o", {})])
def test_greedy_replay_equals_generate(tiny, policy, kwargs):
    model, prompts = tiny
    config = CompressionConfig(policy, budget=40, **kwargs)
    sampling = SamplingParams(max_new_tokens=120, temperature=0, ignore_eos=True)
    want = [c.token_ids for c in RolloutEngine(model, config, max_batch=2).generate(prompts, sampling)]
    tokens, logprobs = greedy_reference(RolloutEngine(model, config, max_batch=2), prompts, 120)
    assert tokens.tolist() == want
    # replaying its own greedy tokens under the same policy: KL 0, full agreement
    kl, agree = kl_and_agreement(RolloutEngine(model, config, max_batch=2), prompts, tokens, logprobs)
    assert float(kl.max()) < 1e-3 and bool(agree.all())
    # under full KV the same tokens are not exactly reproduced: the metric sees the compression
    full_kl, _ = kl_and_agreement(RolloutEngine(model, CompressionConfig("full"), max_batch=2), prompts, tokens,
                                  logprobs)
    assert float(full_kl.mean()) > 1e-4


def test_fidelity_metrics_by_hand():
    kl = torch.tensor([[0.0, 1.0, 2.0, 3.0], [0.5, 0.5, 0.5, 0.5]])
    agree = torch.tensor([[True, True, False, True], [True, True, True, True]])
    m = fidelity_metrics(kl, agree)
    assert m["kl_mean"] == pytest.approx(1.0)
    assert m["top1_agreement"] == pytest.approx(7 / 8)
    assert (m["greedy_prefix_mean"], m["greedy_prefix_min"]) == (3.0, 2)
    assert m["kl_p99"] == pytest.approx(float(torch.quantile(kl.flatten(), 0.99)))


def test_cli_eval_fidelity_writes_json_and_markdown(tmp_path, smollm2):
    code = main(["eval", "fidelity", "--policies", "full,streaming,rkv", "--budgets", "64", "--max-new-tokens", "6",
                 "--num-prompts", "1", "--out", str(tmp_path)])
    assert code == 0
    report = json.loads((tmp_path / "fidelity.json").read_text())
    rows = {r["policy"]: r for r in report["results"]}
    assert set(rows) == {"full", "streaming", "rkv"}
    assert rows["full"]["kl_mean"] < 1e-3 and rows["full"]["greedy_prefix_min"] == 6
    assert rows["rkv"]["kv_bytes_per_seq"] == 30 * 2 * 3 * (64 + 128) * 64 * 4  # layers x K,V x heads x cap x D x fp32
    text = (tmp_path / "fidelity.md").read_text()
    assert "## budget 64" in text and "kvroll eval fidelity --model smollm2" in text


def test_cli_rejects_bad_policy_and_budget(capsys):
    assert main(["eval", "fidelity", "--policies", "nope", "--budgets", "64"]) == 2
    assert "--policies 'nope' is not a known policy" in capsys.readouterr().err
    assert main(["eval", "fidelity", "--policies", "lagkv", "--budgets", "8"]) == 2
    assert "budget=8 is invalid" in capsys.readouterr().err


def _no_model_work(engine):
    def refuse(*args, **kwargs):
        raise AssertionError("model work started before the limits were checked")

    engine._prefill = engine._allocate = engine._forward_decode = refuse
    return engine


def test_replay_refuses_full_past_max_positions_before_any_work(tiny):
    """The reference (full, greedy) past max_position_embeddings: generate's error, not a silent replay."""
    model, _ = tiny
    engine = _no_model_work(RolloutEngine(model, CompressionConfig("full"), max_batch=2))
    with pytest.raises(ValueError, match=r"longest prompt \(1000 tokens\) \+ max_new_tokens=25 = 1025 exceeds the "
                                         r"model's max_position_embeddings=1024.*lower max_new_tokens to <= 24"):
        greedy_reference(engine, [[1] * 1000, [2] * 10], 25)


def test_replay_refuses_a_compressing_policy_past_a_sliding_window(tiny):
    from tests.rollout.test_limits import windowed

    engine = _no_model_work(RolloutEngine(windowed("mistral"), CompressionConfig("longflow", budget=16), max_batch=1))
    ref_tokens = torch.zeros(1, 6, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"sliding_window=8 .*= 9 exceeds it; policy 'longflow' does not apply"):
        kl_and_agreement(engine, [[1, 2, 3]], ref_tokens, torch.zeros(1, 6, 256))


class _Tokenizer:
    """What run_fidelity asks of a tokenizer: a chat prompt of 5-9 ids and a decode."""

    def apply_chat_template(self, messages, add_generation_prompt, return_dict):
        return [1 + len(messages[0]["content"]) % 80] * (5 + len(messages[0]["content"]) % 5)

    def decode(self, ids):
        return " ".join(map(str, ids))


@pytest.fixture
def tiny_fidelity(tiny, monkeypatch):
    """run_fidelity on the tiny model (1,024 positions) in place of a model loaded by name."""
    model, _ = tiny
    monkeypatch.setattr(kvroll.bench.fidelity, "_load", lambda name, device="cpu": (model, _Tokenizer()))
    monkeypatch.setattr(kvroll.bench.fidelity, "load_config", lambda name: model.config)
    return model


def test_full_is_measured_once_when_not_listed_first(tiny_fidelity):
    report = run_fidelity("tiny", ["longflow", "full"], [16, 24], max_new_tokens=4, num_prompts=2, log=lambda s: 0)
    assert [(r["policy"], r["budget"]) for r in report["results"]] == [("longflow", 16), ("full", None),
                                                                       ("longflow", 24)]
    tables = to_markdown(report).split("## budget ")[1:]
    assert len(tables) == 2 and all(t.count("\n| full |") == 1 for t in tables)


@pytest.mark.parametrize("kwargs,match", [
    (dict(budgets=[2000]), r"budget=2000 exceeds the model's max_position_embeddings=1024"),
    (dict(budgets=[64], policies=["rkv"], max_new_tokens=1100), r"max_new_tokens=1100 = 11\d\d exceeds the model's "
                                                                r"max_position_embeddings=1024; policy 'full'"),
    (dict(num_prompts=-1), r"--num-prompts=-1 is invalid"),
    (dict(budgets=[]), r"give at least one of each"),
])
def test_run_fidelity_checks_limits_before_the_reference(tiny_fidelity, monkeypatch, kwargs, match):
    def no_reference(*args, **kwargs):
        raise AssertionError("the reference was computed before the limits were checked")

    monkeypatch.setattr(kvroll.bench.fidelity, "greedy_reference", no_reference)
    args = {**dict(policies=["full", "longflow"], budgets=[64], max_new_tokens=8, num_prompts=2), **kwargs}
    with pytest.raises(ValueError, match=match):
        run_fidelity("tiny", log=lambda s: 0, **args)


def test_kv_bytes_are_one_sequences_with_several_prompts(tiny_fidelity):
    """``kv_bytes_per_seq`` is one sequence's K/V (the engine holds one slot per prompt): the tiny model's 2 layers x
    K,V x 2 KV heads x head_dim 8 x fp32 = 256 bytes per cached token, longflow holding its budget and full the
    longest prompt + the continuation."""
    report = run_fidelity("tiny", ["full", "longflow"], [16], max_new_tokens=4, num_prompts=3, log=lambda s: 0)
    rows = {r["policy"]: r for r in report["results"]}
    assert len(report["prompt_lengths"]) == 3
    assert rows["longflow"]["kv_bytes_per_seq"] == 256 * 16
    assert rows["full"]["kv_bytes_per_seq"] == 256 * (max(report["prompt_lengths"]) + 4)


def test_fidelity_tables_sort_policies_by_mean_kl_after_full():
    """Each budget's table: full first, then the budget's rows by mean KL, lowest first (the order they were
    measured in does not matter); a table per budget, in increasing order."""
    def row(policy, budget, kl):
        return {"policy": policy, "budget": budget, "params": {}, "kl_mean": kl, "kl_p99": kl, "top1_agreement": 1.0,
                "greedy_prefix_mean": 4.0, "greedy_prefix_min": 4, "kv_bytes_per_seq": 1}

    report = {"model": "tiny", "max_new_tokens": 4, "prompt_lengths": [5], "results": [
        row("random", 64, 2.0), row("full", None, 0.0), row("h2o", 64, 0.5), row("snapkv", 64, 0.1),
        row("random", 32, 3.0), row("h2o", 32, 0.7)]}
    tables = to_markdown(report).split("## budget ")[1:]
    assert [t.split("\n")[0] for t in tables] == ["32", "64"]
    order = [[line.split(" | ")[0][2:] for line in t.splitlines() if line.startswith("| ") and "KL mean" not in line]
             for t in tables]
    assert order == [["full", "h2o", "random"], ["full", "snapkv", "h2o", "random"]]


def test_full_alone_is_tabled(tiny_fidelity):
    """``--policies full``: its one row is in fidelity.md too (was: a header and no table)."""
    report = run_fidelity("tiny", ["full"], [16], max_new_tokens=4, num_prompts=2, log=lambda s: 0)
    assert [r["policy"] for r in report["results"]] == ["full"]
    text = to_markdown(report)
    assert text.count("\n| full | ") == 1 and "## full only" in text


def test_fidelity_metrics_end_at_each_references_eos():
    """A reference that ends at EOS is measured up to and including it: the steps after it (no rollout generates
    them) count neither in KL / top-1 nor in the greedy prefix."""
    from kvroll.bench.fidelity import reference_lengths

    ref = torch.tensor([[5, 7, 2, 9], [5, 6, 7, 8]])
    lengths = reference_lengths(ref, (2,))
    assert lengths.tolist() == [3, 4]
    kl = torch.tensor([[1.0, 1.0, 1.0, 100.0], [0.0, 0.0, 0.0, 0.0]])
    agree = torch.tensor([[True, True, True, False], [True, True, False, True]])
    m = fidelity_metrics(kl, agree, lengths)
    assert m["kl_mean"] == pytest.approx(3 / 7) and m["top1_agreement"] == pytest.approx(6 / 7)
    assert (m["greedy_prefix_mean"], m["greedy_prefix_min"]) == (2.5, 2)


def test_regenerate_command_names_the_prompts_file(tiny_fidelity, tmp_path):
    import argparse

    from kvroll.bench.fidelity import run_eval_fidelity

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"content": "abc"}\n{"content": "hello"}\n')
    args = argparse.Namespace(model="tiny", policies=["full"], budgets=[16], max_new_tokens=4, num_prompts=None,
                              prompts=str(prompts), threads=None, device="cpu", out=str(tmp_path / "o"))
    assert run_eval_fidelity(args) == 0
    text = (tmp_path / "o" / "fidelity.md").read_text()
    assert f"--prompts {prompts}" in text and "--ignore-eos" not in text and "each scored to its EOS" in text
    args.ignore_eos, args.out = True, str(tmp_path / "past_eos")
    assert run_eval_fidelity(args) == 0
    text = (tmp_path / "past_eos" / "fidelity.md").read_text()
    assert "--ignore-eos" in text and "4 tokens each, scored past EOS (--ignore-eos)" in text
    report = json.loads((tmp_path / "past_eos" / "fidelity.json").read_text())
    assert report["ignore_eos"] and report["reference_lengths"] == [4, 4]
