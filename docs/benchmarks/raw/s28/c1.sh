#!/usr/bin/env bash
# Session 28, call 1: tests/kernels run plainly on the GPU machine (no -m filter, no interpreter: the CPU-tensor
# tests' gating, session 27's lead), then the chain's tiles probed at the shapes not yet tiled: Qwen3-0.6B and
# Llama-3.2-1B at 128 rows, Qwen3-8B at 48 and 64 rows (benchmarks/chain_tiles_probe.py --wide).
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
t0=$SECONDS
timeout ${TESTS_S:-240} python -m pytest -q -rf tests/kernels -p no:cacheprovider > $OUT/kernels_plain.log 2>&1
echo "tests $((SECONDS - t0)) s"; grep -E "^FAILED|^ERROR" $OUT/kernels_plain.log | sed 's/ - .*//' | sort | uniq -c | head -40; tail -1 $OUT/kernels_plain.log
for spec in qwen3-0.6b:128 llama-3.2-1b:128 qwen3-8b:48,64; do
  t0=$SECONDS
  timeout ${PROBE_S:-110} python benchmarks/chain_tiles_probe.py --model ${spec%%:*} --rows ${spec##*:} --wide \
    > $OUT/probe_${spec%%:*}.log 2> $OUT/probe_${spec%%:*}.err
  echo "probe $spec $((SECONDS - t0)) s"; tail -2 $OUT/probe_${spec%%:*}.err
done
python - <<'PY'
import glob, json, os
for path in sorted(glob.glob(os.environ["OUT"] + "/probe_*.log")):
    for line in open(path):
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        timed = {k: v[0] for k, v in r.items() if isinstance(v, list)}
        print(r["model"], r["proj"], r["n"], r["k"], r["parts"], r["rows"], "cuBLAS", r["cublas_us"],
              " ".join(f"{k}:{v}" for k, v in sorted(timed.items(), key=lambda kv: kv[1])[:4]))
PY
