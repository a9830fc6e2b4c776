"""Run by test_two_ranks.py under ``torch.distributed.run --nproc_per_node 2`` (gloo, CPU).

GRPO with a tool in colocate mode on two ranks. The engine's completions are forced: in the first generation rank
0's rows call the tool and rank 1's do not, so TRL's tool loop calls the backend's generate() again on rank 0 only.
kvroll's generate() then has to be local to each rank (a collective one crashed or hung here). Prints
``RANK <r> OK`` when the step finished with the expected calls.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rank_exit import exit_rank  # noqa: E402
from tiny_model import chat_dataset, length_reward, tiny_llama, tokenizer  # noqa: E402

import trl  # noqa: E402

from kvroll.trainers import GRPOConfig, GRPOTrainer  # noqa: E402


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    return a + b


def main(out_dir: str) -> None:
    tok = tokenizer()
    tok.chat_template = open(os.path.join(os.path.dirname(trl.__file__), "chat_templates", "qwen3.jinja")).read()
    args = GRPOConfig(output_dir=out_dir, use_kvroll=True, kvroll_policy="longflow", kvroll_budget=16,
                      per_device_train_batch_size=4, num_generations=4, max_completion_length=64, max_steps=1,
                      logging_steps=1, report_to="none", use_cpu=True, bf16=False, save_strategy="no", seed=0,
                      learning_rate=1e-2)
    trainer = GRPOTrainer(model=tiny_llama(tok), reward_funcs=length_reward, args=args, train_dataset=chat_dataset(),
                          processing_class=tok, tools=[add])
    gen = trainer.kvroll_generation
    assert gen.local and gen.world == 2
    call = tok.encode('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
                      add_special_tokens=False)
    plain = tok.encode("The answer is 3.", add_special_tokens=False)
    real_run, sizes = gen._run, []

    def forced(all_rows, chunks, mine):  # the real engine runs; its tokens are replaced by the scripted ones
        first = gen.calls == 0
        rows = real_run(all_rows, chunks, mine)
        sizes.append(len(rows))
        return [(row, ids, lps[:len(ids)] + [-0.5] * (len(ids) - len(lps)))
                for row, _, lps in rows
                for ids in [(call if first and gen.rank == 0 else plain) + [tok.eos_token_id]]]

    gen._run = forced
    trainer.train()
    expected = [4, 4] if gen.rank == 0 else [4]  # rank 0's rows called the tool: a second generation, there only
    assert sizes == expected, (gen.rank, sizes)
    frequency = [h["tools/call_frequency"] for h in trainer.state.log_history if "tools/call_frequency" in h]
    assert frequency and frequency[0] > 0, trainer.state.log_history
    print(f"RANK {gen.rank} OK", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])  # any failed check raises here, before the exit
    exit_rank()  # tear gloo down, then skip the interpreter's teardown (rank_exit.py)
