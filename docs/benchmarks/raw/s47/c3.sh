#!/usr/bin/env bash
# Session 47, call 3 (nvidia-h200): the shipped GPU bench config, end to end with main's code, on an H200. The
# code after this session's splits and the bench audit's fixes (measure.py, schema.py), the same config and command as
# session 45's call 1; the report then validated against the schema.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 KVROLL_GIT_COMMIT=$(cat .commit 2>/dev/null || echo unknown)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.total --format=csv > $OUT/gpu.txt
t0=$SECONDS
timeout -s INT 570 python -m kvroll.cli bench --config configs/bench/qwen3_1.7b_h100.yaml --out $OUT/bench_h200 \
    --no-progress > $OUT/bench.log 2>&1
echo "rc $? at $((SECONDS - t0)) s"; tail -5 $OUT/bench.log; sed -n 1,40p $OUT/bench_h200/report.md
python - <<'PY'
import json, os
from kvroll.bench.schema import REPORT_SCHEMA
report = json.load(open(os.environ["OUT"] + "/bench_h200/report.json"))
try:
    import jsonschema
    jsonschema.validate(report, REPORT_SCHEMA)
    print("schema: valid")
except ImportError:
    print("schema: jsonschema not installed here")
print("status", report["status"], "measurements", len(report["measurements"]), "errors", len(report["errors"]))
PY
tar czf $OUT/bench_h200.tgz -C $OUT bench_h200 && rm -rf $OUT/bench_h200
