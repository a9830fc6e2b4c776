"""Learning fidelity over seeds: the runs of ``benchmarks/grpo_learning_fidelity.py`` grouped by trainer and arm
(policy + correction), compared on the steps every run of that trainer finished.

    summary = summarize_runs(Path("runs/fid"), final_window=10)
    # per trainer T: summary_T.md (the table), summary_T.json, reward_curves_T.png (mean and spread over seeds)

A run is one JSON file: ``trainer``, ``arm``, ``policy``, ``correction``, ``seed``, ``budget``, ``steps`` (asked),
``rewards`` (one per rollout step) and ``series`` (per-step mismatch metrics, same length). A run cut short (a
timeout) shortens the comparison for every run of its trainer, so all arms are judged on the same steps; the
summary names the runs that did not finish. Final reward = the mean over the last ``final_window`` compared steps;
per arm the mean and sample standard deviation over seeds, the ratio of the arm's mean to ``full``'s mean over the
same seeds, and the mean and spread of the per-seed ratios (seed s of an arm against seed s of ``full``: same data,
sampling seeds and initial weights).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from kvroll.bench.report import write_json

GOAL = 0.97  # compressed rollouts reach >= 97% of full's final reward
SERIES = {  # per-step metric -> column of the table
    "sampling/sampling_logp_difference/mean": "mean abs dlogp",
    "sampling/importance_sampling_ratio/mean": "IS ratio mean",
    "kvroll/is_masked_fraction": "IS masked",
    "kvroll/rejected_fraction": "rejected",
}


def load_runs(out: Path) -> list[dict]:
    """Every run JSON in ``out`` (summaries and files without rewards skipped); files from before the seed study
    (``<policy>.json``) count as GRPO runs without correction."""
    runs = []
    for path in sorted(Path(out).glob("*.json")):
        try:
            run = json.loads(path.read_text())
        except json.JSONDecodeError:  # a file being written when a timeout struck
            continue
        if not isinstance(run, dict) or not run.get("rewards") or path.name.startswith("summary"):
            continue
        run.setdefault("trainer", "grpo")
        run.setdefault("correction", "none")
        run.setdefault("seed", run.get("config", {}).get("seed", 0))
        run.setdefault("arm", arm_name(run["policy"], run["correction"]))
        run.setdefault("series", series_from_history(run.get("log_history", [])))
        runs.append(run)
    return runs


def series_from_history(log_history: list[dict]) -> dict[str, list]:
    """The per-step ``SERIES`` metrics of a trainer's log history (one entry per logged rollout, None if absent)."""
    steps = [h for h in log_history if "reward" in h]
    return {key: [h.get(key) for h in steps] for key in SERIES}


def arm_name(policy: str, correction: str) -> str:
    return policy if correction == "none" else f"{policy}+{correction}"


def mean(values) -> float | None:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return sum(values) / len(values) if values else None


