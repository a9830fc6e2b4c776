"""The report of ``kvroll bench``: ``report.json`` (every measurement and its environment) and ``report.md`` (the
tables a person reads), rewritten after each measurement.

    write_report(Path("runs/bench"), report, plots=True)   # report.json, report.md and the PNGs
    print(markdown(report))
"""
from __future__ import annotations

import json
from pathlib import Path

from kvroll.files import write_text

PLOTS = {"throughput": "tokens_per_s.png", "step": "decode_step_vs_context.png", "memory": "kv_memory.png"}


def write_json(path: str | Path, obj) -> None:
    """``obj`` as indented JSON at ``path`` (folder created; written to a temporary file, then renamed)."""
    write_text(path, json.dumps(obj, indent=1))


def append_jsonl(path: Path, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def add_ratios(report: dict) -> None:
    """Each row's ``x_full`` and ``x_hf``: its rate over ``full``'s and HF generate's at the same batch request
    and output length, when those were measured in this run (else None)."""
    rows = report["measurements"]
    bases = {(r["policy"], r["batch_request"], r["length"]): r["tok_s"] for r in rows
             if r["policy"] in ("full", "hf_generate")}
    for r in rows:
        for key, base in (("x_full", "full"), ("x_hf", "hf_generate")):
            rate = bases.get((base, r["batch_request"], r["length"]))
            r[key] = r["tok_s"] / rate if rate else None


def write_report(out: Path, report: dict, plots: bool = False) -> None:
    """Rewrite ``report.json`` and ``report.md`` in ``out``; with ``plots``, draw the PNGs first."""
    add_ratios(report)
    if plots and report["measurements"]:
        from kvroll.bench.plots import write_plots

        try:
            report["plots"] = write_plots(out, report)
        except Exception as err:  # e.g. no matplotlib on the GPU machine: the measurements must still be written
            report["plots_error"] = f"{type(err).__name__}: {err}"
    write_json(out / "report.json", report)
    write_text(out / "report.md", markdown(report))


def _f(value, digits: int = 0, suffix: str = "") -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}{suffix}"


def rate_text(value: float | None) -> str:
    """A rate with the digits that matter: 12,345 / 45.6 / 3.21."""
    return "-" if value is None else _f(value, 0 if value >= 100 else 1 if value >= 10 else 2)


def _commit(commit: str | None) -> str:
    return commit[:12] if commit else "unknown: not a clean checkout; set KVROLL_GIT_COMMIT"


def _name(r: dict) -> str:
    if r["policy"] == "hf_generate":
        return "HF generate (StaticCache, SDPA)"
    return r["policy"] if r["budget"] is None else f"{r['policy']} {r['budget']}"


def markdown(report: dict) -> str:
    """The report's tables as Markdown."""
    env, cfg, rows = report["environment"], report["config"], report["measurements"]
    lines = _header(report, env, cfg)
    lines += _throughput(rows, env)
    lines += _memory(rows, env, cfg)
    lines += _roofline(rows, env)
    lines += _kernel_time(rows)
    lines += _periodic(rows)
    if report.get("plots"):
        lines += ["## Plots", ""] + [f"![{name}]({file})" for name, file in report["plots"].items()] + [""]
    if report.get("plots_error"):
        lines += [f"Plots not drawn: `{report['plots_error']}`", ""]
    if report["errors"]:
        lines += ["## Errors", ""] + [f"* {_name(e)} batch {e['batch_request']} length {e['length']}: "
                                      f"`{e['error']}`" for e in report["errors"]] + [""]
    return "\n".join(lines)


