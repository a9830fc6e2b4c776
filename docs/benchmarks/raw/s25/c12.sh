#!/usr/bin/env bash
# Session 25, call 12 (a lead for the next session): the chain's GEMM tiles at Qwen3-4B's projections (8 and 64 rows)
# and Qwen3-1.7B's (64) against cuBLAS, and Qwen3-4B's engine A/B at batch 8 with its widths in the chain (on the
# device only).
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
timeout 200 python benchmarks/chain_tiles_probe.py --model qwen3-4b --rows 8,64 --out $OUT/chain_tiles_4b.json 2>&1 | cut -c1-600
timeout 80 python benchmarks/chain_tiles_probe.py --model qwen3-1.7b --rows 64 --out $OUT/chain_tiles_1.7b.json 2>&1 | cut -c1-600
F=kvroll/kernels/pdl_gemm.py
sed -i "s/^CHAIN_WIDTHS = .*/CHAIN_WIDTHS = {1: (1024, 2048, 2560), 2: (2048, 3072, 4096, 6144, 8192, 9728)}/" $F
eng() { STAGES=engine ENGINE_TIMEOUT=150 bash benchmarks/run_gpu.sh --architecture qwen3-4b --policies longflow --budgets 1024 --batch_sizes 8 --output_lengths 4096 --steady_steps 512 --full_steps 32 --hf_generate false > $OUT/engine_$1.log 2>&1; cat $OUT/bench/measurements.jsonl >> $OUT/$1.jsonl; rm -rf $OUT/bench; }
eng new; sed -i "s/^PDL_CHAIN = True /PDL_CHAIN = False /" $F; eng old
python -c "
import json, os
for t in ('new', 'old'):
    for l in open(os.environ['OUT'] + f'/{t}.jsonl'):
        r = json.loads(l); print(t, 'qwen3-4b', r['policy'], r['batch'], round(r['steady_step_ms'], 3), round(r['step_over_floor'], 4))
"
rm -f $OUT/engine_*.log
