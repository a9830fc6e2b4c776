#!/usr/bin/env bash
# Session 29, call 9 (with rotary_late_signal.patch applied; the code reverted after it: the session's device time
# ran out at 321 s, in Llama-3.2-1B's old run, and Qwen3-4B's rows did not come back: the call returns 8 files at
# most, and the engine's report took the places; tar them next time). The rotary kernel lets the decode kernel launch at each program's end (ROTARY_SIGNAL_LATE,
# new), the decode kernel a PDL launch in every chained layer, against the signal at the rotary's start and session
# 28's rule (the flag off, "old"). c7's timeline: as a PDL launch Qwen3-4B's decode kernel took 108.9 us a layer
# against 98.9 plain; c8: its o projection launched late changed nothing, so its own early start (its programs placed
# beside the rotary's) is the suspect. The chain's GPU tests, then LongFlow new / old: Qwen3-1.7B at 16 and 64,
# Qwen3-4B and Llama-3.2-1B at 64.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
t0=$SECONDS
timeout 150 python -m pytest -q -rfE -m gpu tests/kernels/test_pdl_gemm.py -p no:cacheprovider 2>&1 | tail -4 > $OUT/gpu_tests.log; tail -1 $OUT/gpu_tests.log
echo "tests $((SECONDS - t0)) s"
ab() { FLAG=ROTARY_SIGNAL_LATE FLAG_FILE=kvroll/kernels/pdl_gemm.py KERNELS="decode|rotary" ENGINE_TIMEOUT=150 "$@" bash docs/benchmarks/raw/s23/calls.sh; }
ab env ROWS="longflow:16"
cat $OUT/new.jsonl $OUT/old.jsonl > $OUT/qwen3-1.7b_b16.jsonl; rm $OUT/new.jsonl $OUT/old.jsonl
ab env ARCH=qwen3-4b ROWS="longflow:64"
cat $OUT/new.jsonl $OUT/old.jsonl > $OUT/qwen3-4b_b64.jsonl; rm $OUT/new.jsonl $OUT/old.jsonl
ab env ROWS="longflow:64"
cat $OUT/new.jsonl $OUT/old.jsonl > $OUT/qwen3-1.7b_b64.jsonl; rm $OUT/new.jsonl $OUT/old.jsonl
ab env ARCH=llama-3.2-1b ROWS="longflow:64"
cat $OUT/new.jsonl $OUT/old.jsonl > $OUT/llama_b64.jsonl; rm $OUT/new.jsonl $OUT/old.jsonl
rm -f $OUT/engine_*.log
