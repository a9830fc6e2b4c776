"""The ``kvroll`` command line: ``kvroll generate | eval fidelity | train | bench | report``.

    kvroll generate --model smollm2 --policy longflow --budget 256 --prompt "Hi" --n 4 --max-new-tokens 512
    kvroll train --config configs/grpo_smollm2.yaml [--resume]

Each subcommand checks its files, model, output paths and policy names before torch loads: bad input is one line
naming the file or field (``kvroll train: error: ...``, exit status 2). Ctrl-C is one line saying where the command
stopped and what it kept (``interrupted``, exit status 130).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

from kvroll.usage import (UsageError, check_model, check_policy_names, check_writable_dir, check_writable_file,
                          interrupted, read_jsonl_lines, tempfile_dir)

DEFAULT_BUDGET = 256  # kvroll generate's --budget for a compressing policy ('full' takes none)


def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (argparse prints the message after the flag's name)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer: give an integer >= 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is invalid: must be an integer >= 1")
    return value


def _name_list(text: str) -> list[str]:
    """argparse type: comma-separated names, at least one, each once (``--policies full,rkv``)."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r} is empty: give comma-separated names, e.g. full,rkv")
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise argparse.ArgumentTypeError(f"{text!r} names {twice[0]!r} twice: list each once")
    return names


def _threads(text: str) -> int | None:
    """argparse type: torch CPU threads, an integer >= 1, or 0 for torch's choice (None)."""
    return None if text.strip() == "0" else _positive_int(text)


def _positive_int_list(text: str) -> list[int]:
    """argparse type: comma-separated integers >= 1, at least one, each once (``--budgets 64,128``)."""
    try:
        values = [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1 or len(set(values)) < len(values):
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: give comma-separated integers >= 1, each once, "
                                         "e.g. 64,128,256")
    return values


def _policy_kwargs(pairs: list[str]) -> dict:
    """``--policy-arg key=value`` pairs; values parsed as JSON where possible (numbers, true/false)."""
    kwargs = {}
    for pair in pairs or []:
        if "=" not in pair:
            raise UsageError(f"--policy-arg {pair!r} is invalid: use key=value, e.g. --policy-arg granularity=layer")
        key, raw = pair.split("=", 1)
        try:
            kwargs[key] = json.loads(raw)
        except json.JSONDecodeError:
            kwargs[key] = raw
    return kwargs


def _as_flags(err: ValueError) -> UsageError:
    """An API check's message in the command line's terms: ``SamplingParams.top_p=``, ``CompressionConfig.budget=``,
    ``RolloutEngine.device=`` and ``max_new_tokens`` become ``--top-p=``, ``--budget=``, ``--device=`` and
    ``--max-new-tokens``."""
    text = re.sub(r"\b(?:SamplingParams|CompressionConfig|RolloutEngine)\.(\w+)=",
                  lambda m: f"--{m[1].replace('_', '-')}=", str(err).removeprefix("generate: "))
    return UsageError(re.sub(r"\bmax_new_tokens\b", "--max-new-tokens", text))


