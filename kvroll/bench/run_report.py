"""``kvroll report RUN_DIR``: a training run's logs as ``report.md`` and four PNGs (reward; tokens/s and rollout
share; completion lengths; rollout/trainer mismatch, each over steps).

    kvroll report runs/grpo_smollm2                 # writes runs/grpo_smollm2/report.md + *.png
    path = write_run_report(Path("runs/grpo_smollm2"), out=None)

It reads what ``kvroll train`` writes into its ``output_dir``: ``metrics.jsonl`` (one line per logged step), else
``log_history.json`` (the trainer's log history), and ``run.json`` (model, policy, budget) when present. A folder
without those logs is a ``UsageError`` naming it. Importing this module loads neither torch nor matplotlib.
"""
from __future__ import annotations

import json
from pathlib import Path

from kvroll.bench.report import rate_text
from kvroll.usage import UsageError, read_text

PLOTS = {"reward": "reward.png", "throughput": "tokens_per_s.png", "lengths": "completion_lengths.png",
         "mismatch": "mismatch.png"}
DLOGP, IS = "sampling/sampling_logp_difference", "sampling/importance_sampling_ratio"


def training_row(logs: dict) -> bool:
    """A logged training step (not the trainer's end-of-run summary, not an evaluation: its keys start with "eval_",
    beside the "epoch" and "step" the trainer adds to every log). PPO logs the optimizer steps between its rollouts
    without a reward; they count as steps too (their time, their syncs)."""
    return bool(logs) and "train_runtime" not in logs and not any(key.startswith("eval_") for key in logs)


