"""Learning fidelity: GRPO or PPO with full-KV rollouts against compressed ones (rkv, longflow), over seeds.

    PYTHONPATH=. python benchmarks/grpo_learning_fidelity.py --out runs/fid                 # full, rkv, longflow
    PYTHONPATH=. python benchmarks/grpo_learning_fidelity.py --trainer ppo --seed 1 --policies rkv \\
        --correction sparse_rl --budget 46 --out runs/fid                                   # one arm, one seed
    PYTHONPATH=. python benchmarks/grpo_learning_fidelity.py --policies full,rkv,rkv+sparse_rl --out runs/fid
    PYTHONPATH=. python benchmarks/grpo_learning_fidelity.py --summary --out runs/fid      # aggregate over seeds
    PYTHONPATH=. python benchmarks/grpo_learning_fidelity.py --task-style long --task-max-operand 9 \\
        --max-completion-length 384 --budget-base none --out /tmp/fid_long   # short prompt, long completions
    PYTHONPATH=. python benchmarks/grpo_learning_fidelity.py --model /tmp/tiny --steps 2 --max-completion-length 16 \\
        --prompts-per-step 2 --generations 4 --device cpu --out /tmp/fid   # CPU smoke (--trainer ppo too)

The embedded model (SmolLM2-135M-Instruct) learns kvroll's arithmetic task (format + exact-match rewards) with
GRPO or kvroll's PPO, rollouts from kvroll's engine with importance-sampling correction. An *arm* is a policy plus
a correction: ``rkv`` (TRL's IS correction as configured, default ``sequence_mask``) or ``rkv+sparse_rl``
(``kvroll_correction="sparse_rl"``: rejection of anomalous rollouts, then ``token_truncate`` reweighting), given in
``--policies`` or with ``--correction`` for all of them. Runs with the same ``--seed`` share data order, sampling
seeds and initial weights; only the rollout cache (and correction) differs. A step is one rollout of
``--prompts-per-step x --generations`` completions: GRPO's groups, or as many distinct prompts with one completion
each for PPO, which then takes ``--ppo-epochs`` optimizer steps over them (KL to the reference: ``--kl-coef``,
default 0 for both trainers, as GRPO's ``beta=0``; PPO uses a value head shared with the policy).
``--micro-batch`` rows go through the model at once (gradient accumulation up to the rollout batch), which bounds
the training memory when many runs share a GPU.

The compressed budget is ``--budget``, or ``floor(--budget-fraction x`` the mean completion length of the ``full``
run of the same trainer and seed``)`` (so run ``full`` first; it is read back from ``--out``), plus the longest
prompt with ``--budget-base prompt``. ``--task-style long`` is the shape of reasoning workloads: a ~29-token prompt
and completions of ~160 tokens on average, scored on a closing "answer is N" sentence
(``kvroll.trainers.arithmetic``), so 25% of the completion length (~40) keeps the prompt whole and compresses
what the model generates; ``short`` is the main job's older task (answer tags, ~120-token prompt).

Each run is saved as ``<out>/<trainer>-<policy>-<correction>-s<seed>.json`` (rewards, per-step mismatch
statistics, the log history) after every step, so a run killed by a timeout keeps the steps it finished. Every
invocation then (and ``--summary`` alone) aggregates all runs in ``--out`` over seeds (``kvroll/bench/
fidelity_seeds.py``): ``summary_<trainer>.md`` / ``.json`` and ``reward_curves_<trainer>.png``, compared on the
steps every run of the trainer finished. Goal: compressed rollouts reach >= 97% of the full-rollout final reward.
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
    "kvroll/rejected_fraction": "mean", "kvroll/rejection_statistic/mean": "mean",
    "kvroll/rejection_statistic/max": "max",
}
TRAINERS = ("grpo", "ppo")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trainer", choices=TRAINERS, default="grpo")
    p.add_argument("--policies", default="full,rkv,longflow",
                   help="comma list of arms: a policy, or policy+correction (e.g. rkv+sparse_rl); 'full' first "
                        "sets the budget")
    p.add_argument("--correction", choices=("none", "sparse_rl"), default="none",
                   help="kvroll_correction of the arms given without one")
    p.add_argument("--rejection-statistic", default=None, help="kvroll_rejection_statistic (default: kvroll's)")
    p.add_argument("--rejection-threshold", type=float, default=None,
                   help="kvroll_rejection_threshold (default: kvroll's)")
    p.add_argument("--is-mode", default=None,
                   help="vllm_importance_sampling_mode of every arm (default: the trainer's, sequence_mask; "
                        "token_truncate for sparse_rl arms)")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--steps", type=int, default=60, help="rollout steps (reward points) per run")
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=None,
                   help="rows per forward/backward (default: the whole rollout batch)")
    p.add_argument("--ppo-epochs", type=int, default=2, help="PPO: optimizer steps per rollout")
    p.add_argument("--kl-coef", type=float, default=0.0, help="KL penalty to the initial policy (GRPO beta, PPO "
                                                              "kl_coef)")
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
    p.add_argument("--summary", "--plot-only", dest="summary", action="store_true",
                   help="only aggregate the runs in --out (no training)")
    p.add_argument("--no-summary", action="store_true",
                   help="train only (when several processes share --out, one --summary call at the end)")
    opts = p.parse_args(argv)
    rows = opts.prompts_per_step * opts.generations
    opts.micro_batch = opts.micro_batch or rows
    if rows % opts.micro_batch:
        p.error(f"--micro-batch {opts.micro_batch} must divide the rollout batch ({rows} rows)")
    return opts


def arms(opts) -> list[tuple[str, str]]:
    """(policy, correction) of each entry of --policies."""
    out = []
    for entry in filter(None, opts.policies.split(",")):
        policy, _, correction = entry.partition("+")
        out.append((policy, correction or opts.correction))
    return out


def run_path(out: Path, trainer: str, policy: str, correction: str, seed: int) -> Path:
    return out / f"{trainer}-{policy}-{correction}-s{seed}.json"


def budget_for(policy: str, opts, out: Path) -> int | None:
    if policy == "full":
        return None
    if opts.budget is not None:
        return opts.budget
    full = run_path(out, opts.trainer, "full", "none", opts.seed)
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


def kvroll_fields(policy: str, correction: str, budget, opts) -> dict:
    """The kvroll (and importance-sampling) fields of one arm's config."""
    fields = dict(use_kvroll=True, kvroll_policy=policy, kvroll_budget=budget,
                  kvroll_policy_kwargs=opts.policy_kwargs.get(policy, {}), kvroll_correction=correction)
    if opts.rejection_statistic is not None:
        fields["kvroll_rejection_statistic"] = opts.rejection_statistic
    if opts.rejection_threshold is not None:
        fields["kvroll_rejection_threshold"] = opts.rejection_threshold
    mode = opts.is_mode or ("token_truncate" if correction == "sparse_rl" else None)
    if mode is not None:
        fields["vllm_importance_sampling_mode"] = mode
    return fields