def add_generate_parser(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate completions on the compressed KV cache")
    p.add_argument("--model", default="smollm2", help="'smollm2' (embedded) or a local HF model directory")
    p.add_argument("--policy", default="longflow", help="eviction policy name (see kvroll.policies; default: "
                   "%(default)s)")
    p.add_argument("--budget", type=int, default=None, help="tokens kept per sequence and KV head (default: "
                   f"{DEFAULT_BUDGET} for a compressing policy, none for full)")
    p.add_argument("--policy-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="a policy hyperparameter, repeatable (e.g. granularity=layer)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one user message (the chat template is applied)")
    src.add_argument("--prompts-file", type=Path, help="JSONL: one {'prompt': ...} or {'messages': [...]} per line")
    p.add_argument("--n", type=_positive_int, default=1, help="samples per prompt (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=_positive_int, default=512,
                   help="tokens generated per sample, at most (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.7, help="0: greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, help="keep the smallest set of tokens with this mass "
                   "(default: %(default)s: off)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default: %(default)s: off)")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens below this share of the most likely one (default: %(default)s: off)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="HF's penalty on tokens already in the row (default: %(default)s: none)")
    p.add_argument("--seed", type=int, default=0, help="the sampler's seed (default: %(default)s)")
    p.add_argument("--max-batch", type=_positive_int, default=16, help="sequence slots in the static cache (default: "
                   "%(default)s)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--out", type=Path, help="write the completions to this JSONL file once all are done (an "
                   "existing file is replaced)")
    p.set_defaults(func=run_generate)


def read_prompts(args) -> list:
    """The chat messages to generate for: one list of {'role','content'} dicts per prompt."""
    if args.prompt is not None:
        if not args.prompt.strip():
            raise UsageError("--prompt is empty: give a non-empty message")
        return [[{"role": "user", "content": args.prompt}]]
    chats = []
    for line_no, row in read_jsonl_lines("--prompts-file", args.prompts_file):
        if isinstance(row, dict) and "messages" in row:
            chats.append(_messages(f"--prompts-file {args.prompts_file}: line {line_no}", row["messages"]))
        elif isinstance(row, dict) and isinstance(row.get("prompt"), str) and row["prompt"].strip():
            chats.append([{"role": "user", "content": row["prompt"]}])
        else:
            raise UsageError(f"--prompts-file {args.prompts_file}: line {line_no} needs a non-empty 'prompt' string "
                             "or a 'messages' list")
    if not chats:
        raise UsageError(f"--prompts-file {args.prompts_file} holds no prompts")
    return chats


def _messages(where: str, messages) -> list:
    """A row's chat: a non-empty list of {'role': str, 'content': str} dicts, else a ``UsageError`` naming ``where``."""
    if not isinstance(messages, list) or not messages:
        raise UsageError(f"{where}: 'messages' must be a non-empty list of {{'role': ..., 'content': ...}} dicts")
    for i, message in enumerate(messages):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise UsageError(f"{where}: message {i} is {json.dumps(message)[:80]}; each message needs a 'role' "
                             "string and a 'content' string")
    return messages


def run_generate(args) -> int:
    # every check runs before the model loads, the file and name ones before torch is imported
    chats = read_prompts(args)
    check_model("--model", args.model, gguf=False)
    check_policy_names("--policy", args.policy)
    if args.out:
        check_writable_file("--out", args.out)
    policy_kwargs = _policy_kwargs(args.policy_arg)
    from tqdm import tqdm

    from kvroll import CompressionConfig, RolloutEngine, SamplingParams
    from kvroll.files import write_text
    from kvroll.rollout.model import check_device, check_new_tokens, load_config

    budget = DEFAULT_BUDGET if args.budget is None and args.policy != "full" else args.budget
    if args.policy == "full" and budget is not None:  # one line, not the API's warning and its source line
        print(f"kvroll generate: note: --budget {budget} is ignored: --policy full keeps every token",
              file=sys.stderr)
        budget = None
    try:
        compression = CompressionConfig(args.policy, budget, **policy_kwargs)
        sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                                  top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                                  seed=args.seed)
        check_new_tokens(load_config(args.model), compression.policy, args.max_new_tokens)  # before the weights load
        check_device(args.device)
    except ValueError as err:
        raise _as_flags(err) from None
    engine = RolloutEngine(args.model, compression=compression, max_batch=args.max_batch, device=args.device)
    tok = engine.tokenizer
    prompts = [tok.apply_chat_template(c, add_generation_prompt=True, return_dict=False) for c in chats]
    total = len(prompts) * args.n * args.max_new_tokens
    start = time.perf_counter()
    with tqdm(total=total, desc="tokens", unit="tok", file=sys.stderr, leave=False) as bar:
        try:
            results = engine.generate(prompts, sampling, n=args.n, progress=bar)
        except KeyboardInterrupt:  # the engine hands back every completion at the end: none is kept
            kept = f"nothing written to {args.out}" if args.out else "nothing kept"
            return interrupted("generate", f"while generating (after {bar.n} of at most {total} tokens); {kept}")
    seconds = time.perf_counter() - start
    generated = sum(len(r.token_ids) for r in results)
    rows = []
    for r in results:
        text = tok.decode(r.token_ids, skip_special_tokens=True)
        rows.append({"prompt_index": r.prompt_index, "sample_index": r.sample_index, "completion": text,
                     "num_tokens": len(r.token_ids), "finish_reason": r.finish_reason,
                     "token_ids": r.token_ids, "logprobs": r.logprobs})
        print(f"--- prompt {r.prompt_index} sample {r.sample_index} ({len(r.token_ids)} tokens, "
              f"{r.finish_reason}) ---\n{text}\n")
    if args.out:
        text = "".join(json.dumps(row) + "\n" for row in rows)
        try:
            write_text(args.out, text)  # whole or not at all: a Ctrl-C mid-write leaves no half file
        except OSError as err:  # checked before generating, but the disk may fill or vanish since: keep the rows
            fallback = Path(tempfile_dir()) / f"kvroll-generate-{os.getpid()}.jsonl"
            fallback.write_text(text)
            raise UsageError(f"--out {args.out} could not be written ({err.strerror or err}); the {len(rows)} rows "
                             f"are in {fallback}.") from None
    kv = engine.kv_cache_bytes()
    print(f"policy={compression.policy} budget={compression.budget} prompts={len(prompts)} n={args.n} "
          f"generated={generated} tokens in {seconds:.1f}s = {generated / seconds:.1f} tokens/s; "
          f"KV cache {kv / 2**20:.1f} MiB for {args.max_batch} slots ({kv // args.max_batch / 2**10:.0f} KiB "
          f"per sequence); prefilled {engine.stats['prefill_tokens']} prompt tokens"
          + (f"; wrote {args.out}" if args.out else ""))
    return 0


