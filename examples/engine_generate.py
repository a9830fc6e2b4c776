"""The rollout engine on its own: sample n completions of a prompt on a compressed KV cache, with a chosen policy.

    python examples/engine_generate.py                                   # longflow, budget 64, 4 x 96 tokens
    python examples/engine_generate.py --policy rkv --policy-arg buffer=16 --budget 48
    python examples/engine_generate.py --model /path/to/hf_model --policy snapkv --budget 256 --max-new-tokens 1024

Prints each completion (its prompt and sample index, finish reason, length, text), the generated tokens/s and the
KV cache against what full attention would hold for the same rows. ``--ignore-eos`` makes every completion exactly
``--max-new-tokens`` long. Copy it and edit the prompt, the policy and the sampling.
"""
import argparse
import time

from kvroll import CompressionConfig, RolloutEngine, SamplingParams


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", help="'smollm2' (embedded) or a local HF model directory")
    p.add_argument("--policy", default="longflow", help="full, random, streaming, longflow, h2o, snapkv, rkv, ...")
    p.add_argument("--budget", type=int, default=64, help="tokens kept per sequence and KV head")
    p.add_argument("--policy-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="a hyperparameter of the policy, e.g. buffer=16 (repeatable)")
    p.add_argument("--prompt", default="A shop sells pens at 3 dollars each. How much do 14 pens cost? "
                                       "Explain each step.")
    p.add_argument("--n", type=int, default=4, help="completions of the prompt (one shared prefill)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-new-tokens tokens each")
    args = p.parse_args()

    bad = [arg for arg in args.policy_arg if "=" not in arg]
    if bad:
        p.error(f"--policy-arg {bad[0]!r} is invalid: use KEY=VALUE, e.g. --policy-arg buffer=16")
    kwargs = {k: _number(v) for k, v in (arg.split("=", 1) for arg in args.policy_arg)}
    compression = CompressionConfig(args.policy, budget=None if args.policy == "full" else args.budget, **kwargs)
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                              seed=args.seed, ignore_eos=args.ignore_eos)
    with RolloutEngine(args.model, compression=compression, max_batch=args.n) as engine:
        tok = engine.tokenizer
        prompt = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                         return_dict=False)
        start = time.perf_counter()
        results = engine.generate([prompt], sampling, n=args.n)
        seconds = time.perf_counter() - start
        for r in results:  # one Completion per (prompt, sample), in order
            text = tok.decode(r.token_ids, skip_special_tokens=True).replace("\n", " ")
            print(f"[{r.prompt_index}.{r.sample_index}] {r.finish_reason}, {len(r.token_ids)} tokens: {text}")
        tokens = sum(len(r.token_ids) for r in results)
        per_token = engine.kv_cache_bytes() / (args.n * engine.cache.capacity)  # all layers, K and V
        full = sum(len(r.prompt_ids) + len(r.token_ids) - 1 for r in results) * per_token
        print(f"{args.policy} budget {compression.budget}: {len(results)} completions, {tokens} tokens in "
              f"{seconds:.1f} s ({tokens / seconds:.1f} tokens/s); KV cache {engine.kv_cache_bytes() / 2**20:.2f} "
              f"MiB ({engine.cache.capacity} slots per head), full attention would hold {full / 2**20:.2f} MiB")


def _number(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


if __name__ == "__main__":
    main()
