"""The teacher-forced replay drives the engine exactly like generate; the fidelity metrics and CLI."""
import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvroll import CompressionConfig, RolloutEngine, SamplingParams
from kvroll.cli import main
from kvroll.fidelity import fidelity_metrics
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
    assert "unknown policy 'nope'" in capsys.readouterr().err
    assert main(["eval", "fidelity", "--policies", "lagkv", "--budgets", "8"]) == 2
    assert "budget=8 is invalid" in capsys.readouterr().err