def std(values) -> float | None:
    """Sample standard deviation (n - 1); 0 for one value."""
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return None
    m = sum(values) / len(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0


def smooth(values: list[float], width: int = 5) -> list[float]:
    """Trailing moving average over up to ``width`` steps."""
    return [sum(values[max(0, i - width + 1): i + 1]) / len(values[max(0, i - width + 1): i + 1])
            for i in range(len(values))]


def arm_summary(runs: list[dict], common: int, window: int) -> dict:
    """One arm's seeds on the first ``common`` steps (see module doc)."""
    finals = [mean(r["rewards"][common - window: common]) for r in runs]
    firsts = [mean(r["rewards"][:window]) for r in runs]

    def compared(run, key):
        return run.get(key, [])[:common] if key in run else run["series"].get(key, [])[:common]

    row = {"seeds": [r["seed"] for r in runs], "budget": runs[0].get("budget"),
           "policy_kwargs": runs[0].get("policy_kwargs", {}), "steps_asked": [r.get("steps") for r in runs],
           "steps_done": [len(r["rewards"]) for r in runs], "final_rewards": finals, "final_mean": mean(finals),
           "final_std": std(finals), "first_mean": mean(firsts),
           "correct_final": mean(mean(compared(r, "correct")[common - window:]) for r in runs),
           "format_final": mean(mean(compared(r, "format")[common - window:]) for r in runs),
           "completion_length": mean(mean(compared(r, "completion_lengths")) for r in runs),
           "seconds": [r.get("seconds") for r in runs]}
    for key in SERIES:
        row[key] = mean(mean(compared(r, key)) for r in runs)
    return row


def trainer_summary(arms: dict[str, list[dict]], final_window: int) -> dict:
    """Every arm of one trainer, compared on the steps all its runs finished."""
    common = min(len(r["rewards"]) for runs in arms.values() for r in runs)
    window = max(1, min(final_window, common))
    rows = {arm: arm_summary(runs, common, window) for arm, runs in arms.items()}
    full = rows.get("full")
    by_seed = dict(zip(full["seeds"], full["final_rewards"])) if full else {}
    for row in rows.values():
        shared = [(f, by_seed[s]) for s, f in zip(row["seeds"], row["final_rewards"]) if s in by_seed]
        full_mean = mean(b for _, b in shared)
        row["vs_full"] = mean(f for f, _ in shared) / full_mean if full_mean else None
        paired = [f / b for f, b in shared if b and f is not None]
        row["vs_full_paired_mean"], row["vs_full_paired_std"] = mean(paired), std(paired)
    unfinished = [f"{arm} s{r['seed']} ({len(r['rewards'])}/{r.get('steps')})" for arm, runs in arms.items()
                  for r in runs if not r.get("complete", len(r["rewards"]) >= (r.get("steps") or 0))]
    return {"steps_compared": common, "final_window": window, "unfinished": unfinished, "goal": GOAL,
            "arms": rows}


def _fmt(value, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def markdown(trainer: str, summary: dict) -> str:
    """The table of one trainer's summary, with the window and unfinished runs said in words."""
    common, window = summary["steps_compared"], summary["final_window"]
    lines = [f"{trainer.upper()}: final reward = mean over steps {common - window + 1}-{common}, the last {window} "
             f"of the {common} steps every {trainer} run finished; mean ± std over seeds.",
             "Unfinished runs (cut by the time limit): " + (", ".join(summary["unfinished"]) or "none") + ".", "",
             "| arm | budget | seeds | steps done | first -> final reward (mean ± std) | vs full | per-seed vs full "
             "(mean ± std) | correct / format (final) | completion len | " + " | ".join(SERIES.values()) + " |",
             "|" + "---|" * (9 + len(SERIES))]
    for arm, r in summary["arms"].items():
        budget = r["budget"] if r["budget"] is not None else "-"
        if r["policy_kwargs"]:
            budget = f"{budget} {json.dumps(r['policy_kwargs'])}"
        goal = "" if arm == "full" or r["vs_full"] is None else (" (met)" if r["vs_full"] >= GOAL else " (missed)")
        lines.append(
            f"| {arm} | {budget} | {','.join(map(str, r['seeds']))} | {','.join(map(str, r['steps_done']))} | "
            f"{_fmt(r['first_mean'])} -> {_fmt(r['final_mean'])} ± {_fmt(r['final_std'])} | "
            f"{_fmt(r['vs_full'])}{goal} | {_fmt(r['vs_full_paired_mean'])} ± {_fmt(r['vs_full_paired_std'])} | "
            f"{_fmt(r['correct_final'])} / {_fmt(r['format_final'])} | {_fmt(r['completion_length'], 0)} | "
            + " | ".join(_fmt(r[key]) for key in SERIES) + " |")
    return "\n".join(lines) + "\n"


def plot(trainer: str, arms: dict[str, list[dict]], summary: dict, path: Path) -> dict:
    """Reward (5-step average) per arm, mean over seeds with a ±1 std band, and the mismatch |dlogp|, over the
    compared steps. Returns the numbers drawn (also stored in the PNG's ``kvroll:data`` text chunk)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    common = summary["steps_compared"]
    steps = list(range(1, common + 1))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True, height_ratios=(3, 1.4))
    data = {}
    for arm, runs in arms.items():
        curves = [smooth(r["rewards"][:common]) for r in runs]
        centre = [mean(column) for column in zip(*curves)]
        spread = [std(column) for column in zip(*curves)]
        row = summary["arms"][arm]
        label = f"{arm} (n={len(runs)}" + ("" if row["budget"] is None else f", budget {row['budget']}") + ")"
        line, = top.plot(steps, centre, label=label)
        top.fill_between(steps, [c - s for c, s in zip(centre, spread)], [c + s for c, s in zip(centre, spread)],
                         color=line.get_color(), alpha=0.18)
        dlogp = [mean(column) for column in zip(*[r["series"].get("sampling/sampling_logp_difference/mean", [])
                                                  [:common] for r in runs])]
        if dlogp:
            bottom.plot(steps[:len(dlogp)], dlogp, color=line.get_color())
        data[arm] = {"mean": centre, "std": spread, "dlogp": dlogp}
    top.set_ylabel("reward, 5-step average\n(mean ± std over seeds)")
    top.set_title(f"{trainer.upper()} on SmolLM2-135M arithmetic: full vs compressed-KV rollouts, steps 1-{common}")
    top.legend(fontsize=8)
    bottom.set_ylabel("mean |dlogp|")
    bottom.set_xlabel(f"{trainer.upper()} step (rollout)")
    fig.tight_layout()
    fig.savefig(path, dpi=120, metadata={"kvroll:data": json.dumps(data)})
    plt.close(fig)
    return data


def summarize_runs(out: Path, final_window: int = 10, plots: bool = True) -> dict:
    """Write ``summary_<trainer>.md`` / ``.json`` and ``reward_curves_<trainer>.png`` for every trainer with runs
    in ``out``; returns {trainer: summary}."""
    out = Path(out)
    grouped: dict[str, dict[str, list[dict]]] = {}
    for run in load_runs(out):
        grouped.setdefault(run["trainer"], {}).setdefault(run["arm"], []).append(run)
    result = {}
    for trainer, arms in sorted(grouped.items()):
        arms = {arm: sorted(runs, key=lambda r: r["seed"]) for arm, runs in _ordered(arms)}
        summary = trainer_summary(arms, final_window)
        write_json(out / f"summary_{trainer}.json", summary)
        (out / f"summary_{trainer}.md").write_text(markdown(trainer, summary))
        if plots:
            plot(trainer, arms, summary, out / f"reward_curves_{trainer}.png")
        result[trainer] = summary
    return result


def _ordered(arms: dict) -> list:
    """``full`` first, then the arms by name."""
    return sorted(arms.items(), key=lambda item: (item[0] != "full", item[0]))
