"""GRPO with ``use_kvroll=True`` under DeepSpeed ZeRO-3 (one process): the colocated engine gathers the partitioned
weights, and after every optimizer step they equal the trainer's gathered weights (see ``zero3_worker.py``); with a
LoRA ``peft_config`` they equal the merged weights TRL would send vLLM (``zero3_lora_worker.py``)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.gpu
@pytest.mark.parametrize("worker, done", [("zero3_worker.py", "ZERO3 OK"), ("zero3_lora_worker.py", "ZERO3 LORA OK")])
def test_grpo_zero3_engine_weights_follow_the_gathered_trainer_weights(tmp_path, worker, done):
    pytest.importorskip("deepspeed")
    if "lora" in worker:
        pytest.importorskip("peft")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")])}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):  # the worker sets world size 1
        env.pop(key, None)
    # A subprocess: DeepSpeed's ZeRO-3 config and process group are process-global state.
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name(worker)), str(tmp_path), "--device", "cuda"],
                          env=env, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    assert done in output, output[-6000:]
