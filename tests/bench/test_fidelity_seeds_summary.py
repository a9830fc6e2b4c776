"""Tests for mutants of kvroll/bench/fidelity_seeds.py that survived tests/bench/test_fidelity_seeds.py: a final window
longer than the compared steps, the 97% goal at its boundary, the final correct rate, a run without 'complete'."""
import json

import pytest

from kvroll.bench.fidelity_seeds import markdown, summarize_runs


def _run(out, policy, seed, rewards, steps, correct=None, complete=None):
    run = {"trainer": "grpo", "policy": policy, "correction": "none", "seed": seed,
           "budget": None if policy == "full" else 46, "steps": steps, "rewards": rewards}
    if correct is not None:
        run["correct"] = correct
    if complete is not None:
        run["complete"] = complete
    (out / f"{policy}-s{seed}.json").write_text(json.dumps(run))


def test_a_final_window_longer_than_the_compared_steps_is_all_of_them(tmp_path):
    _run(tmp_path, "full", 0, [1.0, 2.0, 3.0, 6.0], 4)
    _run(tmp_path, "rkv", 0, [1.0, 1.0, 1.0, 1.0, 5.0], 5)
    grpo = summarize_runs(tmp_path, final_window=10, plots=False)["grpo"]
    assert (grpo["steps_compared"], grpo["final_window"]) == (4, 4)
    assert grpo["arms"]["full"]["final_rewards"] == [3.0] and grpo["arms"]["rkv"]["final_rewards"] == [1.0]
    assert "mean over steps 1-4, the last 4 of the 4 steps" in (tmp_path / "summary_grpo.md").read_text()


def test_the_goal_is_met_at_exactly_97_percent():
    row = {"budget": 46, "policy_kwargs": {}, "seeds": [0], "steps_done": [4], "first_mean": 0.5,
           "final_mean": 0.97, "final_std": 0.0, "vs_full": 0.97, "vs_full_paired_mean": 0.97,
           "vs_full_paired_std": 0.0, "correct_final": None, "format_final": None, "completion_length": None}
    from kvroll.bench.fidelity_seeds import SERIES

    row.update({key: None for key in SERIES})
    summary = {"steps_compared": 4, "final_window": 2, "unfinished": [], "arms": {"rkv": row}}
    assert "| 0.970 (met) |" in markdown("grpo", summary)
    row["vs_full"] = 0.9699
    assert "| 0.970 (missed) |" in markdown("grpo", summary)


def test_the_final_correct_rate_is_over_the_final_window(tmp_path):
    _run(tmp_path, "full", 0, [1.0] * 4, 4, correct=[0.0, 0.0, 0.5, 1.0])
    arm = summarize_runs(tmp_path, final_window=2, plots=False)["grpo"]["arms"]["full"]
    assert arm["correct_final"] == pytest.approx(0.75)


def test_a_run_without_complete_is_finished_when_it_has_its_steps(tmp_path):
    _run(tmp_path, "full", 0, [1.0] * 4, 4)  # no 'complete' key: judged by its length
    _run(tmp_path, "full", 1, [1.0] * 3, 4)
    assert summarize_runs(tmp_path, final_window=2, plots=False)["grpo"]["unfinished"] == ["full s1 (3/4)"]