def _header(report, env, cfg) -> list[str]:
    model = cfg["model"] or f"{cfg['architecture']} (random weights)"
    status = {"complete": "complete", "running": "**partial** (still running)",
              "interrupted": "**partial** (interrupted)"}.get(report["status"], report["status"])
    return [
        f"# kvroll bench: {model}", "",
        f"* Status: {status}, {len(report['measurements'])} measurements in {report['seconds']:.0f} s"
        f"{', ' + str(len(report['errors'])) + ' failed' if report['errors'] else ''}.",
        f"* Device: {env['device_name']} ({env['device']}; CPU {env['cpu']}, {env['torch_threads']} torch threads); "
        f"{env['dtype']}; copy bandwidth measured in this run {env['copy_bandwidth'] / 1e9:,.1f} GB/s"
        f"{'; fused MLP (gate+up matmul, SiLU*mul kernel) on' if env.get('fused_mlp') else ''}"
        f"{'; fused QKV + rotary (one QKV matmul, rotary kernel) on' if env.get('fused_qkv_rotary') else ''}"
        f"{'; fused residual add + RMSNorm (one kernel) on' if env.get('fused_add_norm') else ''}"
        f"{'; fused sampler (two kernels) on' if env.get('fused_sampling') else ''}.",
        f"* Versions: torch {env['torch']}, transformers {env['transformers']}, triton {env['triton'] or '-'}, "
        f"kvroll {env['kvroll']} (commit {_commit(env.get('git_commit'))}); {env['date']}.",
        f"* Command: `{env['command']}`",
        f"* Model: {env['model_type']}, {env['num_layers']} layers, {env['num_kv_heads']} KV heads, weights "
        f"{env['weight_bytes'] / 2**20:,.0f} MiB, KV {env['kv_bytes_per_token'] / 2**10:,.1f} KiB per token.",
        f"* Prompt {cfg['prompt_length']} random tokens, temperature {cfg['temperature']}, EOS ignored.", "",
        "How each rate is measured (`kvroll/bench/measure.py`): a compressing policy runs one real `generate` of "
        f"min(output, fill + {cfg['steady_steps']}) new tokens; when that is shorter than the output, the rest is "
        "extrapolated at its steady step (last quarter of the run). `full` has its cache filled to a few "
        f"context lengths and {cfg['full_steps']} steps timed at each; its rate integrates the step over the output. "
        "HF "
        f"generate's rate is the difference of runs of {cfg['hf_new_tokens'][0]} and {cfg['hf_new_tokens'][1]} "
        "new tokens with a StaticCache sized for prompt + output (its SDPA attends over every slot at every "
        "step, so its step does not depend on how far it has generated). Rates are decode rates (prefill "
        "excluded); `e2e` is a real run's generated tokens over its wall time, prefill included.", "",
    ]


def _throughput(rows, env) -> list[str]:
    out = ["## Generated tokens/s", "",
           "| policy | batch | output | tokens/s | x full | x HF generate | measured | e2e tokens/s (real run) |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        measured = (f"{r['run_tokens']:,} tokens, rest extrapolated" if r["extrapolated"] and r["kind"] == "engine"
                    and r["policy"] != "full" else "context sweep" if r["policy"] == "full"
                    else "two runs, difference" if r["policy"] == "hf_generate"
                    else f"all {r['run_tokens']:,} tokens")
        out.append(f"| {_name(r)} | {r['batch']} ({r['batch_request']}) | {r['length']:,} | {rate_text(r['tok_s'])} | "
                   f"{_f(r['x_full'], 2, 'x')} | {_f(r['x_hf'], 1, 'x')} | {measured} | "
                   f"{rate_text(r.get('e2e_tok_s'))} |")
    return out + [""]


def _memory(rows, env, cfg) -> list[str]:
    where = "free GPU memory" if env["device"] == "cuda" else "available system memory"
    out = ["## KV memory per sequence and the largest batch", "",
           f"Largest batch: ({where} at the measurement - reserve {cfg['reserve_gb']} GiB) / bytes per sequence, "
           f"capped at {cfg['max_batch_cap']}.", "",
           "| policy | output | capacity (tokens per head) | KV + metadata per sequence | largest batch |",
           "|---|---|---|---|---|"]
    seen = set()
    for r in rows:
        key = (_name(r), r["length"])
        if key in seen:
            continue
        seen.add(key)
        out.append(f"| {_name(r)} | {r['length']:,} | {r['capacity']:,} | {r['kv_bytes_per_seq'] / 2**20:,.2f} MiB "
                   f"| {r['largest_batch']:,} |")
    return out + [""]