def add_eval_parser(subparsers) -> None:
    """``kvroll eval fidelity ...``: checks its paths, then runs ``kvroll.bench.fidelity.run_eval_fidelity``."""
    evaluate = subparsers.add_parser("eval", help="evaluate policies against full KV")
    kinds = evaluate.add_subparsers(dest="eval_kind", required=True)
    p = kinds.add_parser("fidelity", help="teacher-forced KL / top-1 agreement / greedy divergence vs full KV")
    p.add_argument("--model", default="smollm2", help="'smollm2' (embedded) or a local HF model directory")
    p.add_argument("--policies", type=_name_list, default=None,
                   help="comma-separated policy names (default: every registered one)")
    p.add_argument("--budgets", type=_positive_int_list, default=[64, 128, 256],
                   help="comma-separated budgets (tokens per KV head; default 64,128,256)")
    p.add_argument("--max-new-tokens", type=_positive_int, default=1024, help="reference continuation length")
    p.add_argument("--num-prompts", type=_positive_int, default=None, help="use only the first N prompts of the set")
    p.add_argument("--prompts", default=None, help="JSONL with a 'content' field per line (default: shipped set)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="score every reference for --max-new-tokens steps, past its end-of-sequence token (a "
                        "fixed-length stress test); by default each is scored up to and including its EOS, as a "
                        "rollout stops there")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available); fp32 either way")
    p.add_argument("--threads", type=_threads, default=None, help="torch CPU threads (default, or 0: torch's choice)")
    p.add_argument("--out", default="fidelity", help="output directory for fidelity.json and fidelity.md")
    p.set_defaults(func=run_eval)


def run_eval(args) -> int:
    if args.prompts is not None:
        rows = read_jsonl_lines("--prompts", args.prompts)
        for line_no, row in rows:
            if not (isinstance(row, dict) and isinstance(row.get("content"), str)):
                raise UsageError(f"--prompts {args.prompts}: line {line_no} needs a 'content' string")
        if not rows:  # before torch, and before --out is made
            raise UsageError(f"--prompts {args.prompts} holds no prompts; give one JSON line with a 'content' per "
                             "prompt.")
    check_model("--model", args.model, gguf=False)
    if args.policies is not None:
        check_policy_names("--policies", args.policies)
    check_writable_dir("--out", args.out)
    from kvroll.bench.fidelity import run_eval_fidelity

    return run_eval_fidelity(args)


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand's parser; none imports torch, so bad arguments are answered at once."""
    parser = argparse.ArgumentParser(prog="kvroll", description="Fast, memory-bounded RL rollouts on a static "
                                                                "compressed KV cache.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(subparsers)
    add_eval_parser(subparsers)
    from kvroll.trainers.train import add_train_parser  # kvroll train --config configs/grpo_smollm2.yaml

    add_train_parser(subparsers)
    from kvroll.bench.cli import add_bench_parser  # kvroll bench --config configs/bench/cpu_smollm2.yaml

    add_bench_parser(subparsers)
    from kvroll.bench.run_report import add_report_parser  # kvroll report runs/grpo_smollm2

    add_report_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as err:  # bad input: print the message, not a traceback
        if getattr(args, "usage_errors_only", False) and not isinstance(err, UsageError):
            raise  # a subcommand past its checks (train): a ValueError is a bug and keeps its traceback
        print(f"kvroll {args.command}: error: {' '.join(str(err).splitlines())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a subcommand that says more catches it itself and calls interrupted()
        return interrupted(args.command, "before it finished")


if __name__ == "__main__":
    from kvroll.cli import main as _main  # python -m kvroll.cli: the module others import, one UsageError class

    sys.exit(_main())
