#!/usr/bin/env bash
# Stage what benchmarks/run_fidelity_gpu.sh needs on the GPU device machine into .devstage/fid0 and .devstage/fid1
# (gitignored; other stagings in .devstage/ are left alone): TRL and its data packages, gguf, DeepSpeed (built here
# as a pure-Python wheel; TRL and transformers import it), and the embedded model's GGUF split in two (a call carries
# at most 64 MiB).
#
#   bash benchmarks/stage_fidelity.sh
#   device call 1 (carry .devstage/fid1):  mkdir -p /root/devstage && cp -r .devstage/fid1/. /root/devstage/
#   device call 2 (carry .devstage/fid0, within 30 s of call 1, same warm machine):
#       export KVROLL_DEVSTAGE=.devstage/fid0 && source benchmarks/device_env.sh \
#         && bash benchmarks/run_fidelity_gpu.sh grpo
#   device call 3 (same lease; nothing to carry):
#       source benchmarks/device_env.sh && bash benchmarks/run_fidelity_gpu.sh ppo
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
out=.devstage
rm -rf "$out/fid0" "$out/fid1"
mkdir -p "$out/fid0" "$out/fid1"
# The versions the earlier device runs used (benchmarks/stage_device.sh); the device image has the rest.
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$out/fid0" trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 gguf==0.19.0 hjson==3.1.0 \
  pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5
DS_BUILD_OPS=0 $PY -m pip wheel -q --no-deps --no-build-isolation "deepspeed==0.19.8" -w "$out/fid0"
cat > "$out/fid0/install.sh" <<'EOF'
#!/usr/bin/env bash
# On the device: join the GGUF's chunks (the other one was copied to /root/devstage by an earlier call), install the
# wheels into /tmp/site.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p /root/devstage
cp "$here"/*.part-* /root/devstage/
[ -f /root/devstage/SmolLM2-135M-Instruct.Q4_1.gguf.part-00 ] \
  || { echo "install.sh: the GGUF's first chunk is missing: copy .devstage/fid1 to /root/devstage first" >&2; exit 1; }
cat /root/devstage/SmolLM2-135M-Instruct.Q4_1.gguf.part-* > "$here/SmolLM2-135M-Instruct.Q4_1.gguf"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$here"/*.whl
EOF
gguf=$($PY -c "from kvroll.rollout.model import smollm2_gguf_path; print(smollm2_gguf_path())")
split -b $((50*1024*1024)) -d -a 2 "$gguf" "$out/SmolLM2-135M-Instruct.Q4_1.gguf.part-"
mv "$out/SmolLM2-135M-Instruct.Q4_1.gguf.part-00" "$out/fid1/"
mv "$out/SmolLM2-135M-Instruct.Q4_1.gguf.part-01" "$out/fid0/"
du -sh "$out/fid0" "$out/fid1"
