"""Fidelity of each eviction policy against full KV: ``kvroll eval fidelity``.

A greedy full-KV continuation of a fixed prompt set (``kvroll/data/fidelity_prompts.jsonl``) is the reference.
Each (policy, budget) replays the same tokens (teacher forcing, ``kvroll.rollout.replay``) and reports

* the mean and p99 over tokens of KL(full || policy) of the next-token distribution, and top-1 agreement;
  a reference that reaches an end-of-sequence token ends there (it is counted; the steps after it, which no rollout
  generates, are not), unless ``ignore_eos`` (``--ignore-eos``) scores all ``max_new_tokens`` steps of every
  reference, the text past its end included (a fixed-length stress test; ``docs/fidelity.md``'s tables);
* greedy tokens before the first divergence: until its argmax first differs from the reference, a free-running
  greedy decode under the policy would have produced exactly the reference, so this is read off the same pass;
* the K/V bytes of one sequence's static cache.

    kvroll eval fidelity --model smollm2 --policies full,random,rkv --budgets 64,128,256 --max-new-tokens 1024
    report = run_fidelity("smollm2", ["full", "rkv"], [128], max_new_tokens=256)   # the same, in Python
"""
from __future__ import annotations

import argparse
import json
import time
import warnings
from importlib import resources
from pathlib import Path

import torch

from kvroll.checks import as_int
from kvroll.config import CompressionConfig
from kvroll.policies.registry import POLICIES
from kvroll.rollout.engine import RolloutEngine
from kvroll.rollout.model import check_budget_fits, check_generation_length, check_new_tokens, load_config
from kvroll.rollout.replay import greedy_reference, kl_and_agreement

PROMPTS = "fidelity_prompts.jsonl"
LAGKV_MAX_LAG = 128


def load_prompts(path: str | Path | None = None) -> list[str]:
    """The user messages of the shipped prompt set (or of a JSONL file with a ``content`` field per line)."""
    text = Path(path).read_text() if path else resources.files("kvroll.data").joinpath(PROMPTS).read_text()
    return [json.loads(line)["content"] for line in text.splitlines() if line.strip()]


def policy_kwargs(policy: str, budget: int) -> dict:
    """Paper defaults, except LagKV's lag: the largest power of two <= 128 with sink 16 + 3 x lag <= budget
    (the static-budget rule needs room for sinks, a compressed lag and a raw tail of two lags)."""
    if policy != "lagkv":
        return {}
    lag = LAGKV_MAX_LAG
    while lag > 1 and 16 + 3 * lag > budget:
        lag //= 2
    return {"lag": lag}


def fidelity_metrics(kl: torch.Tensor, agree: torch.Tensor, lengths: torch.Tensor | None = None) -> dict:
    """Summary of per-token KL [B, T] and argmax agreement [B, T] over each row's first ``lengths`` [B] steps
    (default: all T; see the module docstring)."""
    steps = agree.shape[1]
    lengths = torch.as_tensor(lengths) if lengths is not None else torch.full((agree.shape[0],), steps)
    valid = torch.arange(steps) < lengths[:, None]  # [B, T]
    first_miss = torch.where(~agree & valid, torch.arange(steps), lengths[:, None]).amin(dim=1)  # [B]
    return {
        "kl_mean": float(kl[valid].mean()),
        "kl_p99": float(torch.quantile(kl[valid].double(), 0.99)),
        "top1_agreement": float(agree[valid].float().mean()),
        "greedy_prefix_mean": float(first_miss.float().mean()),
        "greedy_prefix_min": int(first_miss.min()),
    }


