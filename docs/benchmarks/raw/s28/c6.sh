#!/usr/bin/env bash
# (Its sed targets the names of the code it ran on, "_R65, _R4, _R8 = ..."; commit b45c698 renamed them _R65, _R33.)
# Session 28, call 6: Qwen3-4B at batch 64 (session 27's lead). Its SHAPE_TILES range ends at 56 rows because the
# chain at 64 rows lost 0.7%; at 64 slots x 8 KV heads (512 rows) the decode kernel also turns into a PDL launch
# (attention_pdl). Three runs of LongFlow: the committed code (cuBLAS at 64 rows), the range extended to 64 with
# ATTN_PDL on, and extended with ATTN_PDL off.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
F=kvroll/kernels/pdl_gemm.py
cp $F $F.orig
eng() { STAGES=engine ENGINE_TIMEOUT=170 bash benchmarks/run_gpu.sh --architecture qwen3-4b --policies longflow --budgets 1024 --batch_sizes ${B:-64} --output_lengths 4096 --steady_steps 512 --full_steps 32 --hf_generate false > $OUT/engine_$1.log 2>&1; cat $OUT/bench/measurements.jsonl >> $OUT/rows.jsonl; rm -rf $OUT/bench; }
for variant in committed chain64 chain64_noattnpdl; do
  cp $F.orig $F
  [[ $variant != committed ]] && sed -i "s/^_R65, _R4, _R8 = (65, 128), (FEW_ROWS + 1, 56)/_R65, _R4, _R8 = (65, 128), (FEW_ROWS + 1, 64)/" $F
  [[ $variant == chain64_noattnpdl ]] && sed -i "s/^ATTN_PDL = True /ATTN_PDL = False /" $F
  grep -c "(FEW_ROWS + 1, 64), (FEW_ROWS + 1, 64)\|^ATTN_PDL = False" $F
  t0=$SECONDS; eng $variant; echo "$variant $((SECONDS - t0)) s"
done
cp $F.orig $F; rm $F.orig
python - <<'PY'
import json, os
for line, tag in zip(open(os.environ["OUT"] + "/rows.jsonl"), ("committed", "chain64", "chain64_noattnpdl")):
    r = json.loads(line)
    print(tag, r["batch"], round(r["steady_step_ms"], 3), round(r["floor_step_ms"], 3), round(r["step_over_floor"], 4),
          r["kernels_per_step"], [(k[0][:22], k[1], round(k[2], 1)) for k in r["top_kernels"][:6]])
PY
for f in $(grep -l "Traceback\|Error" $OUT/engine_*.log 2>/dev/null); do echo "== $f"; tail -12 $f; done
rm -f $OUT/engine_*.log
