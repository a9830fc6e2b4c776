"""A custom eviction policy: written, registered and used, and its cache checked to hold what it claims.

    python examples/custom_policy.py                       # first 8 + most recent, budget 32, 4 x 64 tokens
    python examples/custom_policy.py --first 4 --budget 24 --max-new-tokens 80

``first_recent`` keeps the first ``first`` tokens of each sequence (the instruction at the head of the prompt)
and the most recent ``budget - first``: once the cache is full, each decode step overwrites the oldest token
after the first ones. (That is StreamingLLM with ``first`` sinks, kvroll's ``streaming``: the point here is
the protocol.) A step policy is a frozen dataclass of hyperparameters and a class with a few methods, no base
class (``kvroll/policies/base.py`` documents the protocol; ``baselines.py`` and ``h2o.py`` are short models):

* ``protected()``: (sinks, window) that the cache never evicts; the window counts the current token;
* ``capacity(budget, max_len)``: slots per sequence and KV head; ``prompt_keep(budget)`` and
  ``prompt_keep_idx(q, k, keep, scale)``: which prompt tokens survive a prompt longer than the budget;
* ``step_scores(cache, layer, stat)``: a keep-score per slot (higher = keep); the cache overwrites the argmin
  over the slots that are neither protected nor empty.

``register_policy`` adds it to the one registry, so ``CompressionConfig("first_recent", ...)``, the engine and the
TRL switch (``kvroll_policy="first_recent"``, colocated) select it by name.
"""
import argparse
from dataclasses import dataclass

import torch

from kvroll import CompressionConfig, RolloutEngine, SamplingParams
from kvroll.policies import register_policy
from kvroll.policies.base import check_budget, check_int


@dataclass(frozen=True)
class FirstRecentParams:
    """Hyperparameters: how many leading tokens are kept for good."""

    first: int = 8

    def __post_init__(self):
        check_int("FirstRecentParams", "first", self.first, 0)  # a ValueError naming the field and the value


class FirstRecentPolicy:
    """Keeps the first ``first`` tokens and the most recent ``budget - first``."""

    name, periodic, stat, granularity = "first_recent", False, None, "head"  # a step policy, no attention stat

    def __init__(self, params: FirstRecentParams):
        self.params = params

    def validate_budget(self, budget):
        first = self.params.first
        check_budget(self.name, budget, first + 2, f"first={first} plus the current token plus one more")

    def protected(self):
        return self.params.first, 1

    def capacity(self, budget, max_len):
        return budget

    def prompt_keep(self, budget):
        return budget - 1  # one slot left for the first generated token

    def prompt_keep_idx(self, q, k, keep, scale, generator=None):
        """A prompt longer than the budget keeps its first tokens and its last ones; k is [kv_heads, P, D]."""
        num_kv_heads, length, _ = k.shape
        first = min(self.params.first, keep - 1)
        idx = torch.cat([torch.arange(first), torch.arange(length - (keep - first), length)]).to(k.device)
        return idx.expand(num_kv_heads, -1)

    def step_scores(self, cache, layer, stat):
        return cache.pos[layer].float()  # [slots, kv_heads, capacity]: the oldest evictable token goes first


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", help="'smollm2' (embedded) or a local HF model directory")
    p.add_argument("--first", type=int, default=8)
    p.add_argument("--budget", type=int, default=32)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    args = p.parse_args()

    register_policy("first_recent", FirstRecentParams, FirstRecentPolicy)
    compression = CompressionConfig("first_recent", budget=args.budget, first=args.first)
    # EOS ignored: every sequence runs to max_new_tokens, so all of them end at the same position
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.8, seed=0, ignore_eos=True)
    with RolloutEngine(args.model, compression=compression, max_batch=args.n) as engine:
        tok = engine.tokenizer
        prompt = tok.apply_chat_template([{"role": "user", "content": "Name three rivers and say where they flow."}],
                                         add_generation_prompt=True, return_dict=False)
        results = engine.generate([prompt], sampling, n=args.n)
        for r in results:
            print(f"[{r.sample_index}] {len(r.token_ids)} tokens: "
                  f"{tok.decode(r.token_ids, skip_special_tokens=True).replace(chr(10), ' ')[:100]}")
        # What each slot's cache holds at the end: the last sampled token is not in it yet (it would be written
        # by the next step), so the sequence's cached positions are 0 .. end - 1.
        end = len(prompt) + args.max_new_tokens - 1
        if end <= args.budget:
            raise SystemExit(f"{end} tokens fit in the budget of {args.budget}: nothing was evicted; raise "
                             "--max-new-tokens or lower --budget.")
        expected = list(range(args.first)) + list(range(end - (args.budget - args.first), end))
        pos = engine.cache.pos  # [layers, slots, kv_heads, capacity] true position of each cached token
        held = pos.sort(dim=-1).values
        assert (held == torch.tensor(expected, dtype=held.dtype)).all(), "the cache does not hold what it claims"
        print(f"cache: every layer, slot and KV head holds positions 0-{args.first - 1} and "
              f"{end - (args.budget - args.first)}-{end - 1} of {end} ({args.budget} of {end} tokens)")
        print("cache positions layer 0 slot 0 head 0:", held[0, 0, 0].tolist())


if __name__ == "__main__":
    main()
