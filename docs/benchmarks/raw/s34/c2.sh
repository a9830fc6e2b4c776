#!/usr/bin/env bash
# Session 34, call 2: the inverse-CDF sampler's mass kernel shapes swept (PART:UNROLL:WARPS:CHUNKS_PER_SM), the best
# by total time over 65-352 rows written into kvroll/kernels/sample.py, the sampler's GPU tests on it, then the engine
# (LongFlow at batches 256 and 128, Hard-KV at 256) with it ("icdf") against Gumbel-max ("gumbel"), one run per arm.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
mkdir -p $OUT/c2
t0=$SECONDS
if git rev-parse HEAD >/dev/null 2>&1; then
  git diff --name-only HEAD | grep -v -e kvroll/kernels/sample.py -e tests/kernels/test_sample.py -e benchmarks/sample_icdf_ab.py | xargs -r git checkout HEAD --
fi
SHAPES=1024:1:4:16,1024:2:4:16,1024:4:4:16,1024:1:8:16,1024:2:8:16,1024:4:8:16,1024:1:4:8,1024:2:4:8,1024:4:4:8,1024:2:8:8,1024:4:8:8,2048:1:4:16,2048:2:4:16,2048:1:8:16,2048:2:8:16,2048:4:8:16,2048:1:4:8,2048:2:8:8,512:2:4:16,512:4:4:16,512:8:4:16,512:4:4:8,512:8:8:8,1024:1:4:32,1024:2:4:32
timeout 200 python benchmarks/sample_icdf_ab.py --out $OUT/c2 --rows 65,128,256,352 --sweep $SHAPES > $OUT/c2/sample_sweep.log 2>&1
echo "sweep rc $? at $((SECONDS - t0)) s"; tail -14 $OUT/c2/sample_sweep.log
BEST=$(grep '^best ' $OUT/c2/sample_sweep.log | awk '{print $2}')
F=kvroll/kernels/sample.py
if [[ -n "$BEST" ]]; then
  IFS=: read P U W C <<< "$BEST"
  sed -i "s/^ICDF_PART, ICDF_UNROLL, ICDF_WARPS, ICDF_CHUNKS_PER_SM = .*  #/ICDF_PART, ICDF_UNROLL, ICDF_WARPS, ICDF_CHUNKS_PER_SM = $P, $U, $W, $C  #/" $F
fi
grep -n "^ICDF_PART" $F
timeout 150 python -m pytest -q -m gpu tests/kernels/test_sample.py tests/kernels/test_head_sample.py -p no:cacheprovider > $OUT/c2/gpu_tests.log 2>&1
echo "tests rc $? at $((SECONDS - t0)) s"; tail -3 $OUT/c2/gpu_tests.log
eng() { STAGES=engine ENGINE_TIMEOUT=110 bash benchmarks/run_gpu.sh --architecture qwen3-1.7b --policies $1 --budgets 1024 --batch_sizes $2 --output_lengths 4096 --steady_steps 512 --full_steps 32 --hf_generate false > $OUT/c2/engine_$1_$2_$3.log 2>&1; sed "s/^{/{\"arm\": \"$3\", /" $OUT/bench/measurements.jsonl >> $OUT/c2/engine.jsonl; rm -rf $OUT/bench; }
for spec in "longflow 256" "longflow 128" "hardkv 256"; do
  set -- $spec
  if (( SECONDS - t0 > 470 )); then echo "skip $spec (time)"; continue; fi
  sed -i "s/^INVERSE_CDF = False/INVERSE_CDF = True/" $F; eng $1 $2 icdf
  sed -i "s/^INVERSE_CDF = True/INVERSE_CDF = False/" $F; eng $1 $2 gumbel
  sed -i "s/^INVERSE_CDF = False/INVERSE_CDF = True/" $F
  echo "$spec at $((SECONDS - t0)) s"
done
python - <<'PY'
import json, os
p = os.environ["OUT"] + "/c2/engine.jsonl"
for line in (open(p) if os.path.exists(p) else []):
    r = json.loads(line)
    print(r["arm"], r["policy"], r["batch"], round(r["steady_step_ms"], 4), round(r["floor_step_ms"], 4), round(r["step_over_floor"], 4), r["kernels_per_step"],
          [(k[0][:24], k[1], round(k[2], 1)) for k in r["top_kernels"] if "mass" in k[0] or "pick" in k[0] or "chunk" in k[0] or "merge" in k[0]])
PY
tar czf $OUT/c2.tgz -C $OUT c2 gpu.txt; rm -rf $OUT/c2
