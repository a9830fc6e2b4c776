#!/usr/bin/env bash
# Session 34, call 1: the fused sampler's in-kernel draw as the inverse CDF at one uniform per row ("icdf") against
# Gumbel-max with Philox noise per entry ("gumbel"): the sampler alone (checked against the fp64 reference first),
# the sampler's GPU tests, then the engine, LongFlow at batches 128 and 256, one run per arm, interleaved.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
mkdir -p $OUT/c1
t0=$SECONDS
if git rev-parse HEAD >/dev/null 2>&1; then
  git diff --name-only HEAD | grep -v -e kvroll/kernels/sample.py | xargs -r git checkout HEAD --
fi
timeout 150 python benchmarks/sample_icdf_ab.py --out $OUT/c1 > $OUT/c1/sample_ab.log 2>&1
echo "sample ab rc $? at $((SECONDS - t0)) s"; cat $OUT/c1/sample_ab.log | tail -14
timeout 120 python -m pytest -q -m gpu tests/kernels/test_sample.py tests/kernels/test_head_sample.py -p no:cacheprovider > $OUT/c1/gpu_tests.log 2>&1
echo "tests rc $? at $((SECONDS - t0)) s"; tail -3 $OUT/c1/gpu_tests.log
F=kvroll/kernels/sample.py
NEW='^INVERSE_CDF = True'
eng() { STAGES=engine ENGINE_TIMEOUT=110 bash benchmarks/run_gpu.sh --architecture qwen3-1.7b --policies $1 --budgets 1024 --batch_sizes $2 --output_lengths 4096 --steady_steps 512 --full_steps 32 --hf_generate false > $OUT/c1/engine_$1_$2_$3.log 2>&1; sed "s/^{/{\"arm\": \"$3\", /" $OUT/bench/measurements.jsonl >> $OUT/c1/engine.jsonl; rm -rf $OUT/bench; }
for spec in "longflow 256" "longflow 128"; do
  set -- $spec
  if (( SECONDS - t0 > 430 )); then echo "skip $spec (time)"; continue; fi
  sed -i "s/^INVERSE_CDF = False/INVERSE_CDF = True/" $F; eng $1 $2 icdf
  sed -i "s/^INVERSE_CDF = True/INVERSE_CDF = False/" $F; eng $1 $2 gumbel
  sed -i "s/^INVERSE_CDF = False/INVERSE_CDF = True/" $F
  echo "$spec at $((SECONDS - t0)) s"
done
python - <<'PY'
import json, os
p = os.environ["OUT"] + "/c1/engine.jsonl"
for line in (open(p) if os.path.exists(p) else []):
    r = json.loads(line)
    print(r["arm"], r["policy"], r["batch"], round(r["steady_step_ms"], 4), round(r["floor_step_ms"], 4), round(r["step_over_floor"], 4), r["kernels_per_step"],
          [(k[0][:24], k[1], round(k[2], 1)) for k in r["top_kernels"] if "kernel" in k[0].lower() and ("mass" in k[0] or "pick" in k[0] or "chunk" in k[0] or "merge" in k[0])])
PY
tar czf $OUT/c1.tgz -C $OUT c1 gpu.txt; rm -rf $OUT/c1