def read_run(run_dir: Path) -> tuple[list[dict], dict]:
    """(one dict per logged training step, run.json or {}); ``UsageError`` for a folder without logs."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UsageError(f"RUN_DIR {run_dir} is not a directory; pass the output_dir of a kvroll train run.")
    rows, source = [], run_dir / "metrics.jsonl"
    if source.is_file():
        rows = [r for r in _json_lines(source) if "step" in r]
    if not rows and (run_dir / "log_history.json").is_file():  # (a metrics.jsonl without steps: the trainer's log)
        source = run_dir / "log_history.json"
        history = _json_file(run_dir / "log_history.json")
        if not isinstance(history, list):
            raise UsageError(f"{run_dir / 'log_history.json'} is not a list of logged steps (a trainer's "
                             "log_history); pass the output_dir of a kvroll train run.")
        rows = [r for r in history if isinstance(r, dict) and training_row(r) and "step" in r]
    if not rows:
        raise UsageError(f"RUN_DIR {run_dir} holds no training logs (metrics.jsonl or log_history.json with logged "
                         "steps); pass the output_dir of a kvroll train run.")
    info = _json_file(run_dir / "run.json") if (run_dir / "run.json").is_file() else {}
    if not isinstance(info, dict):
        raise UsageError(f"{run_dir / 'run.json'} is not a JSON object (kvroll train writes one); remove or fix it.")
    _check_numbers(source, rows)
    return rows, info


def _check_numbers(path: Path, rows: list[dict]) -> None:
    """Every step is an integer and every figure the summary and the table compute with a number (or null)."""
    keys = {"reward", "kvroll/kv_bytes_full_equivalent", "kvroll/completion_length/mean", "completions/mean_length",
            "kvroll/truncated_fraction", "completions/clipped_ratio", "kvroll/budget", "kvroll/step_seconds",
            "kvroll/rollout_seconds", *(key for _, key, *_ in COLUMNS)}
    for r in rows:
        bad = [(key, r[key]) for key in keys if r.get(key) is not None and not _is_number(r[key])]
        if not isinstance(r["step"], int) or isinstance(r["step"], bool):
            bad = [("step", r["step"])]
        if bad:
            raise UsageError(f"{path}: step {r['step']!r} logs {bad[0][0]}={bad[0][1]!r}, not a number (kvroll train "
                             "logs numbers); restore or remove that step.")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _json_file(path: Path):
    try:
        return json.loads(read_text("RUN_DIR's log", path))
    except json.JSONDecodeError as err:
        raise UsageError(f"{path}:{err.lineno} is not JSON ({err.msg}); restore or remove it.") from None


def _json_lines(path: Path) -> list[dict]:
    """metrics.jsonl's objects, one a line. A last line cut short (a run killed while writing it) is dropped with a
    note on stderr; any other line that is not a JSON object is a ``UsageError`` naming the file and line."""
    import sys

    lines = read_text("RUN_DIR's log", path).splitlines()
    last = max((number for number, line in enumerate(lines, 1) if line.strip()), default=0)
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            if number == last:
                print(f"kvroll report: {path}:{number} is cut short ({err.msg}): the run was stopped while "
                      "writing it; the report leaves it out.", file=sys.stderr)
                break
            raise UsageError(f"{path}:{number} is not JSON ({err.msg}); restore or remove the line.") from None
        if not isinstance(row, dict):
            raise UsageError(f"{path}:{number} is {type(row).__name__} {line.strip()[:40]!r}, not a JSON object of "
                             "a logged step; restore or remove the line.")
        rows.append(row)
    return rows


def write_run_report(run_dir: Path, out: Path | None = None, logs: tuple[list[dict], dict] | None = None) -> Path:
    """Render ``run_dir``'s logs into ``out`` (default ``run_dir``): report.md and the PNGs; returns report.md.
    ``logs``: what ``read_run(run_dir)`` returned, when the caller has read them already."""
    rows, info = logs or read_run(run_dir)
    out = Path(out or run_dir)
    out.mkdir(parents=True, exist_ok=True)
    plots, error = {}, None
    try:
        plots = write_plots(out, rows)
    except Exception as err:  # a report without pictures beats none (e.g. no matplotlib)
        error = f"{type(err).__name__}: {err}"
    path = out / "report.md"
    path.write_text(markdown(rows, info, Path(run_dir), plots, error))
    return path


def _series(rows: list[dict], key: str) -> list[float | None]:
    return [r.get(key) for r in rows]


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _num(value, digits: int = 3) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def markdown(rows: list[dict], info: dict, run_dir: Path, plots: dict, plot_error: str | None) -> str:
    """The run's header, a summary, one table row per step and the plots."""
    lines = [f"# kvroll train: {run_dir}", ""]
    if info:
        task = f", {info['task_style']} arithmetic task" if info.get("task_style") else ""
        mode, workers = info.get("kvroll_mode"), info.get("kvroll_num_workers")  # kvroll rollouts only
        if mode:
            mode = f" ({mode} mode" + (f", {workers} worker{'s' if workers != 1 else ''})" if workers else ")")
        lines += [f"* Model {info.get('model', '-')}, {info.get('trainer', 'grpo')}{task}, rollouts: "
                  f"{info.get('rollouts', '-')}{mode or ''}, max_completion_length "
                  f"{info.get('max_completion_length', '-')}, "
                  f"max_steps {info.get('max_steps', '-')}."]
    else:  # a folder without run.json (not written by kvroll train): the header says so
        lines += [f"* Model and settings unknown: no run.json in {run_dir.name}."]
    lines += _summary(rows) + _table(rows)
    if plots:
        lines += ["## Plots", ""] + [f"![{name}]({file})" for name, file in plots.items()] + [""]
    if plot_error:
        lines += [f"Plots not drawn: `{plot_error}`", ""]
    lines += ["Definitions (kvroll/trainers/metrics.py): KV is per row at its end, summed over the step's rows; "
              "full KV = prompt + completion - 1 tokens per row; evicted = the tokens beyond a slot's capacity. "
              "|dlogp| = mean |logp_rollout - logp_trainer| over completion tokens; IS = TRL's importance-sampling "
              "ratio; masked = share of tokens the *_mask modes zeroed.", ""]
    return "\n".join(lines)