def run_fidelity(model="smollm2", policies=("full", "random"), budgets=(128,), max_new_tokens: int = 1024,
                 prompts_path=None, num_prompts: int | None = None, log=print, device: str = "cpu",
                 on_row=None, ignore_eos: bool = False) -> dict:
    """Measure every (policy, budget) against the full-KV reference; returns the report dict (``fidelity.json``).

    ``on_row(report)`` (optional) receives the report so far after every measured row (partial results survive a
    time limit). Every input is checked before the model loads (``check_inputs``), the generation length against
    the model's limits before the reference is computed."""
    check_inputs(model, policies, budgets, max_new_tokens, num_prompts)
    texts = load_prompts(prompts_path)[:num_prompts]
    if not texts:  # before the model loads
        raise ValueError(f"--prompts {prompts_path} holds no prompts; give one JSON line with a 'content' per prompt.")
    model_obj, tokenizer = _load(model, device)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                             return_dict=False) for t in texts]
    for policy in dict.fromkeys(["full", *policies]):  # full: the reference
        with warnings.catch_warnings():  # a compressing policy past the positions is warned when it is measured
            warnings.simplefilter("ignore")
            check_generation_length(model_obj.config, policy, max(map(len, prompts)), max_new_tokens)
    start = time.time()
    reference = RolloutEngine(model_obj, CompressionConfig("full"), max_batch=len(prompts), tokenizer=tokenizer)
    ref_tokens, ref_logprobs = greedy_reference(reference, prompts, max_new_tokens)
    lengths = torch.full((len(prompts),), max_new_tokens) if ignore_eos else \
        reference_lengths(ref_tokens, reference.eos_ids)
    log(f"reference: {len(prompts)} prompts x {max_new_tokens} greedy tokens in {time.time() - start:.0f}s")
    rows = []
    report = {"model": str(model), "device": _device_name(model_obj), "max_new_tokens": max_new_tokens,
              "prompt_lengths": [len(p) for p in prompts], "ignore_eos": ignore_eos,
              "reference_lengths": lengths.tolist(),
              "reference_text": [tokenizer.decode(t[:200]) for t in ref_tokens.tolist()], "results": rows}
    for budget in budgets:
        for policy in policies:
            if policy == "full" and any(row["policy"] == "full" for row in rows):
                continue  # full ignores the budget: measured once
            rows.append(_measure(model_obj, tokenizer, prompts, policy, budget, ref_tokens, ref_logprobs, lengths))
            log(_row_line(rows[-1]))
            if on_row is not None:
                on_row(report)
    return report


def reference_lengths(ref_tokens: torch.Tensor, eos_ids) -> torch.Tensor:
    """[B] steps of each reference up to and including its first end-of-sequence token (T where there is none)."""
    steps = ref_tokens.shape[1]
    stop = torch.isin(ref_tokens, torch.tensor(sorted(eos_ids), dtype=ref_tokens.dtype))
    return torch.where(stop, torch.arange(steps), steps).amin(dim=1).add(1).clamp_max(steps)


def check_inputs(model, policies, budgets, max_new_tokens: int, num_prompts: int | None) -> None:
    """Every (policy, budget) a valid config within the model's positions (read from its config.json, no weights),
    the lengths integers >= 1; a ``ValueError`` naming the flag otherwise."""
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise ValueError(f"--policies: unknown policy {unknown[0]!r}; choose from {sorted(POLICIES)}.")
    if not policies or not budgets:
        raise ValueError(f"--policies={list(policies)} / --budgets={list(budgets)}: give at least one of each.")
    for flag, value in (("--max-new-tokens", max_new_tokens), ("--num-prompts", num_prompts)):
        if value is not None and not (as_int(value) is not None and value >= 1):
            raise ValueError(f"{flag}={value!r} is invalid: it must be an integer >= 1.")
    config = load_config(str(model))
    try:
        check_new_tokens(config, "full", max_new_tokens)  # the reference run is full's
    except ValueError as err:  # the flag's name, not the engine call's
        raise ValueError(f"--max-new-tokens={max_new_tokens}: {str(err).removeprefix('generate: ')}".replace(
            "lower max_new_tokens", "lower --max-new-tokens")) from None
    for policy in policies:
        for budget in budgets if policy != "full" else ():
            check_budget_fits(config, CompressionConfig(policy, budget, **policy_kwargs(policy, budget)))


def _measure(model_obj, tokenizer, prompts, policy, budget, ref_tokens, ref_logprobs, lengths=None) -> dict:
    kwargs = policy_kwargs(policy, budget)
    config = CompressionConfig(policy, None if policy == "full" else budget, **kwargs)
    engine = RolloutEngine(model_obj, config, max_batch=len(prompts), tokenizer=tokenizer)
    start = time.time()
    kl, agree = kl_and_agreement(engine, prompts, ref_tokens, ref_logprobs)
    return {"policy": policy, "budget": None if policy == "full" else budget, "params": kwargs,
            **fidelity_metrics(kl, agree, lengths), "kv_bytes_per_seq": engine.kv_cache_bytes() // engine.max_batch,
            "seconds": round(time.time() - start, 1)}


def _row_line(row: dict) -> str:
    return (f"{row['policy']:>9} budget={row['budget']}: KL mean {row['kl_mean']:.4f} p99 {row['kl_p99']:.3f} "
            f"top1 {row['top1_agreement']:.3f} prefix {row['greedy_prefix_mean']:.0f} ({row['seconds']}s)")


def _load(model, device="cpu"):
    from kvroll.rollout.model import load_model

    return load_model(model, dtype=torch.float32, device=device)


