"""The ``kvroll`` command line: ``kvroll generate | eval | train | bench | report``.

    kvroll generate --model smollm2 --policy longflow --budget 256 --prompt "Hi" --n 4 --max-new-tokens 512
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is invalid: must be an integer >= 1")
    return value


def _policy_kwargs(pairs: list[str]) -> dict:
    """``--policy-arg key=value`` pairs; values parsed as JSON where possible (numbers, true/false)."""
    kwargs = {}
    for pair in pairs or []:
        if "=" not in pair:
            raise SystemExit(f"--policy-arg {pair!r} is invalid: use key=value, e.g. --policy-arg granularity=layer")
        key, raw = pair.split("=", 1)
        try:
            kwargs[key] = json.loads(raw)
        except json.JSONDecodeError:
            kwargs[key] = raw
    return kwargs


def add_generate_parser(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate completions on the compressed KV cache")
    p.add_argument("--model", default="smollm2", help="'smollm2' (embedded) or a local HF model directory")
    p.add_argument("--policy", default="longflow", help="eviction policy name (see kvroll.policies)")
    p.add_argument("--budget", type=int, default=256, help="tokens kept per sequence and KV head")
    p.add_argument("--policy-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="a policy hyperparameter, repeatable (e.g. granularity=layer)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one user message (the chat template is applied)")
    src.add_argument("--prompts-file", type=Path, help="JSONL: one {'prompt': ...} or {'messages': [...]} per line")
    p.add_argument("--n", type=_positive_int, default=1, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=_positive_int, default=512)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-batch", type=_positive_int, default=16, help="sequence slots in the static cache")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--out", type=Path, help="write the completions to this JSONL file")
    p.set_defaults(func=run_generate)


def read_prompts(args) -> list:
    """The chat messages to generate for: one list of {'role','content'} dicts per prompt."""
    if args.prompt is not None:
        if not args.prompt.strip():
            raise SystemExit("--prompt is empty: give a non-empty message")
        return [[{"role": "user", "content": args.prompt}]]
    if not args.prompts_file.is_file():
        raise SystemExit(f"--prompts-file {args.prompts_file} does not exist")
    chats = []
    for line_no, line in enumerate(args.prompts_file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise SystemExit(f"--prompts-file {args.prompts_file}:{line_no} is not JSON ({err})") from None
        if isinstance(row, dict) and isinstance(row.get("messages"), list):
            chats.append(row["messages"])
        elif isinstance(row, dict) and isinstance(row.get("prompt"), str) and row["prompt"].strip():
            chats.append([{"role": "user", "content": row["prompt"]}])
        else:
            raise SystemExit(f"--prompts-file {args.prompts_file}:{line_no} needs a non-empty 'prompt' string or "
                             "a 'messages' list")
    if not chats:
        raise SystemExit(f"--prompts-file {args.prompts_file} holds no prompts")
    return chats


def run_generate(args) -> int:
    from tqdm import tqdm

    from kvroll import CompressionConfig, RolloutEngine, SamplingParams

    # every check runs before the model loads
    compression = CompressionConfig(args.policy, args.budget, **_policy_kwargs(args.policy_arg))
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                              seed=args.seed)
    chats = read_prompts(args)
    engine = RolloutEngine(args.model, compression=compression, max_batch=args.max_batch, device=args.device)
    tok = engine.tokenizer
    prompts = [tok.apply_chat_template(c, add_generation_prompt=True, return_dict=False) for c in chats]
    total = len(prompts) * args.n * args.max_new_tokens
    start = time.perf_counter()
    with tqdm(total=total, desc="tokens", unit="tok", file=sys.stderr, leave=False) as bar:
        results = engine.generate(prompts, sampling, n=args.n, progress=bar)
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
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    kv = engine.kv_cache_bytes()
    print(f"policy={compression.policy} budget={args.budget} prompts={len(prompts)} n={args.n} "
          f"generated={generated} tokens in {seconds:.1f}s = {generated / seconds:.1f} tokens/s; "
          f"KV cache {kv / 2**20:.1f} MiB for {args.max_batch} slots ({kv // args.max_batch / 2**10:.0f} KiB "
          f"per sequence); prefilled {engine.stats['prefill_tokens']} prompt tokens"
          + (f"; wrote {args.out}" if args.out else ""))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvroll", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(subparsers)
    from kvroll.fidelity import add_eval_parser  # kvroll eval fidelity

    add_eval_parser(subparsers)
    from kvroll.trainers.train import add_train_parser  # kvroll train --config configs/grpo_smollm2.yaml

    add_train_parser(subparsers)
    from kvroll.bench.cli import add_bench_parser  # kvroll bench --config configs/bench/cpu_smollm2.yaml

    add_bench_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as err:  # validation errors: print the message, not a traceback
        print(f"kvroll {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
