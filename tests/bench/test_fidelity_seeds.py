"""The seed aggregation of learning-fidelity runs (``kvroll/bench/fidelity_seeds.py``) on hand-made runs: the common
steps, final rewards with their spread, the ratios to ``full``, the unfinished runs, the table and the plot."""
from __future__ import annotations

import json
import math

import pytest

from kvroll.bench.fidelity_seeds import load_runs, smooth, summarize_runs

DLOGP = "sampling/sampling_logp_difference/mean"


def write_run(out, trainer, policy, correction, seed, rewards, steps=6, dlogp=0.1, rejected=None):
    arm = policy if correction == "none" else f"{policy}+{correction}"
    run = {"trainer": trainer, "arm": arm, "policy": policy, "correction": correction, "seed": seed,
           "budget": None if policy == "full" else 46, "policy_kwargs": {}, "steps": steps,
           "complete": len(rewards) == steps, "rewards": rewards, "correct": [0.5] * len(rewards),
           "format": [1.0] * len(rewards), "completion_lengths": [100.0] * len(rewards),
           "series": {DLOGP: [dlogp] * len(rewards), "kvroll/rejected_fraction": [rejected] * len(rewards)}}
    (out / f"{trainer}-{policy}-{correction}-s{seed}.json").write_text(json.dumps(run))


@pytest.fixture
def runs(tmp_path):
    # full: rewards 1..6 (+ seed); rkv: seed 1 cut after 4 steps (a timeout), so steps 1-4 are compared.
    for seed in range(3):
        write_run(tmp_path, "grpo", "full", "none", seed, [s + seed for s in (1.0, 2, 3, 4, 5, 6)], dlogp=0.02)
    write_run(tmp_path, "grpo", "rkv", "none", 0, [0.5, 1, 2, 3, 9, 9])
    write_run(tmp_path, "grpo", "rkv", "none", 1, [1.0, 2, 3, 5])
    write_run(tmp_path, "grpo", "rkv", "sparse_rl", 0, [1.0, 2, 3, 4, 5, 6], rejected=0.25)
    write_run(tmp_path, "ppo", "full", "none", 0, [1.0, 1, 1])
    (tmp_path / "grpo-longflow-none-s0.json").write_text('{"rewards": [1, ')  # killed mid-write: skipped
    return tmp_path


def test_summary_by_hand(runs):
    summaries = summarize_runs(runs, final_window=2)
    grpo = summaries["grpo"]
    assert grpo["steps_compared"] == 4 and grpo["final_window"] == 2
    assert grpo["unfinished"] == ["rkv s1 (4/6)"]
    full, rkv, sparse = (grpo["arms"][arm] for arm in ("full", "rkv", "rkv+sparse_rl"))
    # Final = mean of steps 3-4: full seeds 3.5, 4.5, 5.5; rkv seeds 2.5 (its 9s come later), 4.0.
    assert full["final_rewards"] == [3.5, 4.5, 5.5] and full["final_mean"] == pytest.approx(4.5)
    assert full["final_std"] == pytest.approx(1.0)
    assert rkv["final_rewards"] == [2.5, 4.0] and rkv["final_std"] == pytest.approx(math.sqrt(1.125))
    assert rkv["vs_full"] == pytest.approx(3.25 / 4.0)  # against full's seeds 0 and 1
    # Paired: seed 0 2.5/3.5, seed 1 4.0/4.5.
    paired = [2.5 / 3.5, 4.0 / 4.5]
    assert rkv["vs_full_paired_mean"] == pytest.approx(sum(paired) / 2)
    assert rkv["vs_full_paired_std"] == pytest.approx(abs(paired[0] - paired[1]) / math.sqrt(2))
    assert sparse["final_std"] == 0.0 and sparse["vs_full"] == sparse["vs_full_paired_mean"] == 1.0
    assert rkv["first_mean"] == pytest.approx((0.75 + 1.5) / 2)  # first 2 steps of each seed
    assert sparse["kvroll/rejected_fraction"] == pytest.approx(0.25) and rkv["kvroll/rejected_fraction"] is None
    assert full[DLOGP] == pytest.approx(0.02) and full["steps_done"] == [6, 6, 6]
    assert summaries["ppo"]["arms"]["full"]["final_mean"] == 1.0  # trainers are summarised apart

    table = (runs / "summary_grpo.md").read_text()
    assert "mean over steps 3-4, the last 2 of the 4 steps every grpo run finished" in table
    assert "rkv s1 (4/6)" in table and "| rkv | 46 | 0,1 | 6,4 | 1.125 -> 3.250 ± 1.061 | 0.812 (missed) |" in table
    assert "| rkv+sparse_rl | 46 | 0 | 6 | 1.500 -> 3.500 ± 0.000 | 1.000 (met) |" in table and "0.250 |" in table
    assert json.loads((runs / "summary_grpo.json").read_text())["arms"]["rkv"]["steps_done"] == [6, 4]


def test_plot_draws_the_seed_mean_and_spread(runs):
    summarize_runs(runs, final_window=2)
    from PIL import Image

    drawn = json.loads(Image.open(runs / "reward_curves_grpo.png").text["kvroll:data"])
    assert set(drawn) == {"full", "rkv", "rkv+sparse_rl"}
    seeds = [smooth([0.5, 1, 2, 3]), smooth([1.0, 2, 3, 5])]  # the compared steps only
    assert drawn["rkv"]["mean"] == pytest.approx([(a + b) / 2 for a, b in zip(*seeds)])
    assert drawn["rkv"]["std"] == pytest.approx([abs(a - b) / math.sqrt(2) for a, b in zip(*seeds)])
    assert drawn["full"]["dlogp"] == pytest.approx([0.02] * 4)


def test_runs_from_before_the_seed_study(tmp_path):
    history = [{"reward": 1.0, DLOGP: 0.3}, {"loss": 0.1}, {"reward": 2.0, DLOGP: 0.5}]
    (tmp_path / "rkv.json").write_text(json.dumps({"policy": "rkv", "budget": 46, "rewards": [1.0, 2.0],
                                                   "config": {"seed": 3}, "log_history": history}))
    (run,) = load_runs(tmp_path)
    assert (run["trainer"], run["arm"], run["seed"]) == ("grpo", "rkv", 3)
    assert run["series"][DLOGP] == [0.3, 0.5]


def test_vs_full_compares_the_seeds_full_has(tmp_path):
    """An arm's ratio to full is over the seeds both ran: a seed full lacks does not count."""
    for seed in (0, 1):
        write_run(tmp_path, "grpo", "full", "none", seed, [2.0 + seed] * 4, steps=4)
    write_run(tmp_path, "grpo", "rkv", "none", 0, [1.0] * 4, steps=4)
    write_run(tmp_path, "grpo", "rkv", "none", 7, [5.0] * 4, steps=4)  # no full run of seed 7
    rkv = summarize_runs(tmp_path, final_window=2, plots=False)["grpo"]["arms"]["rkv"]
    assert rkv["final_mean"] == pytest.approx(3.0)  # both seeds
    assert rkv["vs_full"] == pytest.approx(1.0 / 2.0) and rkv["vs_full_paired_mean"] == pytest.approx(0.5)
