"""``kvroll bench``: throughput, memory, roofline and periodic-work measurements of the engine, with reports.

    kvroll bench --config configs/bench/cpu_smollm2.yaml --out runs/bench_cpu

    from kvroll.bench.config import load_config
    from kvroll.bench.sweep import run_sweep
    run_sweep(load_config("configs/bench/cpu_smollm2.yaml"), out="runs/bench_cpu", command="...")

``config`` (what to sweep), ``models`` (the model or a random-weight architecture), ``measure`` (the
measurements), ``sweep`` (the loop and partial writes), ``report`` (JSON / Markdown), ``plots`` (PNGs),
``schema`` (report.json's JSON schema), ``cli`` (the subcommand).
"""
