#!/usr/bin/env bash
# (Its sed targets the names of the code it ran on, "_R65, _R4, _R8 = ..."; commit b45c698 renamed them _R65, _R33.)
# Session 28, call 8: the decode kernel's PDL launch at 512 rows again, twice per model in alternating order (plain
# first, then PDL, then both again): Qwen3-4B (its SHAPE_TILES range extended to 64 rows on the device, as c6's
# "chain64"), Qwen3-8B and Llama-3.2-1B at batch 64. c6 / c7: Qwen3-4B +3.6% and Llama +2.6% with the PDL launch,
# Qwen3-8B -0.3%, though 4B's and 8B's attention shapes are the same (8 KV heads, 32 query heads, head_dim 128).
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
F=kvroll/kernels/pdl_gemm.py
sed -i "s/^_R65, _R4, _R8 = (65, 128), (FEW_ROWS + 1, 56)/_R65, _R4, _R8 = (65, 128), (FEW_ROWS + 1, 64)/" $F
eng() { STAGES=engine ENGINE_TIMEOUT=150 bash benchmarks/run_gpu.sh --architecture $1 --policies longflow --budgets 1024 --batch_sizes 64 --output_lengths 4096 --steady_steps 512 --full_steps 32 --hf_generate false > $OUT/engine.log 2>&1; python -c "
import json, sys; r = json.loads(open('$OUT/bench/measurements.jsonl').readline())
print('$1', '$2', round(r['steady_step_ms'], 3), round(r['floor_step_ms'], 3), round(r['step_over_floor'], 4), r['kernels_per_step'])"; rm -rf $OUT/bench; }
for arch in ${ARCHS:-qwen3-4b qwen3-8b llama-3.2-1b}; do
  for round in 1 2; do
    sed -i "s/^ATTN_PDL = True /ATTN_PDL = False /" $F; eng $arch plain
    sed -i "s/^ATTN_PDL = False /ATTN_PDL = True /" $F; eng $arch pdl
  done
done | tee $OUT/rows.txt
grep -q Traceback $OUT/engine.log && tail -12 $OUT/engine.log
git checkout -q $F 2>/dev/null || true