def build_trainer(policy: str, correction: str, budget, opts, out: Path):
    """The GRPO or PPO trainer of one arm (the same seed, data and initial weights for every arm)."""
    from transformers import set_seed

    from kvroll.trainers.arithmetic import arithmetic_dataset, reward_funcs

    set_seed(opts.seed)  # PPO's value head is initialised before the Trainer seeds itself
    on_gpu = opts.device.startswith("cuda")
    rows = opts.prompts_per_step * opts.generations
    common = dict(output_dir=str(out / f"run_{opts.trainer}_{policy}_{correction}_s{opts.seed}"),
                  per_device_train_batch_size=opts.micro_batch, gradient_accumulation_steps=rows // opts.micro_batch,
                  max_completion_length=opts.max_completion_length, learning_rate=opts.learning_rate,
                  temperature=opts.temperature, logging_steps=1, report_to="none", save_strategy="no",
                  seed=opts.seed, data_seed=opts.seed, use_cpu=not on_gpu, bf16=on_gpu, disable_tqdm=True,
                  **kvroll_fields(policy, correction, budget, opts))
    dataset = arithmetic_dataset(opts.task_size, opts.seed, opts.task_max_operand, opts.task_ops,
                                 reasoning=opts.reasoning and opts.task_style == "short", style=opts.task_style,
                                 operands=opts.task_operands)
    rewards = reward_funcs(opts.task_style)
    if opts.trainer == "grpo":
        from kvroll.trainers import GRPOConfig, GRPOTrainer

        args = GRPOConfig(max_steps=opts.steps, num_generations=opts.generations, beta=opts.kl_coef, **common)
        return GRPOTrainer(model=opts.model, reward_funcs=rewards, args=args, train_dataset=dataset), dataset
    from kvroll.trainers import PPOConfig, PPOTrainer

    args = PPOConfig(max_steps=opts.steps * opts.ppo_epochs, rollout_batch_size=rows, num_ppo_epochs=opts.ppo_epochs,
                     kl_coef=opts.kl_coef, shared_value_head=True, **common)
    return PPOTrainer(model=opts.model, reward_funcs=rewards, args=args, train_dataset=dataset), dataset


