#!/usr/bin/env bash
# Session 31, call 3: benchmarks/gemm_tail_probe.py (the chain's GEMMs' per-program timestamps), then session 30's
# two untested leads, each an edit of one rule against the committed rule, LongFlow
# on Qwen3-1.7B, one engine run per arm.
#   late: the rotary signals the decode kernel at each program's end everywhere in the chain (committed: only where
#         session 28's early signal lost), at batches 1 and 8 (8 and 64 rows) and 128 (1,024 rows);
#   early: the chained GEMM signals right after its wait up to 128 rows (committed: 64), at batches 80 and 96.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
t0=$SECONDS
F=kvroll/kernels/pdl_gemm.py
cp $F /tmp/pdl_gemm.orig
mkdir -p $OUT/ab
timeout 120 python benchmarks/gemm_tail_probe.py --rows 1,8,64 --out $OUT/ab 2>&1 | tail -14
echo "probe $((SECONDS - t0)) s"
eng() { STAGES=engine ENGINE_TIMEOUT=110 bash benchmarks/run_gpu.sh --architecture qwen3-1.7b --policies longflow --budgets 1024 --batch_sizes $1 --output_lengths 4096 --steady_steps 512 --full_steps 32 --hf_generate false > $OUT/ab/engine_$2_$1_$3.log 2>&1; sed "s/^{/{\"arm\": \"$3\", \"variant\": \"$2\", /" $OUT/bench/measurements.jsonl >> $OUT/ab/$2_$1.jsonl; rm -rf $OUT/bench; }
edit() { cp /tmp/pdl_gemm.orig $F; case $1 in
  late) sed -i "s/return ATTN_PDL and ROTARY_LATE and chain_rows(slots) and not early_signal(slots, kv_heads, group)/return ATTN_PDL and ROTARY_LATE and chain_rows(slots)/" $F;;
  early) sed -i "s/return GEMM_SIGNAL_EARLY and rows <= WIDTH_ROWS/return GEMM_SIGNAL_EARLY and rows <= MAX_ROWS/" $F;;
esac; git diff --stat $F | tail -1; }
for spec in "late 8" "late 1" "late 128" "early 96" "early 80"; do
  set -- $spec
  if (( SECONDS > 500 )); then echo "skip $spec (time)"; continue; fi
  edit $1; eng $2 $1 new; edit none; eng $2 $1 old; echo "$spec $((SECONDS - t0)) s"
done
cp /tmp/pdl_gemm.orig $F
python - <<'PY'
import json, glob, os
for f in sorted(glob.glob(os.environ["OUT"] + "/ab/*.jsonl")):
    for line in open(f):
        r = json.loads(line)
        print(r["variant"], r["arm"], r["policy"], r["batch"], round(r["steady_step_ms"], 3), round(r["step_over_floor"], 4), r["kernels_per_step"])
PY
tar czf $OUT/c3.tgz -C $OUT ab; rm -rf $OUT/ab
