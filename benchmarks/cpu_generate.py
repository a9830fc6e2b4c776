"""CPU throughput of the engine on the embedded model: full vs compressing policies, measured in one run.

    python benchmarks/cpu_generate.py --policies full,longflow --budget 256 --max-new-tokens 2048 --batch 4

Generated tokens / wall seconds of ``engine.generate`` (EOS ignored, greedy), after one warm-up call.
"""
from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from kvroll import CompressionConfig, RolloutEngine, SamplingParams
from kvroll.rollout.model import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default="full,longflow")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=None, help="append a JSON line with the results")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model("smollm2")
    prompt = tok.apply_chat_template([{"role": "user", "content": "Explain, step by step, how a heat pump works."}],
                                     add_generation_prompt=True, return_dict=False)
    rows = []
    for name in args.policies.split(","):
        budget = None if name == "full" else args.budget
        engine = RolloutEngine(model, compression=CompressionConfig(name, budget), max_batch=args.batch,
                               tokenizer=tok)
        engine.generate([prompt], SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))  # warm-up
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        results = engine.generate([prompt] * args.batch, params)
        seconds = time.perf_counter() - start
        tokens = sum(len(r.token_ids) for r in results)
        rows.append({"policy": name, "budget": budget, "batch": args.batch, "new_tokens": args.max_new_tokens,
                     "prompt_tokens": len(prompt), "seconds": round(seconds, 2),
                     "tokens_per_s": round(tokens / seconds, 2), "kv_bytes_per_seq": engine.kv_cache_bytes()
                     // args.batch})
        print(json.dumps(rows[-1]), flush=True)
    meta = {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    print(json.dumps(meta))
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps({"meta": meta, "rows": rows}) + "\n")


if __name__ == "__main__":
    main()
