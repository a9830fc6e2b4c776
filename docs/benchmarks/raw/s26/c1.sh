#!/usr/bin/env bash
# Session 26, call 1: SiLU * up in the chained gate_up GEMM's epilogue. The chain's GPU tests (the epilogue bit for
# bit against silu_mul of the GEMM's output, the engine's PDL against plain launches), the MLP chain probe (with
# and without the epilogue and the pre-wait weight tile), then the engine A/B (SILU_EPILOGUE = False the old).
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
timeout 150 python -m pytest -q -m gpu tests/kernels/test_pdl_gemm.py -p no:cacheprovider 2>&1 | tail -15 > $OUT/gpu_tests.log; tail -3 $OUT/gpu_tests.log
timeout 100 python benchmarks/mlp_chain_probe.py --rows 1,8,16,32,64 --out $OUT/mlp_chain_probe.json 2>&1 | tail -8 | cut -c1-700
ROWS="longflow:64 longflow:8" FLAG=SILU_EPILOGUE FLAG_FILE=kvroll/kernels/pdl_gemm.py KERNELS="gemm|silu|decode" ENGINE_TIMEOUT=150 bash docs/benchmarks/raw/s23/calls.sh
rm -f $OUT/engine_*.log
