#!/usr/bin/env bash
# Session 28, call 5: the suite as a user with a GPU would run it, plainly (no -m filter, no interpreter; GPU tests
# included), one pytest per file, 8 at a time: tests/kernels, tests/bench, tests/rollout, tests/policies, after the
# CPU-tensor gating and the new SHAPE_TILES entries. (tests/ray and tests/trainers need packages this image lacks;
# the embedded model is not installed here, so its tests error by design.)
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
t0=$SECONDS
mkdir -p $OUT/plain
ls tests/kernels/test_*.py tests/bench/test_*.py tests/rollout/test_*.py tests/policies/test_*.py | \
  timeout ${PLAIN_S:-480} xargs -P 8 -I{} sh -c 'python -m pytest -q -rfE {} -p no:cacheprovider > $OUT/plain/$(basename {} .py).log 2>&1'
echo "plain $((SECONDS - t0)) s"
grep -h -E "^(FAILED|ERROR) " $OUT/plain/*.log | sed 's/\[.*//; s/ - .*//' | sort | uniq -c
grep -h -E "^(FAILED|ERROR) " $OUT/plain/*.log | grep -v "smollm2' is not installed" | head -20
for f in $OUT/plain/*.log; do echo "$(basename $f .log): $(tail -1 $f)"; done
cd $OUT && tar czf plain_logs.tgz plain && rm -rf plain