def _device_name(model_obj) -> str:
    device = next(model_obj.parameters()).device
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def to_markdown(report: dict, command: str | None = None) -> str:
    """``fidelity.md``: one table per budget, policies sorted by mean KL."""
    lines = [f"# KV-cache policy fidelity vs full KV — {report['model']}", "",
             f"{len(report['prompt_lengths'])} prompts (lengths {report['prompt_lengths']}), greedy full-KV reference "
             f"of {_reference_length_text(report)}, replayed under each policy (teacher forcing); fp32 on "
             f"{report.get('device', 'cpu')}.",
             "The budget is the tokens kept per KV head after a compression; `snapkv`, `rkv` and `hardkv` also hold "
             "their 128-token buffer between compressions (their papers' setting), so compare the KV bytes column.",
             ""]
    if command:
        lines += ["Regenerate with:", "", f"    {command}", ""]
    full = [r for r in report["results"] if r["policy"] == "full"]
    budgets = sorted({r["budget"] for r in report["results"] if r["budget"] is not None})
    header = ("| policy | KL mean | KL p99 | top-1 agree | greedy tokens before divergence (mean / min) "
              "| KV bytes / seq | params |")
    for budget in budgets or ([None] if full else []):  # (only full measured: its row alone)
        rows = sorted((r for r in report["results"] if r["budget"] == budget and r["policy"] != "full"),
                      key=lambda r: r["kl_mean"])
        lines += [f"## budget {budget}" if budget is not None else "## full only", "", header,
                  "|---|---|---|---|---|---|---|"]
        for r in full + rows:
            lines.append(f"| {r['policy']} | {r['kl_mean']:.4f} | {r['kl_p99']:.3f} | {r['top1_agreement']:.3f} "
                         f"| {r['greedy_prefix_mean']:.0f} / {r['greedy_prefix_min']} | {r['kv_bytes_per_seq']:,} "
                         f"| {r['params'] or ''} |")
        lines.append("")
    return "\n".join(lines)


def _reference_length_text(report: dict) -> str:
    """How long the scored references are: each to its EOS, or ``max_new_tokens`` whatever they say."""
    lengths = report.get("reference_lengths")
    if lengths is None:  # a report written before references ended at EOS
        return f"{report['max_new_tokens']} tokens each"
    if report.get("ignore_eos"):
        return f"{report['max_new_tokens']} tokens each, scored past EOS (--ignore-eos)"
    return f"up to {report['max_new_tokens']} tokens, each scored to its EOS (lengths {lengths})"


def run_eval_fidelity(args: argparse.Namespace) -> int:
    """Validate every (policy, budget) before loading the model, run, write fidelity.json / fidelity.md.

    ``args`` come from ``kvroll eval fidelity`` (``kvroll.cli``, which has checked the paths).
    """
    policies, budgets = args.policies or list(POLICIES), args.budgets  # lists (kvroll.cli's argparse types)
    check_inputs(args.model, policies, budgets, args.max_new_tokens, args.num_prompts)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"--device={device!r} is invalid: use cpu or cuda.")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = (f"kvroll eval fidelity --model {args.model} --policies {','.join(policies)} --budgets "
               f"{','.join(map(str, budgets))} --max-new-tokens {args.max_new_tokens}"
               + (f" --num-prompts {args.num_prompts}" if args.num_prompts else "")
               + (f" --prompts {args.prompts}" if args.prompts else "")
               + (" --ignore-eos" if getattr(args, "ignore_eos", False) else ""))

    written = [0]  # rows in the files so far

    def write(report):  # after each row, whole files (a kill mid-write must not cut the rows written before)
        from kvroll.files import write_text

        write_text(out / "fidelity.json", json.dumps(report, indent=2))
        write_text(out / "fidelity.md", to_markdown(report, command))
        written[0] = len(report["results"])

    try:
        write(run_fidelity(args.model, policies, budgets, args.max_new_tokens, args.prompts, args.num_prompts,
                           device=device, on_row=write, ignore_eos=getattr(args, "ignore_eos", False)))
    except KeyboardInterrupt:  # say what the files hold: Ctrl-C otherwise reads as "nothing kept"
        from kvroll.usage import interrupted

        total = ("full" in policies) + len(budgets) * sum(policy != "full" for policy in policies)
        kept = (f"{out / 'fidelity.json'} and fidelity.md hold them" if written[0] else
                f"nothing written to {out}")
        return interrupted("eval", f"after {written[0]} of {total} (policy, budget) rows; {kept}")
    print(f"wrote {out / 'fidelity.json'} and {out / 'fidelity.md'}")
    return 0