def _roofline(rows, env) -> list[str]:
    out = ["## Steady decode step against the roofline floor", "",
           "Floor = (weight bytes + live KV bytes) / copy bandwidth. Compressing policies: the last quarter of the "
           "real run (periodic work included). `full`: the longest context. HF: every static-cache slot."
           + ("" if env["device"] == "cuda" else " On a CPU the floor is indicative only (Python overhead "
                                                  "dominates small steps).")
           + " Kernels: one eager step profiled on CUDA (the graph replays the same kernels); per layer: the "
             "decoder layer that launches the most (`kvroll/bench/kernel_count.py`).", "",
           "| policy | batch | output | live tokens per head | step (ms) | floor (ms) | step / floor | kernels per "
           "step | kernels per layer |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {_name(r)} | {r['batch']} | {r['length']:,} | {_f(r['mean_live_tokens'])} | "
                   f"{_f(r['steady_step_ms'], 2)} | {_f(r['floor_step_ms'], 2)} | {_f(r['step_over_floor'], 2, 'x')} | "
                   f"{_f(r.get('kernels_per_step'))} | {_f(r.get('kernels_per_layer'))} |")
    return out + [""]


def _kernel_time(rows, top: int = 4) -> list[str]:
    """Where one decode step's device time goes (CUDA rows only: ``kernel_count``'s device times)."""
    timed = [r for r in rows if r.get("kernel_us_per_step")]
    if not timed:
        return []
    out = ["## Device time of one decode step, by kernel", "",
           "One eager step profiled (each kernel as long as in the graph) with every slot's cache holding the "
           "live tokens of the step it stands for: a compressing policy's mean over the steady window (its "
           "capacity for a step policy), `full`'s longest context of the sweep. Busy = the kernels' summed device "
           "time; step - busy is time the graph's step spends otherwise (launch gaps, waits).", "",
           "| policy | batch | step (ms) | busy (ms) | per layer (µs, mean) | outside layers (µs) | "
           f"top {top} kernels: count × name, µs |",
           "|---|---|---|---|---|---|---|"]
    for r in timed:
        layers = r.get("kernel_us_by_layer") or []
        per_layer = sum(layers) / len(layers) if layers else None
        kernels = "; ".join(f"{count} × `{name[:48]}` {us:,.0f}" for name, count, us in r["top_kernels"][:top])
        out.append(f"| {_name(r)} | {r['batch']} | {_f(r['steady_step_ms'], 2)} | "
                   f"{_f(r['kernel_us_per_step'] / 1e3, 2)} | {_f(per_layer, 1)} | "
                   f"{_f(r['kernel_us_outside_layers'], 0)} | {kernels} |")
    return out + [""]


def _periodic(rows) -> list[str]:
    periodic = [r for r in rows if r.get("events", 0) >= 2]
    out = ["## Periodic policy work", ""]
    if not periodic:
        return out + ["No measured policy compressed periodically more than once.", ""]
    out += ["Share = median event / (median steps between events x the pure decode step of the run's last quarter).",
            "",
            "| policy | batch | output | events | ms per event | steps between | pure step (ms) | share of decode |",
            "|---|---|---|---|---|---|---|---|"]
    for r in periodic:
        out.append(f"| {_name(r)} | {r['batch']} | {r['length']:,} | {r['events']} | {_f(r['event_ms_median'], 1)} | "
                   f"{_f(r['event_interval_steps'])} | {_f(r['pure_step_ms'], 2)} | "
                   f"{_f(100 * r['policy_share'], 1, '%')} |")
    return out + [""]
