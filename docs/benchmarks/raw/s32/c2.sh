#!/usr/bin/env bash
# Session 32, call 2: the kernel tables re-measured on main (no code change): issue 16 §3's long-tail grid
# (`kernel_tail.py --mode check`: 64 shapes, attention alone and with LongFlow's statistic against SDPA), then the
# session-5 targets' shapes K1-K8 (`kernel_decode.py --ab default`: the launcher's default call, attention alone
# and SDPA interleaved over 5 rounds).
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
mkdir -p $OUT/c2
t0=$SECONDS
timeout 400 python benchmarks/kernel_tail.py --mode check --out $OUT/c2 --budget-s 380 > $OUT/c2/kernel_tail_check.log 2>&1
echo "tail check rc $? at $((SECONDS - t0)) s"; tail -5 $OUT/c2/kernel_tail_check.log
timeout $((580 - (SECONDS - t0))) python benchmarks/kernel_decode.py --ab default --shapes K1,K2,K3,K4,K5,K6,K7,K8 --rounds 5 --out $OUT/c2 > $OUT/c2/kernel_decode_ab.log 2>&1
echo "ab rc $? at $((SECONDS - t0)) s"; cat $OUT/c2/kernel_decode_ab.log | tail -20
python - <<'PY'  # each shape's floor as kernel_decode.py's sweep defines it, on this run's copy bandwidth
import json, os
from kvroll.bench.measure import copy_bandwidth
from kernel_decode import Case, SHAPES
bw = copy_bandwidth()
d = json.load(open(os.environ["OUT"] + "/c2/kernel_decode_ab.json"))
for r in d["rows"]:
    case = Case(SHAPES[r["shape"]])
    floor = (2 * case.k.numel() * case.k.element_size() + case.pos.numel() * 4 + 2 * case.q.numel() * case.q.element_size()) / bw * 1e3
    r["floor_ms"], r["bandwidth"] = floor, bw
    print(r["shape"], r["dims"], "floor %.4f" % floor, {k: "%.4f (%.3fx SDPA, %.3fx floor)" % (v, r["over_sdpa"][k], v / floor) for k, v in r["ms"].items()})
json.dump(d, open(os.environ["OUT"] + "/c2/kernel_decode_ab.json", "w"), indent=1)
PY
tar czf $OUT/c2.tgz -C $OUT c2 gpu.txt; rm -rf $OUT/c2