def run_arm(policy: str, correction: str, opts, out: Path) -> dict:
    from transformers import TrainerCallback

    from kvroll.bench.report import write_json

    budget = budget_for(policy, opts, out)
    trainer, dataset = build_trainer(policy, correction, budget, opts, out)
    tok = trainer.processing_class
    max_prompt = max(len(tok.apply_chat_template(row["prompt"], add_generation_prompt=True, return_dict=False))
                     for row in dataset)
    path = run_path(out, opts.trainer, policy, correction, opts.seed)
    start = time.time()

    def write(complete: bool) -> dict:
        result = run_result(policy, correction, budget, opts, trainer.state.log_history, max_prompt,
                            time.time() - start, complete)
        write_json(path, result)  # a temporary file renamed: a kill mid-write leaves the previous step's file
        return result

    class EveryStep(TrainerCallback):  # a timeout keeps every finished step
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                write(complete=False)

    trainer.add_callback(EveryStep())
    trainer.train()
    result = write(complete=True)
    print(f"{opts.trainer} {result['arm']} seed {opts.seed}: budget {budget}, final reward "
          f"{result['final_reward']:.3f}, mean |dlogp| {result['mismatch']['sampling/sampling_logp_difference/mean']}"
          f", rejected {result['mismatch']['kvroll/rejected_fraction']}, {result['seconds']:.0f} s", flush=True)
    return result


def run_result(policy, correction, budget, opts, log_history, max_prompt, seconds, complete) -> dict:
    """One run: reward curve, final reward, completion length, mismatch statistics, raw log history."""
    from kvroll.bench.fidelity_seeds import arm_name, series_from_history
    from kvroll.trainers.arithmetic import reward_funcs

    format_name, correct_name = (f.__name__ for f in reward_funcs(opts.task_style))
    history = [h for h in log_history if "reward" in h]  # one entry per rollout
    rewards = [h["reward"] for h in history]
    window = max(1, min(opts.final_window, len(rewards)))
    return {
        "trainer": opts.trainer, "arm": arm_name(policy, correction), "policy": policy, "correction": correction,
        "seed": opts.seed, "budget": budget, "policy_kwargs": opts.policy_kwargs.get(policy, {}),
        "steps": opts.steps, "steps_done": len(history), "complete": complete, "seconds": seconds,
        "rewards": rewards, "correct": [h.get(f"rewards/{correct_name}/mean") for h in history],
        "format": [h.get(f"rewards/{format_name}/mean") for h in history],
        "completion_lengths": [h.get("completions/mean_length") for h in history],
        "series": series_from_history(log_history),
        "final_reward": sum(rewards[-window:]) / window if rewards else None,
        "mean_completion_length": _reduce([h.get("completions/mean_length") for h in history], "mean"),
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
    """Aggregate every run in ``out`` over seeds (``kvroll/bench/fidelity_seeds.py``) and print the tables."""
    from kvroll.bench.fidelity_seeds import markdown, summarize_runs

    summaries = summarize_runs(out, final_window)
    for trainer, summary in summaries.items():
        print(markdown(trainer, summary), flush=True)
    return summaries


def main(argv=None) -> dict:
    opts = parse_args(argv)
    opts.device = opts.device or ("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    if not opts.summary:
        from kvroll.policies.registry import POLICIES

        chosen = arms(opts)
        missing = [policy for policy, _ in chosen if policy not in POLICIES]
        if missing:
            raise SystemExit(f"policies {missing} are not in kvroll's registry ({sorted(POLICIES)})")
        for policy, correction in chosen:
            run_arm(policy, correction, opts, out)
            if not opts.no_summary:
                summarize(out, opts.final_window)  # a later timeout keeps this
    return {} if opts.no_summary else summarize(out, opts.final_window)


if __name__ == "__main__":
    main()
