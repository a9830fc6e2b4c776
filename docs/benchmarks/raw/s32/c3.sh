#!/usr/bin/env bash
# Session 32, call 3: the merge kernel's programs apart and the one-load merge (MERGE_APART, MERGE_ONE_PASS).
#  1. the decode kernel's GPU tests (the new test: the switches against the joint, two-pass merge bit for bit);
#  2. benchmarks/merge_apart_ab.py: the long tail's grid, both switches on / off / the one-pass merge alone,
#     attention alone with and without it, SDPA, interleaved;
#  3. the engine, both switches on ("new") against off ("old"), at batches 1 and 8 (LongFlow, Hard-KV, R-KV).
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
mkdir -p $OUT/c3
t0=$SECONDS
# only the decode kernel's change travels: other files another engineer was editing go back to HEAD
if git rev-parse HEAD >/dev/null 2>&1; then
  git diff --name-only HEAD | grep -v -e kvroll/kernels/decode_attention.py -e tests/kernels/test_decode_attention.py | xargs -r git checkout HEAD --
  git status --short | head; git rev-parse --short HEAD
else echo "no git here"; fi
timeout 200 python -m pytest -q -m gpu tests/kernels/test_decode_attention.py -p no:cacheprovider > $OUT/c3/gpu_tests.log 2>&1
echo "tests rc $? at $((SECONDS - t0)) s"; tail -3 $OUT/c3/gpu_tests.log
timeout 260 python benchmarks/merge_apart_ab.py --out $OUT/c3 --rounds 3 --budget-s 230 > $OUT/c3/merge_apart_ab.log 2>&1
echo "probe rc $? at $((SECONDS - t0)) s"; cat $OUT/c3/merge_apart_ab.log
F=kvroll/kernels/decode_attention.py
eng() { STAGES=engine ENGINE_TIMEOUT=90 bash benchmarks/run_gpu.sh --architecture qwen3-1.7b --policies $1 --budgets 1024 --batch_sizes $2 --output_lengths 4096 --steady_steps 512 --full_steps 32 --hf_generate false > $OUT/c3/engine_$1_$2_$3.log 2>&1; sed "s/^{/{\"arm\": \"$3\", /" $OUT/bench/measurements.jsonl >> $OUT/c3/engine.jsonl; rm -rf $OUT/bench; }
for spec in "hardkv 1" "longflow 1" "rkv 1" "hardkv 8" "longflow 8"; do
  set -- $spec
  if (( SECONDS - t0 > 520 )); then echo "skip $spec (time)"; continue; fi
  sed -i "s/^MERGE_APART = False /MERGE_APART = True /; s/^MERGE_ONE_PASS = False /MERGE_ONE_PASS = True /" $F; eng $1 $2 new
  sed -i "s/^MERGE_APART = True /MERGE_APART = False /; s/^MERGE_ONE_PASS = True /MERGE_ONE_PASS = False /" $F; eng $1 $2 old
  echo "$spec at $((SECONDS - t0)) s"
done
sed -i "s/^MERGE_APART = False /MERGE_APART = True /; s/^MERGE_ONE_PASS = False /MERGE_ONE_PASS = True /" $F
python - <<'PY'
import json, os
for line in open(os.environ["OUT"] + "/c3/engine.jsonl"):
    r = json.loads(line)
    print(r["arm"], r["policy"], r["batch"], round(r["steady_step_ms"], 4), round(r["step_over_floor"], 4), r["kernels_per_step"],
          [(k[0][:24], k[1], round(k[2], 1)) for k in r["top_kernels"] if "decode" in k[0].lower()])
PY
tar czf $OUT/c3.tgz -C $OUT c3 gpu.txt; rm -rf $OUT/c3
