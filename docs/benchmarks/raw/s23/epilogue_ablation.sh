#!/usr/bin/env bash
# Session 23: where the statistic's finishing pass spends its time at the engine's batches. Each ablation edits
# the decode kernel (wrong results, timing only; NOCHECK=1 skips the probe's reference check), runs
# benchmarks/stat_epilogue_probe.py's default call beside attention alone, and restores the file.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
F=kvroll/kernels/decode_attention.py
cp $F /tmp/da_orig.py
SHAPES=${SHAPES:-64x16x8x128x1024,128x16x8x128x1024,1x16x8x128x2048,8x32x8x64x2048}
ablate() {  # name, python replacement code on s
  cp /tmp/da_orig.py $F
  python - "$2" <<'PY'
import sys
p = "kvroll/kernels/decode_attention.py"
s = open(p).read()
exec(sys.argv[1])
open(p, "w").write(s)
PY
  echo "== $1"
  mkdir -p $OUT/$1
  NOCHECK=1 SHAPES=$SHAPES VARIANTS=default timeout 150 python benchmarks/stat_epilogue_probe.py --out $OUT/$1 2>&1 | grep -v Warning | cut -c1-120
}
ablate none 'pass'
ablate no_vn_pos 's = s.replace("p = tl.load(pos_ptr + s * stride_ps + h0 * stride_ps_h + offs, mask=in_range & (offs < len0),\n                            other=-1)", "p = offs"); s = s.replace("vn = tl.load(vn_ptr + s * stride_ns + h * stride_nh + offs, mask=live, other=0.0)", "vn = 1.0")'
ablate no_t_load 's = s.replace("t = tl.load(t_row + offs_r[:, None] * capacity + offs[None, :], mask=r_mask[:, None] & live[None, :],\n                            other=float(\"-inf\"), cache_modifier=\".cg\")", "t = tl.zeros([GROUP_P2, BLOCK_E], tl.float32) + offs[None, :].to(tl.float32)")'
ablate no_t_store 's = s.replace("tl.store(t_ptrs, t, mask=t_mask, eviction_policy=T_EVICT)", "pass"); s = s.replace("tl.store(t_ptrs, qk, mask=t_mask, eviction_policy=T_EVICT)", "pass"); s = s.replace("_st_global_f32(t_ptrs, qk, t_mask, T_ASM == 2)", "pass")'
ablate no_finish 's = s.replace("            if FINISH == 1:  # this program owns", "            if FINISH == 99:  # this program owns")'
ablate no_store_evict 's = s.replace("            if ARGMIN:\n                _store_evict(evict_ptr, s, h0, idx, len_ptr, num_kv_heads, capacity, HEADS, EVICT_WRITE)", "            pass")'
cp /tmp/da_orig.py $F
