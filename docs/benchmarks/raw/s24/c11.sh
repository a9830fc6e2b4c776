#!/usr/bin/env bash
# Session 24, call 11: the five policies at batch 64 on the final code (one run each, no A/B).
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
ROWS="longflow,snapkv,rkv,lagkv,hardkv:64" KERNELS="decode|gemm" bash docs/benchmarks/raw/s23/calls.sh | grep -v "^ *$" | cut -c1-300
rm -f $OUT/engine_*.log
