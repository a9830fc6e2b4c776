"""``kvroll bench``: the sweep of a bench config, written to a report folder.

    kvroll bench --config configs/bench/cpu_smollm2.yaml --out runs/bench_cpu
    kvroll bench --config configs/bench/qwen3_1.7b_h100.yaml --out $OUT/bench --policies full,rkv --budgets 512
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

USAGE = "kvroll bench --config configs/bench/NAME.yaml [--out DIR] [--FIELD VALUE ...]"


def add_bench_parser(subparsers) -> None:
    """Register ``kvroll bench``; its arguments are read by ``bench_parser`` (config fields are open-ended)."""
    p = subparsers.add_parser("bench", help="sweep policies x budgets x batches x lengths; report.{json,md} + PNGs",
                              add_help=False, prefix_chars="\0")
    p.add_argument("bench_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=lambda ns: main(ns.bench_args))


def bench_parser() -> argparse.ArgumentParser:
    from kvroll.bench.config import help_text

    parser = argparse.ArgumentParser(
        prog="kvroll bench", usage=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Measure generated tokens/s, KV memory, the decode step against its roofline and periodic "
                    "policy work over a sweep; write report.json, report.md and PNG plots to --out.",
        epilog="Config fields (YAML keys; each is also a --FIELD VALUE override, the value read as YAML; a list "
               "also takes a,b,c):\n" + help_text())
    parser.add_argument("--config", required=True, type=Path, help="a bench YAML, e.g. configs/bench/cpu_smollm2.yaml")
    parser.add_argument("--out", type=Path, default=None, help="report folder (default runs/bench/<config name>)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def main(argv: list[str]) -> int:
    """Parse and check everything (config, overrides, --out) before the model loads; then run the sweep."""
    from kvroll.bench.config import load_config

    args, overrides = bench_parser().parse_known_args(argv)
    config = load_config(args.config, overrides)
    from kvroll.bench.sweep import prepare_out, run_sweep  # imports torch: after the checks that need none

    out = prepare_out(args.out or Path("runs/bench") / args.config.stem)
    command = shlex.join(["kvroll", "bench", *argv])
    try:
        report = run_sweep(config, out, command, progress=not args.no_progress)
    except KeyboardInterrupt:
        print(f"kvroll bench: interrupted; the partial report is in {out}/report.md", file=sys.stderr)
        return 130
    failed = f", {len(report['errors'])} failed (see the report)" if report["errors"] else ""
    print(f"kvroll bench: {len(report['measurements'])} measurements in {report['seconds']:.0f} s{failed}; "
          f"report in {out}/report.md")
    return 1 if report["errors"] else 0


if __name__ == "__main__":  # python -m kvroll.bench.cli --config ... (without the other subcommands' imports)
    try:
        sys.exit(main(sys.argv[1:]))
    except ValueError as err:
        print(f"kvroll bench: error: {err}", file=sys.stderr)
        sys.exit(2)