def rollout_share(rows: list[dict]) -> float | None:
    """The rollouts' share of the logged steps' wall time: their seconds over the steps' (a PPO step between
    rollouts adds time and no rollout); the mean of the steps' shares for logs without step times."""
    timed = [r for r in rows if r.get("kvroll/step_seconds") is not None]
    if not timed:
        return _mean(_series(rows, "kvroll/rollout_share"))
    total = sum(r["kvroll/step_seconds"] for r in timed)
    return sum(r.get("kvroll/rollout_seconds") or 0.0 for r in timed) / total if total > 0 else None


def rollout_rate(rows: list[dict]) -> float | None:
    """Generated tokens a second over the logged steps: each step's rate weighted by its rollout seconds (its tokens
    over the steps' rollout seconds); the mean of the steps' rates for logs without rollout seconds."""
    pairs = [(r["kvroll/rollout_tokens_per_second"], r["kvroll/rollout_seconds"]) for r in rows
             if r.get("kvroll/rollout_tokens_per_second") is not None and (r.get("kvroll/rollout_seconds") or 0) > 0]
    if not pairs:
        return _mean(_series(rows, "kvroll/rollout_tokens_per_second"))
    return sum(rate * seconds for rate, seconds in pairs) / sum(seconds for _, seconds in pairs)


def _last(rows: list[dict], key: str):
    """The last logged value of ``key`` (a PPO step between rollouts logs none)."""
    return next((r[key] for r in reversed(rows) if r.get(key) is not None), None)


