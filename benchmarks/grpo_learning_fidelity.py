"""Learning fidelity: GRPO with full-KV rollouts against compressed ones (rkv, longflow), same seeds.

    PYTHONPATH=. python benchmarks/grpo_learning_fidelity.py --out docs/benchmarks/grpo_fidelity
    PYTHONPATH=. python benchmarks/grpo_learning_fidelity.py --policies rkv --out docs/benchmarks/grpo_fidelity
    PYTHONPATH=. python benchmarks/grpo_learning_fidelity.py --plot-only --out docs/benchmarks/grpo_fidelity
    PYTHONPATH=. python benchmarks/grpo_learning_fidelity.py --task-style long --task-max-operand 9 \\
        --max-completion-length 384 --budget-base none --out /tmp/fid_long   # short prompt, long completions
    PYTHONPATH=. python benchmarks/grpo_learning_fidelity.py --model /tmp/tiny --steps 2 --max-completion-length 16 \\
        --prompts-per-step 2 --generations 4 --device cpu --out /tmp/fid   # CPU smoke

The embedded model (SmolLM2-135M-Instruct) does GRPO on kvroll's arithmetic task with a reasoning prompt
(format + exact-match rewards), rollouts from kvroll's engine with IS correction (TRL's defaults). Every policy
runs with the same seed, data order and initial weights; only the rollout cache differs. The compressed budget is
``--budget``, or ``floor(--budget-fraction x`` the mean completion length of the ``full`` run``)`` (so run ``full``
first; its result is read back from ``--out``), plus the longest prompt with ``--budget-base prompt``. SmolLM2's
answers here are short (tens of tokens), so a budget of 25% of them is smaller than the ~120-token prompt and the
prompt itself gets compressed; ``--budget-base prompt`` measures compression of the generated part alone.
``--task-style long`` is the shape of reasoning workloads instead: a ~29-token prompt (one-line instruction, three
operands, no worked example) and completions of ~160 tokens on average, scored on a closing "answer is N"
sentence (see ``kvroll.trainers.arithmetic``), so 25% of the completion length (~40) keeps the prompt whole and
compresses what the model generates. Each policy's run is saved as ``<out>/<policy>.json`` (log history,
reward curve, mismatch statistics), so policies may run in separate invocations; every invocation then redraws
``reward_curves.png`` and ``summary.md``/``summary.json`` from all the runs in ``--out``.
Goal: compressed rollouts reach >= 97% of the full-rollout final reward.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

MISMATCH_KEYS = {  # log-history key -> how to reduce it over steps
    "sampling/sampling_logp_difference/mean": "mean", "sampling/sampling_logp_difference/max": "max",
    "sampling/importance_sampling_ratio/mean": "mean", "sampling/importance_sampling_ratio/min": "min",
    "sampling/importance_sampling_ratio/max": "max", "kvroll/is_masked_fraction": "mean",
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policies", default="full,rkv,longflow", help="comma list; 'full' first sets the budget")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--max-completion-length", type=int, default=256)
    p.add_argument("--budget", type=int, default=None, help="compressed budget (default: a fraction of full's)")
    p.add_argument("--budget-fraction", type=float, default=0.25)
    p.add_argument("--budget-base", choices=("none", "prompt"), default="none",
                   help="'none': budget = fraction x completion length (prompts longer than that are compressed "
                        "too); 'prompt': the longest prompt + fraction x completion length")
    p.add_argument("--policy-kwargs", type=json.loads, default={},
                   help='JSON {policy: {hyperparameter: value}}, e.g. \'{"rkv": {"buffer": 16}}\' (R-KV compresses '
                        "every `buffer` tokens; its paper default 128 may never fill in short completions)")
    p.add_argument("--learning-rate", type=float, default=1e-5)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--task-size", type=int, default=1024)
    p.add_argument("--task-max-operand", type=int, default=99)
    p.add_argument("--task-ops", default="+")
    p.add_argument("--task-style", choices=("short", "long"), default="short",
                   help="'short': the main job's task (answer tags taught by a worked example, ~120-token prompt); "
                        "'long': a ~29-token prompt and long explanations scored on 'answer is N'")
    p.add_argument("--task-operands", type=int, default=None, help="operands per problem (default 2 short, 3 long)")
    p.add_argument("--reasoning", action=argparse.BooleanOptionalAction, default=True,
                   help="short style: ask for worked answers (longer completions); --no-reasoning for the main "
                        "job's prompt (ignored with --task-style long)")
    p.add_argument("--final-window", type=int, default=10, help="steps averaged into the final reward")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--out", default="docs/benchmarks/grpo_fidelity")
    p.add_argument("--plot-only", action="store_true")
    return p.parse_args(argv)


def budget_for(policy: str, opts, out: Path) -> int | None:
    if policy == "full":
        return None
    if opts.budget is not None:
        return opts.budget
    full = out / "full.json"
    if not full.is_file():
        raise SystemExit(f"no --budget and no {full}: run --policies full first (or pass --budget)")
    full_run = json.loads(full.read_text())
    budget = math.floor(opts.budget_fraction * full_run["mean_completion_length"])
    if opts.budget_base == "prompt":  # keep every prompt whole; compress only the generated part
        budget += full_run["max_prompt_length"]
    budget = max(2, budget)
    if budget < full_run["max_prompt_length"]:
        print(f"note: budget {budget} < the longest prompt ({full_run['max_prompt_length']} tokens): prompts are "
              "compressed at prefill too", flush=True)
    return budget


def run_policy(policy: str, opts, out: Path) -> dict:
    from transformers import TrainerCallback

    from kvroll.trainers import GRPOConfig, GRPOTrainer
    from kvroll.trainers.arithmetic import arithmetic_dataset, reward_funcs

    budget = budget_for(policy, opts, out)
    on_gpu = opts.device.startswith("cuda")
    rows = opts.prompts_per_step * opts.generations
    args = GRPOConfig(
        output_dir=str(out / f"run_{policy}"), max_steps=opts.steps, per_device_train_batch_size=rows,
        num_generations=opts.generations, max_completion_length=opts.max_completion_length,
        learning_rate=opts.learning_rate, temperature=opts.temperature, beta=0.0, logging_steps=1,
        report_to="none", save_strategy="no", seed=opts.seed, data_seed=opts.seed, use_cpu=not on_gpu,
        bf16=on_gpu, use_kvroll=True, kvroll_policy=policy, kvroll_budget=budget,
        kvroll_policy_kwargs=opts.policy_kwargs.get(policy, {}), disable_tqdm=True)
    dataset = arithmetic_dataset(opts.task_size, opts.seed, opts.task_max_operand, opts.task_ops,
                                 reasoning=opts.reasoning and opts.task_style == "short", style=opts.task_style,
                                 operands=opts.task_operands)
    trainer = GRPOTrainer(model=opts.model, reward_funcs=reward_funcs(opts.task_style), args=args,
                          train_dataset=dataset)
    tok = trainer.processing_class
    max_prompt = max(len(tok.apply_chat_template(row["prompt"], add_generation_prompt=True, return_dict=False))
                     for row in dataset)
    start = time.time()

    def write(complete: bool) -> dict:
        result = policy_result(policy, budget, opts, trainer.state.log_history, max_prompt, time.time() - start,
                               complete)
        (out / f"{policy}.json").write_text(json.dumps(result, indent=1))
        return result

    class EveryStep(TrainerCallback):  # a timeout keeps every finished step
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                write(complete=False)

    trainer.add_callback(EveryStep())
    trainer.train()
    result = write(complete=True)
    print(f"{policy}: budget {budget}, final reward {result['final_reward']:.3f}, "
          f"mean |dlogp| {result['mismatch']['sampling/sampling_logp_difference/mean']}, "
          f"{result['seconds']:.0f} s", flush=True)
    return result


def policy_result(policy, budget, opts, log_history, max_prompt, seconds, complete) -> dict:
    """One policy's run: reward curve, final reward, completion length, mismatch statistics, raw log history."""
    from kvroll.trainers.arithmetic import reward_funcs

    format_name, correct_name = (f.__name__ for f in reward_funcs(opts.task_style))
    history = [h for h in log_history if "reward" in h]
    rewards = [h["reward"] for h in history]
    window = max(1, min(opts.final_window, len(rewards)))
    return {
        "policy": policy, "budget": budget, "policy_kwargs": opts.policy_kwargs.get(policy, {}),
        "steps": opts.steps, "steps_done": len(history), "complete": complete, "seconds": seconds,
        "rewards": rewards, "correct": [h.get(f"rewards/{correct_name}/mean") for h in history],
        "format": [h.get(f"rewards/{format_name}/mean") for h in history],
        "completion_lengths": [h.get("completions/mean_length") for h in history],
        "final_reward": sum(rewards[-window:]) / window if rewards else None,
        "mean_completion_length": sum(h["completions/mean_length"] for h in history) / max(1, len(history)),
        "max_prompt_length": max_prompt,
        "kv_cache_mib": history[-1].get("kvroll/kv_cache_mib") if history else None,
        "rollout_seconds_mean": _reduce([h.get("kvroll/rollout_seconds") for h in history], "mean"),
        "mismatch": {k: _reduce([h.get(k) for h in history], how) for k, how in MISMATCH_KEYS.items()},
        "config": {k: v for k, v in vars(opts).items()}, "log_history": log_history,
    }


