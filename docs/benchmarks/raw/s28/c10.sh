#!/usr/bin/env bash
# Session 28, call 10 (run as one command line, kept here as the record): the chain's test file plainly on the H100
# after c9's `-m gpu` run of it with test_decode_attention.py hit its 250 s limit before its summary.
export PYTHONPATH=$PWD; timeout 200 python -m pytest -q -rfE tests/kernels/test_pdl_gemm.py -p no:cacheprovider 2>&1 | tail -4 | tee $OUT/h100_c10_test_pdl_gemm.log
