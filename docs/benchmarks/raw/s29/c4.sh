#!/usr/bin/env bash
# Session 29, call 4: c2 again for the five files it left unfinished or in error: gguf staged beside the embedded model
# this time (transformers reads its GGUF file with it; c2 lacked it), 5 files at a time, no peft.
FILES="tests/rollout/test_engine.py tests/policies/test_fidelity_eval.py tests/kernels/test_decode_attention.py
       tests/kernels/test_head_sample.py tests/rollout/test_schedule.py" PLAIN_S=560 bash docs/benchmarks/raw/s29/c2.sh
