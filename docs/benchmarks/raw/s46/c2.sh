#!/usr/bin/env bash
# Session 46, device call 2 (H200): the fidelity tables scored to each reference's EOS (the default since session
# 45), budgets 64 / 128 / 256 side by side as in session 14's run; call 1 copied .devstage/fid1 to /root/devstage.
export KVROLL_DEVSTAGE=.devstage/fid0 && source benchmarks/device_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
P=full,hardkv,snapkv,rkv,longflow,lagkv,streaming,h2o,random
for b in 64 128 256; do
  timeout 570 python -m kvroll.cli eval fidelity --model smollm2 --policies $P --budgets $b --max-new-tokens 1024 \
    --device cuda --out "$OUT/b$b" > "$OUT/b$b.log" 2>&1 &
done
wait
tail -n 5 "$OUT"/b*.log