def _summary(rows: list[dict]) -> list[str]:
    rewarded = [r for r in rows if r.get("reward") is not None]
    half = max(1, len(rewarded) // 2)
    first, last = _mean(_series(rewarded[:half], "reward")), _mean(_series(rewarded[-half:], "reward"))
    kv, full = _mean(_series(rows, "kvroll/kv_bytes")), _mean(_series(rows, "kvroll/kv_bytes_full_equivalent"))
    share = rollout_share(rows)
    length = _mean(_series(rows, "kvroll/completion_length/mean"))  # else TRL's own (a run without kvroll)
    length = _mean(_series(rows, "completions/mean_length")) if length is None else length
    truncated = _mean(_series(rows, "kvroll/truncated_fraction"))
    truncated = _mean(_series(rows, "completions/clipped_ratio")) if truncated is None else truncated
    return [f"* {len(rows)} logged step{'s' if len(rows) != 1 else ''} (last step {rows[-1]['step']}, "
            f"{rows[-1].get('elapsed_s', '-')} s); mean "
            f"reward first half {_num(first)}, last half {_num(last)}.",
            f"* Rollouts: {rate_text(rollout_rate(rows))} generated tokens/s, "
            f"{'-' if share is None else f'{100 * share:.0f}%'} of the steps' wall time; completions "
            f"{_num(length, 1)} tokens on average, {_num(truncated, 2)} truncated.",
            f"* KV held for a step's rows: {_num(None if kv is None else kv / 2**20, 2)} MiB against "
            f"{_num(None if full is None else full / 2**20, 2)} MiB with full KV "
            f"({_num(None if kv is None or not full else kv / full, 2)}x) at budget "
            f"{_num(_last(rows, 'kvroll/budget'), 0)}; {_num(_mean(_series(rows, 'kvroll/evicted_tokens')), 0)} "
            "tokens evicted a step.",
            f"* Mismatch: mean |dlogp| {_num(_mean(_series(rows, DLOGP + '/mean')))}; IS ratio "
            f"{_range(_min(_series(rows, IS + '/min')), _max(_series(rows, IS + '/max')))}.", ""]


def _range(low, high) -> str:
    """"low-high"; "-" when neither bound is logged; the logged one, named, when only one is."""
    if low is None and high is None:
        return "-"
    if low is None:
        return f"max {_num(high)} (no min logged)"
    if high is None:
        return f"min {_num(low)} (no max logged)"
    return f"{_num(low)}-{_num(high)}"


def _min(values):
    values = [v for v in values if v is not None]
    return min(values) if values else None


def _max(values):
    values = [v for v in values if v is not None]
    return max(values) if values else None


COLUMNS = (("reward", "reward", 3, 1), ("tokens/s", "kvroll/rollout_tokens_per_second", 1, 1),
           ("rollout share", "kvroll/rollout_share", 2, 1), ("len mean", "kvroll/completion_length/mean", 1, 1),
           ("len p90", "kvroll/completion_length/p90", 0, 1), ("truncated", "kvroll/truncated_fraction", 2, 1),
           ("KV MiB", "kvroll/kv_bytes", 2, 2**-20), ("full KV MiB", "kvroll/kv_bytes_full_equivalent", 2, 2**-20),
           ("evicted", "kvroll/evicted_tokens", 0, 1), ("|dlogp|", DLOGP + "/mean", 3, 1),
           ("IS min", IS + "/min", 3, 1), ("IS max", IS + "/max", 3, 1), ("masked", "kvroll/is_masked_fraction", 3, 1),
           ("sync ms", "kvroll/sync_seconds", 2, 1000))


def _table(rows: list[dict]) -> list[str]:
    out = ["## Per step", "", "| step | " + " | ".join(name for name, *_ in COLUMNS) + " |",
           "|---|" + "---|" * len(COLUMNS)]
    for r in rows:
        cells = [_num(None if r.get(key) is None else r[key] * scale, digits) for _, key, digits, scale in COLUMNS]
        out.append(f"| {r['step']} | " + " | ".join(cells) + " |")
    return out + [""]


def write_plots(out: Path, rows: list[dict]) -> dict:
    """The four PNGs (each with its numbers in a ``kvroll:data`` text chunk); returns {plot: file name}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvroll.bench.plots import _save

    steps = [r["step"] for r in rows]
    rewards = sorted({key for r in rows for key in r if key.startswith("rewards/") and key.endswith("/mean")})
    charts = {"reward": ("reward", ["reward", *rewards]),
              "throughput": ("generated tokens/s", ["kvroll/rollout_tokens_per_second"]),
              "lengths": ("completion tokens", [f"kvroll/completion_length/{k}" for k in ("mean", "p50", "p90", "max")]),
              "mismatch": ("|logp_rollout - logp_trainer|", [DLOGP + "/mean", DLOGP + "/max"])}
    for name, (ylabel, keys) in charts.items():
        fig, ax = plt.subplots(figsize=(7.0, 4.0))
        data = {"step": steps}
        for key in keys:
            values = _series(rows, key)
            if any(v is not None for v in values):
                data[key] = values
                ax.plot(steps, [float("nan") if v is None else v for v in values], "o-", ms=3, label=key)
        if name == "throughput":
            _twin(ax, steps, _series(rows, "kvroll/rollout_share"), "rollout share of the step", data)
        if name == "mismatch":
            _twin(ax, steps, _series(rows, IS + "/max"), "importance-sampling ratio max", data)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(ylabel)
        if ax.get_legend_handles_labels()[0]:  # (a run without these keys: an empty chart, no legend)
            ax.legend(fontsize=7, loc="upper left")
        _save(fig, out / PLOTS[name], data)
        plt.close(fig)
    return dict(PLOTS)


def _twin(ax, steps, values, label, data) -> None:
    if not any(v is not None for v in values):
        return
    right = ax.twinx()
    right.plot(steps, [float("nan") if v is None else v for v in values], "s--", ms=3, color="C3", label=label)
    right.set_ylabel(label)
    right.legend(fontsize=7, loc="upper right")
    data[label] = values


def add_report_parser(subparsers) -> None:
    """Register ``kvroll report RUN_DIR [--out DIR]``."""
    p = subparsers.add_parser("report", help="render a kvroll train run's logs into report.md + PNG plots")
    p.add_argument("run_dir", type=Path, help="the output_dir of a kvroll train run")
    p.add_argument("--out", type=Path, default=None, help="where to write report.md and the PNGs (default RUN_DIR)")
    p.set_defaults(func=run_report_command)


def run_report_command(args) -> int:
    from kvroll.usage import check_writable_dir

    logs = read_run(args.run_dir)  # the folder's logs are checked before the output folder (and read once)
    check_writable_dir("--out", args.out or args.run_dir)
    print(f"kvroll report: {write_run_report(args.run_dir, args.out, logs)}")
    return 0
