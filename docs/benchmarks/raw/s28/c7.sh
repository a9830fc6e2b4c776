#!/usr/bin/env bash
# Session 28, call 7: c6 found Qwen3-4B's chain at 64 rows 2.5% faster than cuBLAS with the decode kernel a plain
# launch, 1.0% slower with it a PDL launch (attention_pdl: at >= 512 (slot, KV head) rows). The same A/B
# (ATTN_PDL = False the old) where the chain runs with >= 512 rows: LongFlow on Qwen3-1.7B at batches 64 and 128,
# Qwen3-8B at 64, Qwen3-0.6B and Llama-3.2-1B at 64 and 128.
set -uo pipefail
for spec in ${ARCH_ROWS:-qwen3-1.7b:longflow:64 qwen3-1.7b:longflow:128 qwen3-8b:longflow:64 qwen3-0.6b:longflow:64 qwen3-0.6b:longflow:128 llama-3.2-1b:longflow:64 llama-3.2-1b:longflow:128}; do
  ARCH=${spec%%:*} ROWS=${spec#*:} FLAG=ATTN_PDL FLAG_FILE=kvroll/kernels/pdl_gemm.py KERNELS="decode|gemm" \
    ENGINE_TIMEOUT=${ENGINE_TIMEOUT:-120} bash docs/benchmarks/raw/s23/calls.sh | grep -v "^new\|^old"
  echo ${spec%%:*} >> $OUT/archs.txt; cat $OUT/new.jsonl >> $OUT/new_all.jsonl; cat $OUT/old.jsonl >> $OUT/old_all.jsonl; rm -f $OUT/new.jsonl $OUT/old.jsonl
done
python - <<'PY'
import json, os
out = os.environ["OUT"]
for arch, n, o in zip(open(out + "/archs.txt"), open(out + "/new_all.jsonl"), open(out + "/old_all.jsonl")):
    n, o = json.loads(n), json.loads(o)
    dec = lambda r: round(sum(k[2] for k in r["top_kernels"] if "decode" in k[0]))
    gemm = lambda r: round(sum(k[2] for k in r["top_kernels"] if "gemm" in k[0]))
    print(arch.strip(), n["batch"], "attn pdl", round(n["steady_step_ms"], 3),
          "plain", round(o["steady_step_ms"], 3), f'{100 * (n["steady_step_ms"] / o["steady_step_ms"] - 1):+.2f}%',
          round(n["step_over_floor"], 4), round(o["step_over_floor"], 4), "decode us", dec(n), dec(o), "gemm us", gemm(n), gemm(o))
PY
for f in $(grep -l "Traceback\|Error" $OUT/engine_*.log 2>/dev/null); do echo "== $f"; tail -12 $f; done
rm -f $OUT/engine_*.log
