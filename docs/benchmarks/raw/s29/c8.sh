#!/usr/bin/env bash
# Session 29, call 8 (with late_signal.patch applied; not taken, the code reverted): the chained decode kernel
# signals the o projection late (ATTN_SIGNAL_LATE, new: once each program has stored its row) and is a PDL launch in
# every chained layer, against session 28's early signal and its rule by rows and query group (the flag off, "old"). The chain's GPU tests first (PDL against plain launches, bit
# for bit), then LongFlow new / old: Qwen3-1.7B at batches 64, 16 and 32 (512 / 128 / 256 rows: the early signal's
# PDL launch had lost 6.1% and 8.2% at 128 and 256 rows in session 24), Qwen3-4B and Llama-3.2-1B at 64.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
t0=$SECONDS
timeout 150 python -m pytest -q -rfE -m gpu tests/kernels/test_pdl_gemm.py -p no:cacheprovider 2>&1 | tail -4 > $OUT/gpu_tests.log; tail -1 $OUT/gpu_tests.log
echo "tests $((SECONDS - t0)) s"
ab() { FLAG=ATTN_SIGNAL_LATE FLAG_FILE=kvroll/kernels/pdl_gemm.py KERNELS="decode|gemm" ENGINE_TIMEOUT=150 "$@" bash docs/benchmarks/raw/s23/calls.sh; }
ab env ROWS="longflow:64 longflow:16 longflow:32"
mv $OUT/new.jsonl $OUT/qwen3-1.7b_new.jsonl; mv $OUT/old.jsonl $OUT/qwen3-1.7b_old.jsonl
ab env ARCH=qwen3-4b ROWS="longflow:64"
mv $OUT/new.jsonl $OUT/qwen3-4b_new.jsonl; mv $OUT/old.jsonl $OUT/qwen3-4b_old.jsonl
ab env ARCH=llama-3.2-1b ROWS="longflow:64"
mv $OUT/new.jsonl $OUT/llama_new.jsonl; mv $OUT/old.jsonl $OUT/llama_old.jsonl
rm -f $OUT/engine_*.log
