"""Benchmarks (b) and (c), engine throughput, decode roofline and KV memory: now ``kvroll bench``.

    PYTHONPATH=. python benchmarks/engine_throughput.py --out $OUT/bench [--FIELD VALUE ...]   # on a CUDA GPU

is ``kvroll bench --config configs/bench/qwen3_1.7b_h100.yaml --out $OUT/bench`` (the measuring code lives in
``kvroll/bench/``; the sessions 1-5 tables of ``docs/benchmarks/engine_throughput.md`` were measured by this file's
earlier version, whose flags map to config fields: ``--policies``, ``--policy_kwargs``, ``--batch_sizes``,
``--steady_steps``). Without ``--config`` the Qwen3-1.7B H100 config is used.
"""
from __future__ import annotations

import sys

from kvroll.bench.cli import main

DEFAULT_CONFIG = "configs/bench/qwen3_1.7b_h100.yaml"

if __name__ == "__main__":
    argv = sys.argv[1:]
    sys.exit(main(argv if "--config" in argv else ["--config", DEFAULT_CONFIG, *argv]))
