"""The sweep of ``kvroll bench``: every (policy, budget, batch, output length) measured in turn, with a progress bar,
and the report rewritten after each measurement so that an interrupted run keeps what it measured.

    config = load_config("configs/bench/cpu_smollm2.yaml")
    report = run_sweep(config, out="runs/bench_cpu", command="kvroll bench --config ...")

``out`` receives ``measurements.jsonl`` (one line per finished measurement, appended), ``report.json`` and
``report.md`` (rewritten after each), ``config.yaml`` (the resolved config) and the PNG plots (drawn at the end,
and on an interruption). An earlier sweep's files in ``out`` move to ``out/previous-<UTC time>/`` first
(``keep_previous``).
"""
from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from kvroll.bench.config import BenchConfig
from kvroll.files import exclusive, move_to_previous
from kvroll.kernels.fusions import SWITCHES, resolve_fusions

SCHEMA_VERSION = 1


def prepare_out(out: str | Path) -> Path:
    """Create ``out`` and check it is writable, before anything is measured."""
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".kvroll_bench_write_test"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise ValueError(f"--out {out} is not a writable directory ({err.strerror or err}); pass a folder you can "
                         "write to, e.g. --out runs/bench.") from None
    return out


def keep_previous(out: Path) -> Path | None:
    """A sweep run before into ``out``: its files (report, measurements, config, PNGs) move to
    ``out/previous-<UTC time>/`` (said on stderr), so that a rerun neither drops its measurements nor leaves its
    plots beside the new report. Returns that folder, or None when ``out`` held no report."""
    from kvroll.bench.report import PLOTS

    names = ["report.json", "report.md", "measurements.jsonl", "config.yaml", *PLOTS.values()]
    found = [out / name for name in names if (out / name).exists()]
    if not any(p.name in ("report.json", "measurements.jsonl") for p in found):
        return None
    return move_to_previous(out, found, "kvroll bench", "an earlier sweep")


def point_label(point: dict) -> str:
    budget = "" if point["budget"] is None else f"@{point['budget']}"
    return f"{point['policy']}{budget} batch {point['batch_request']} len {point['length']}"


def run_sweep(config: BenchConfig, out: str | Path, command: str, progress: bool = True) -> dict:
    """Measure every point of ``config`` and write the report to ``out``; returns the report dict. A second sweep
    into the same ``out`` while this one runs is refused at once (``ValueError``), before it moves any file."""
    out = prepare_out(out)
    with exclusive(out, "kvroll bench", "--out"):
        return _sweep(config, out, command, progress)


def _sweep(config: BenchConfig, out: Path, command: str, progress: bool) -> dict:
    import torch
    import yaml
    from tqdm import tqdm

    from kvroll.bench import report as reports
    from kvroll.bench.measure import Bench, free_memory
    from kvroll.bench.models import build_model, resolve_dtype

    points = [dict(p, batch_request=p.pop("batch")) for p in config.points()]
    if config.threads:
        torch.set_num_threads(config.threads)
    device = torch.device("cuda" if config.device == "auto" and torch.cuda.is_available()
                          else "cpu" if config.device == "auto" else config.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but torch sees no CUDA device; use device: cpu (or auto).")
    keep_previous(out)
    (out / "config.yaml").write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
    (out / "measurements.jsonl").write_text("")
    start = time.time()
    model = build_model(config.model, config.architecture, resolve_dtype(config.dtype, device), device, config.seed)
    bench = Bench(model, config.prompt_length, config.reserve_gb, config.max_batch_cap, config.temperature,
                  config.seed, resolve_fusions(config.switches(), device))
    report = {"schema_version": SCHEMA_VERSION, "status": "running", "environment": environment(bench, command),
              "config": config.to_dict(), "measurements": [], "errors": [], "seconds": 0.0}
    try:
        with tqdm(total=len(points), desc="kvroll bench", unit="run", file=sys.stderr, disable=not progress) as bar:
            for point in points:
                bar.set_postfix_str(point_label(point))
                _measure_into(report, bench, config, point, out)
                report["seconds"] = time.time() - start
                reports.write_report(out, report)
                free_memory()
                bar.update()
        report["status"] = "complete"
    except KeyboardInterrupt:
        report["status"] = "interrupted"
        raise
    finally:
        report["seconds"] = time.time() - start
        reports.write_report(out, report, plots=True)
    return report


def _measure_into(report: dict, bench, config: BenchConfig, point: dict, out: Path) -> None:
    """Measure one point; its row goes to the report and ``measurements.jsonl``, a failure to ``errors``."""
    from kvroll.bench import measure
    from kvroll.bench.report import append_jsonl

    batch, length = point["batch_request"], point["length"]
    started = time.time()
    try:
        if point["kind"] == "hf_generate":
            row = measure.measure_hf(bench, batch, length, config.hf_new_tokens)
        elif point["policy"] == "full":
            row = measure.measure_full(bench, batch, length, config.full_steps)
        else:
            row = measure.measure_policy(bench, point["policy"], point["budget"], batch, length, config.steady_steps,
                                         config.policy_kwargs.get(point["policy"]))
    except Exception as err:  # one failed point (e.g. out of memory) must not lose the others
        report["errors"].append({**point, "error": f"{type(err).__name__}: {err}"[:600]})
        print(f"kvroll bench: {point_label(point)} failed: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        return
    row = {**point, **row, "measure_s": time.time() - started}
    report["measurements"].append(row)
    append_jsonl(out / "measurements.jsonl", row)


def environment(bench, command: str) -> dict:
    """Where and how the run was made: device, versions, date, command, the model's byte counts."""
    import torch
    import transformers

    import kvroll

    device = bench.device
    cfg = bench.model.config
    env = {"device": device.type, "device_name": _device_name(device), "cpu": _cpu_name(),
           "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
           "python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "triton": _version("triton"), "kvroll": kvroll.__version__,
           "git_commit": _git_commit(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "command": command, "model_type": cfg.model_type, "num_layers": cfg.num_hidden_layers,
           "num_kv_heads": cfg.num_key_value_heads, "dtype": str(next(bench.model.parameters()).dtype),
           "weight_bytes": bench.weight_bytes, "kv_bytes_per_token": bench.kv_per_token,
           "copy_bandwidth": bench.bandwidth, "prompt_length": bench.prompt_length,
           **{name: False for name in SWITCHES}, **bench.switches()}
    if device.type == "cuda":
        env["device_memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
    return env


def _device_name(device) -> str:
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:  # not installed, or broken on this machine: the report says none
        return None


def _git_commit() -> str | None:
    """The commit the measured code is: ``$KVROLL_GIT_COMMIT`` when set (a copy of the tree made elsewhere), else
    the HEAD of kvroll's own repository when its tracked files are unchanged, else None (the report says
    "unknown"). A copy without its history may sit in another repository, or carry a stale ``.git`` whose HEAD is
    days older than its files (the H100 report of 0b39b73 read such a HEAD): its hash would be a wrong one."""
    if os.environ.get("KVROLL_GIT_COMMIT"):
        return os.environ["KVROLL_GIT_COMMIT"].strip()
    root = Path(__file__).resolve().parents[2]

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=5)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != root:  # kvroll is not the root of this repository (an install, a copy)
        return None
    if git("status", "--porcelain", "--untracked-files=no") != "":  # changed files, or git failed
        return None
    return git("rev-parse", "HEAD") or None
