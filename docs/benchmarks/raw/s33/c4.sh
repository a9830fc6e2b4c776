#!/usr/bin/env bash
# Session 33, call 4: Hard-KV's votes added on the live slots only (the running sum's read and write past a row's
# live length skipped: the statistic is 0 there). "new" (live) against "old" (every slot up to the capacity), Hard-KV
# at batches 64 and 256 (one run per arm), after the decode kernel's GPU tests of the running sum.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
mkdir -p $OUT/c4
t0=$SECONDS
if git rev-parse HEAD >/dev/null 2>&1; then
  git diff --name-only HEAD | grep -v -e kvroll/kernels/decode_attention.py | xargs -r git checkout HEAD --
fi
F=kvroll/kernels/decode_attention.py
NEW='mask=live, other=0.0) + head_score, mask=live)'
OLD='mask=in_range, other=0.0) + head_score, mask=in_range)'
grep -c "$NEW" $F
timeout 120 python -m pytest -q -m gpu tests/kernels/test_decode_attention.py -k "stat_into or votes or hardkv" -p no:cacheprovider > $OUT/c4/gpu_tests.log 2>&1
echo "tests rc $? at $((SECONDS - t0)) s"; tail -2 $OUT/c4/gpu_tests.log
eng() { STAGES=engine ENGINE_TIMEOUT=100 bash benchmarks/run_gpu.sh --architecture qwen3-1.7b --policies $1 --budgets 1024 --batch_sizes $2 --output_lengths 4096 --steady_steps 512 --full_steps 32 --hf_generate false > $OUT/c4/engine_$1_$2_$3.log 2>&1; sed "s/^{/{\"arm\": \"$3\", /" $OUT/bench/measurements.jsonl >> $OUT/c4/engine.jsonl; rm -rf $OUT/bench; }
for spec in "hardkv 64" "hardkv 256"; do
  set -- $spec
  if (( SECONDS - t0 > 400 )); then echo "skip $spec (time)"; continue; fi
  sed -i "s/$OLD/$NEW/" $F; eng $1 $2 new
  sed -i "s/$NEW/$OLD/" $F; eng $1 $2 old
  sed -i "s/$OLD/$NEW/" $F
  echo "$spec at $((SECONDS - t0)) s"
done
python - <<'PY'
import json, os
p = os.environ["OUT"] + "/c4/engine.jsonl"
for line in (open(p) if os.path.exists(p) else []):
    r = json.loads(line)
    print(r["arm"], r["policy"], r["batch"], round(r["steady_step_ms"], 4), round(r["floor_step_ms"], 4), round(r["step_over_floor"], 4), r["kernels_per_step"],
          [(k[0][:24], k[1], round(k[2], 1)) for k in r["top_kernels"] if "decode" in k[0].lower()])
PY
tar czf $OUT/c4.tgz -C $OUT c4 gpu.txt; rm -rf $OUT/c4