def _reduce(values, how):
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return None
    return {"mean": sum(values) / len(values), "max": max(values), "min": min(values)}[how]


def summarize(out: Path, final_window: int = 10) -> dict:
    """Summary table, JSON and reward curves from every ``<policy>.json`` in ``out``.

    Final rewards are compared over the steps all runs finished (a run cut by a timeout shortens the comparison
    for all, so every policy is judged on the same steps); the table says how many that was.
    """
    runs = {}
    for path in sorted(out.glob("*.json")):
        run = json.loads(path.read_text())
        if path.name != "summary.json" and run.get("rewards"):
            runs[path.stem] = run
    if not runs:
        return {}
    common = min(len(r["rewards"]) for r in runs.values())
    window = max(1, min(final_window, common))
    finals = {name: sum(r["rewards"][common - window: common]) / window for name, r in runs.items()}
    full = finals.get("full")
    summary = {name: {"budget": r["budget"], "policy_kwargs": r.get("policy_kwargs", {}),
                      "steps_done": len(r["rewards"]), "steps_compared": common, "final_window": window,
                      "final_reward": finals[name], "vs_full": (finals[name] / full) if full else None,
                      "first_reward": sum(r["rewards"][:window]) / window,
                      "mean_completion_length": r["mean_completion_length"], "kv_cache_mib": r["kv_cache_mib"],
                      "rollout_seconds_mean": r["rollout_seconds_mean"], "seconds": r.get("seconds"),
                      **r["mismatch"]}
               for name, r in runs.items()}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    lines = [f"Final reward = mean over steps {common - window + 1}-{common} (the last {window} of the {common} "
             "steps every run finished); first = mean over the first steps, same window.", "",
             "| policy | budget | steps | first -> final reward | vs full (goal >= 0.97) | mean completion len | "
             "mean abs dlogp | IS ratio mean [min, max] | IS masked | s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, s in summary.items():
        budget = f"{s['budget']} {json.dumps(s['policy_kwargs'])}" if s["policy_kwargs"] else s["budget"]
        lines.append(f"| {name} | {budget} | {s['steps_done']} | {s['first_reward']:.3f} -> {s['final_reward']:.3f} | "
                     f"{_fmt(s['vs_full'])} | {s['mean_completion_length']:.0f} | "
                     f"{_fmt(s['sampling/sampling_logp_difference/mean'])} | "
                     f"{_fmt(s['sampling/importance_sampling_ratio/mean'])} "
                     f"[{_fmt(s['sampling/importance_sampling_ratio/min'])}, "
                     f"{_fmt(s['sampling/importance_sampling_ratio/max'])}] | "
                     f"{_fmt(s['kvroll/is_masked_fraction'])} | {_fmt(s['seconds'], 0)} |")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    _plot(runs, out / "reward_curves.png")
    print("\n".join(lines), flush=True)
    return summary


def _fmt(value, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _plot(runs: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in runs.items():
        steps = range(1, len(r["rewards"]) + 1)
        smooth = [sum(r["rewards"][max(0, i - 4): i + 1]) / len(r["rewards"][max(0, i - 4): i + 1])
                  for i in range(len(r["rewards"]))]
        kwargs = "".join(f", {k} {v}" for k, v in r.get("policy_kwargs", {}).items())
        label = name if r["budget"] is None else f"{name} (budget {r['budget']}{kwargs})"
        line, = ax.plot(steps, smooth, label=label)
        ax.plot(steps, r["rewards"], color=line.get_color(), alpha=0.25)
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("mean reward (format + correct), 5-step average")
    style = next(iter(runs.values())).get("config", {}).get("task_style", "short")
    ax.set_title(f"GRPO on SmolLM2-135M arithmetic ({style} task): full vs compressed-KV rollouts")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    opts = parse_args(argv)
    opts.device = opts.device or ("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    if not opts.plot_only:
        from kvroll.policies.registry import POLICIES

        policies = [p for p in opts.policies.split(",") if p]
        missing = [p for p in policies if p not in POLICIES]
        if missing:
            raise SystemExit(f"policies {missing} are not in kvroll's registry ({sorted(POLICIES)})")
        for policy in policies:
            run_policy(policy, opts, out)
            summarize(out, opts.final_window)  # a later timeout keeps this
    return summarize(out, opts.final_window)


if __name__ == "__main__":
    main()
