"""Smoke tests of ``examples/``: each script runs on CPU with the embedded model and small arguments, and its
output is checked (completion counts and lengths, the custom policy's cache contents, the bench report files, the
GRPO steps' rewards and KV accounting), not only its exit status."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def run(*args: str, timeout: int = 600) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"{args} exited {done.returncode}:\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.mark.parametrize("policy, extra", [("streaming", []), ("rkv", ["--policy-arg", "buffer=8"])])
def test_engine_generate_prints_n_completions_of_the_asked_length(policy, extra):
    out = run(str(EXAMPLES / "engine_generate.py"), "--policy", policy, "--budget", "24", *extra, "--n", "3",
              "--max-new-tokens", "16", "--ignore-eos")
    rows = re.findall(r"^\[0\.(\d)\] length, (\d+) tokens: (.+)$", out, re.M)
    assert [int(s) for s, _, _ in rows] == [0, 1, 2] and all(int(n) == 16 for _, n, _ in rows)
    assert all(text.strip() for _, _, text in rows)
    summary = re.search(rf"^{policy} budget 24: 3 completions, 48 tokens in .* KV cache ([\d.]+) MiB \((\d+) slots "
                        r"per head\), full attention would hold ([\d.]+) MiB$", out, re.M)
    assert summary, out
    kv, slots, full = float(summary[1]), int(summary[2]), float(summary[3])
    assert slots == (24 + 8 if policy == "rkv" else 24) and 0 < kv < full


def test_custom_policy_is_registered_used_and_holds_first_and_recent():
    out = run(str(EXAMPLES / "custom_policy.py"), "--first", "4", "--budget", "16", "--n", "2",
              "--max-new-tokens", "24")
    assert len(re.findall(r"^\[\d\] 24 tokens: \S", out, re.M)) == 2
    end = int(re.search(r"\(16 of (\d+) tokens\)", out)[1])
    held = json.loads(re.search(r"^cache positions layer 0 slot 0 head 0: (\[.*\])$", out, re.M)[1])
    assert held == [0, 1, 2, 3] + list(range(end - 12, end))  # first 4 + the 12 newest of 0 .. end - 1
    assert end > 40  # the prompt and the 23 cached completion tokens: far more than the 16 kept


def test_bench_config_for_ones_own_model_writes_the_report(tmp_path):
    out = tmp_path / "bench"
    run("-m", "kvroll.cli", "bench", "--config", str(EXAMPLES / "bench_my_model.yaml"), "--out", str(out),
        "--no-progress", "--policies", "full,snapkv", "--output_lengths", "32", "--steady_steps", "32")
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "complete" and report["errors"] == []
    assert [(r["policy"], r["budget"]) for r in report["measurements"]] == [("full", None), ("hf_generate", None),
                                                                          ("snapkv", 48)]
    snapkv = report["measurements"][-1]
    assert snapkv["capacity"] == 48 + 8 and snapkv["events"] >= 1 and snapkv["tok_s"] > 0
    text = (out / "report.md").read_text()
    assert "## Generated tokens/s" in text and "| snapkv 48 |" in text
    for png in report["plots"].values():
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"]({png})" in text


def test_grpo_trl_switch_trains_on_a_local_model_directory(tmp_path):
    from kvroll.rollout.model import smollm2_checkpoint

    model_dir = smollm2_checkpoint()  # the embedded model converted to a local HF directory
    assert (model_dir / "config.json").is_file()
    out = run(str(EXAMPLES / "grpo_trl_switch.py"), "--model", str(model_dir), "--steps", "2",
              "--max-completion-length", "8", "--out", str(tmp_path / "run"))
    steps = re.findall(r"^step (\d+): reward ([\d.]+), completion length ([\d.]+)  KV ([\d.]+) MiB of ([\d.]+) "
                       r"\(full\), (\d+) evicted$", out, re.M)
    assert [int(s[0]) for s in steps] == [1, 2], out
    for _, reward, length, kv, full, _ in steps:
        assert 0 <= float(reward) <= 1 and 0 < float(length) <= 8 and 0 < float(kv) <= float(full)
