"""Set-up shared by the one-process DeepSpeed ZeRO-3 workers (``zero3_worker.py``, ``zero3_lora_worker.py``,
``ppo_zero3_worker.py``; ``ray_zero3_worker.py`` takes ``zero3_config``).

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the workers run as scripts, not as a package
    from zero3_common import build_trainer, grpo_config, run_worker  # noqa: E402  (sets the environment)

Importing it sets the distributed environment ``torchrun`` would give a single process (MASTER_ADDR/PORT, RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE) where not already present, so it comes before any kvroll or DeepSpeed
import. The workers are subprocesses because DeepSpeed's ZeRO-3 config and process group are process-global.
"""
from __future__ import annotations

import argparse
import os
import socket


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1",
                   "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}.items():
    os.environ.setdefault(key, value)

from tiny_model import chat_dataset, length_reward, tiny_llama, tokenizer  # noqa: E402

MAX_COMPLETION = 16  # the GRPO workers' max_completion_length


def zero3_config() -> dict:
    """ZeRO-3 without offload; every parameter partitioned (threshold 0) so every sync must gather."""
    return {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                  "stage3_gather_16bit_weights_on_model_save": False},
            "bf16": {"enabled": "auto"}, "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "train_batch_size": "auto", "gradient_clipping": "auto"}


def trainer_args(out_dir: str, device: str) -> dict:
    """The config fields every one-process worker shares: 2 steps of a longflow engine (budget 16) under ZeRO-3."""
    on_gpu = device == "cuda"
    return dict(output_dir=out_dir, use_kvroll=True, kvroll_policy="longflow", kvroll_budget=16, max_steps=2,
                logging_steps=1, report_to="none", save_strategy="no", seed=0, learning_rate=1e-2,
                use_cpu=not on_gpu, bf16=on_gpu, deepspeed=zero3_config())


def grpo_config(out_dir: str, device: str):
    """The GRPO run of ``zero3_worker.py`` and ``zero3_lora_worker.py``: 8 rows (2 prompts x 4) a step, beta 0."""
    from kvroll.trainers import GRPOConfig

    return GRPOConfig(**trainer_args(out_dir, device), per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=MAX_COMPLETION, beta=0.0)


def build_trainer(trainer_class, args, **kwargs):
    """``trainer_class`` on the tiny Llama, the length reward and the chat dataset (``kwargs``: e.g. peft_config)."""
    tok = tokenizer()
    return trainer_class(model=tiny_llama(tok), reward_funcs=length_reward, args=args, train_dataset=chat_dataset(),
                         processing_class=tok, **kwargs)


def run_worker(main, doc: str) -> None:
    """Parse ``OUT_DIR [--device cuda|cpu]``, create OUT_DIR and call ``main(out_dir, device)``."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    opts = parser.parse_args()
    os.makedirs(opts.out_dir, exist_ok=True)
    main(opts.out_dir, opts.device)
