#!/usr/bin/env bash
# Session 38, call 3 (nvidia-h100-x1): the statistic's finishing pass in the decode kernel, as a second kernel, or
# as a second kernel on a side stream beside the projections (benchmarks/stat_side_stream_probe.py), LongFlow's and
# Hard-KV's calls at 64 and 128 slots over 28 layers. Not taken: the probe and decode_attention's merge_stream are in
# stat_side_stream.patch (apply it to 2ef605e to rerun this call).
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
mkdir -p $OUT/c3/s64 $OUT/c3/s128
t0=$SECONDS
timeout 250 python benchmarks/stat_side_stream_probe.py --out $OUT/c3/s64 --slots 64 > $OUT/c3/s64.log 2>&1
echo "64 rc $? at $((SECONDS - t0)) s"; tail -4 $OUT/c3/s64.log
timeout 250 python benchmarks/stat_side_stream_probe.py --out $OUT/c3/s128 --slots 128 > $OUT/c3/s128.log 2>&1
echo "128 rc $? at $((SECONDS - t0)) s"; tail -4 $OUT/c3/s128.log
tar czf $OUT/c3.tgz -C $OUT c3 gpu.txt; rm -rf $OUT/c3
