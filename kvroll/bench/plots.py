"""The PNG plots of ``kvroll bench`` (matplotlib, Agg): tokens/s per policy and budget, decode step time against
context length with the roofline floor drawn in, KV bytes per sequence and the largest batch per policy.

    files = write_plots(Path("runs/bench"), report)   # {"throughput": "tokens_per_s.png", ...}

Each PNG carries the numbers it draws in a ``kvroll:data`` text chunk (JSON), so a reader (or a test) can check
the picture against ``report.json``.
"""
from __future__ import annotations

import json
from pathlib import Path

from kvroll.bench.report import PLOTS


def _label(r: dict) -> str:
    name = "HF generate" if r["policy"] == "hf_generate" else r["policy"]
    name += "" if r["budget"] is None else f" {r['budget']}"
    return f"{name}\nb{r['batch']} L{r['length']}"


def _save(fig, path: Path, data) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"kvroll:data": json.dumps(data)})


def plot_throughput(rows: list[dict], path: Path) -> dict:
    """Bars: generated tokens/s of every measurement, labelled policy, budget, batch and output length; hatched where
    a compressing policy's rate is extrapolated from a shorter real run (``partial``: the table's "N tokens, rest
    extrapolated")."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    data = {"labels": [_label(r).replace("\n", " ") for r in rows], "tok_s": [r["tok_s"] for r in rows],
            "extrapolated": [partial(r) for r in rows]}
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(rows)), 4.5))
    colors = ["#888888" if r["policy"] in ("full", "hf_generate") else "#2b7bba" for r in rows]
    bars = ax.bar(range(len(rows)), data["tok_s"], color=colors)
    for bar, extrapolated in zip(bars, data["extrapolated"]):
        if extrapolated:  # per bar: any matplotlib (a list of hatches needs a recent one)
            bar.set_hatch("//")
            bar.set_edgecolor("white")
    ax.bar_label(bars, labels=[f"{v:,.0f}" for v in data["tok_s"]], fontsize=7)
    if any(data["extrapolated"]):
        ax.set_ylim(top=1.2 * max(data["tok_s"]))  # room for the legend above the bars
        ax.legend(handles=[Patch(facecolor="#2b7bba", hatch="//", edgecolor="white",
                                 label="extrapolated from a shorter real run")], fontsize=7, loc="upper left")
    ax.set_xticks(range(len(rows)), [_label(r) for r in rows], fontsize=7)
    ax.set_ylabel("generated tokens/s (decode)")
    ax.set_title("Throughput per policy and budget")
    _save(fig, path, data)
    plt.close(fig)
    return data


def partial(r: dict) -> bool:
    """Whether a compressing policy's rate is extrapolated from a real run shorter than its output (``full``'s
    context sweep and HF's two runs are their own methods, named in the report's table)."""
    return r.get("kind") == "engine" and r["policy"] != "full" and r.get("run_tokens", r["length"]) < r["length"]


def plot_step(rows: list[dict], path: Path) -> dict:
    """Lines: decode step time against context length per measurement; dashed: its roofline floor."""
    import matplotlib.pyplot as plt

    data = {}
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for i, r in enumerate(r for r in rows if r.get("step_curve")):
        label = _label(r).replace("\n", " ")
        ctx, step, floor = zip(*r["step_curve"])
        color = f"C{i % 10}"
        ax.plot(ctx, step, "o-", ms=3, color=color, label=label)
        ax.plot(ctx, floor, "--", color=color, lw=1)
        data[label] = {"context": list(ctx), "step_ms": list(step), "floor_ms": list(floor)}
    ax.set_xlabel("context length (prompt + generated tokens)")
    ax.set_ylabel("decode step (ms)")
    ax.set_title("Decode step vs context (dashed: roofline floor, weights + live KV / bandwidth)")
    ax.title.set_fontsize(9)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)
    _save(fig, path, data)
    plt.close(fig)
    return data


def plot_memory(rows: list[dict], path: Path) -> dict:
    """Two bar charts: KV + metadata MiB per sequence, and the largest batch that fits, per policy."""
    import matplotlib.pyplot as plt

    seen = {}
    for r in rows:
        seen.setdefault(f"{_label(r).splitlines()[0]}\nL{r['length']}", r)
    labels = list(seen)
    data = {"labels": [x.replace("\n", " ") for x in labels],
            "kv_mib_per_seq": [seen[x]["kv_bytes_per_seq"] / 2**20 for x in labels],
            "largest_batch": [seen[x]["largest_batch"] for x in labels]}
    fig, (left, right) = plt.subplots(1, 2, figsize=(max(8.0, 1.4 * len(labels)), 4.5))
    for ax, key, title in ((left, "kv_mib_per_seq", "KV + metadata per sequence (MiB)"),
                           (right, "largest_batch", "largest batch that fits")):
        bars = ax.bar(range(len(labels)), data[key], color="#2b7bba")
        ax.bar_label(bars, labels=[f"{v:,.1f}" if key.startswith("kv") else f"{v:,}" for v in data[key]],
                     fontsize=7)
        ax.set_xticks(range(len(labels)), labels, fontsize=7)
        ax.set_title(title, fontsize=9)
    _save(fig, path, data)
    plt.close(fig)
    return data


def write_plots(out: Path, report: dict) -> dict:
    """Draw the three PNGs of ``report`` into ``out``; returns {plot: file name}."""
    import matplotlib

    matplotlib.use("Agg")
    rows = report["measurements"]
    plot_throughput(rows, out / PLOTS["throughput"])
    plot_step(rows, out / PLOTS["step"])
    plot_memory(rows, out / PLOTS["memory"])
    return dict(PLOTS)
