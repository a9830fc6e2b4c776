"""Turning the switch on: checks made before TRL loads the model, and attaching the adapter after ``__init__``.

TRL 1.16 activates its rollout-backend path (weight-sync timing, rollout logprobs, GRPO's importance-sampling
correction and metrics) when the trainer attribute ``use_vllm`` is true; kvroll assigns its adapter to
``vllm_generation`` and sets the attributes that path reads (DESIGN.md §2.5).
"""
from __future__ import annotations

from pathlib import Path

from kvroll.config import CompressionConfig
from kvroll.model_dir import model_dir_problem
from kvroll.rollout.model import EMBEDDED, check_budget_fits, check_family, check_new_tokens, resolve
from kvroll.trainers.adapter import KVRollGeneration
from kvroll.trainers.args import validate_kvroll_args


def prepare(model, args, kwargs: dict):
    """Before the model loads: returns (model, CompressionConfig or None); ``"smollm2"`` becomes its local dir."""
    model = str(resolve(model)) if isinstance(model, str) and model == EMBEDDED else model
    if args is None or not getattr(args, "use_kvroll", False):
        return model, None
    compression = validate_kvroll_args(args)
    if kwargs.get("rollout_func") is not None:
        raise ValueError("use_kvroll=True and rollout_func are exclusive: a rollout_func replaces the generation "
                         "backend kvroll provides. Drop one of them.")
    check_tools(args, kwargs)
    if isinstance(model, str):
        from transformers import AutoConfig

        local = (Path(model) / "config.json").is_file()  # else a hub id or an adapter folder: TRL's to resolve
        problem = model_dir_problem(model, weights=False) if local else None
        if problem:  # a damaged config.json: transformers' OSError traceback
            raise ValueError(f"model={model!r} {problem}.")
        config = AutoConfig.from_pretrained(model, trust_remote_code=args.trust_remote_code)
    else:
        config = model.config
    check_family(config)
    problem = model_dir_problem(model) if isinstance(model, str) and local else None
    if problem:  # transformers' OSError traceback, once TRL loads the model
        raise ValueError(f"model={model!r} {problem}.")
    try:  # the engine checks it too, but only once the weights are loaded (ray mode: after a cluster started)
        check_budget_fits(config, compression)
    except ValueError as err:
        raise ValueError(f"Invalid kvroll settings for this model (kvroll_policy={args.kvroll_policy!r}, "
                         f"kvroll_budget={args.kvroll_budget!r}, kvroll_policy_kwargs={args.kvroll_policy_kwargs!r})"
                         f": {err}") from err
    try:  # 'full' past the positions (or a sliding window): the engine refused it only at the first rollout
        check_new_tokens(config, compression.policy, args.max_completion_length)
    except ValueError as err:
        raise ValueError(f"Invalid kvroll settings for this model (kvroll_policy={args.kvroll_policy!r}, "
                         f"max_completion_length={args.max_completion_length!r}): {err}".replace(
                             "lower max_new_tokens", "lower max_completion_length")) from err
    return model, compression


def check_tools(args, kwargs: dict) -> None:
    """Tools or an ``environment_factory`` in ray mode run on one process only. TRL's tool loop calls the backend's
    generate() again on the ranks that have tool calls, and only there; in ray mode rank 0 generates every rank's
    rows and broadcasts them, so on several processes the ranks' collectives would no longer match, and the run
    would fail or hang. (Colocate mode then generates each rank's rows on its own engine: ``KVRollGeneration``.)"""
    world = getattr(args, "world_size", 1)
    given = [name for name in ("tools", "environment_factory") if kwargs.get(name)]
    if given and world > 1 and getattr(args, "kvroll_mode", "colocate") == "ray":
        raise ValueError(f"use_kvroll=True with {' and '.join(given)} in kvroll_mode='ray' runs on one process "
                         f"only; this run has {world} processes (rank 0's pool serves every rank's rows, and TRL's "
                         "tool loop calls generate() on some ranks only). Use kvroll_mode='colocate' (each rank "
                         "generates its own rows), one process, or use_kvroll=False.")


def check_prompt_column(dataset) -> None:
    """Before the model loads: a dataset with columns (``datasets.Dataset``) has the 'prompt' column the trainer
    reads; one without them (an ``IterableDataset`` may lack ``column_names``) is read as it comes."""
    columns = getattr(dataset, "column_names", None)
    if isinstance(columns, list) and "prompt" not in columns:
        raise ValueError(f"train_dataset has no 'prompt' column (its columns: {columns}); the trainer reads each "
                         "row's prompt from it: rename yours, e.g. dataset.rename_column('question', 'prompt').")


def attach(trainer, compression: CompressionConfig) -> KVRollGeneration:
    """Route the trainer's generation through kvroll (TRL's ``use_vllm`` path with a duck-typed backend)."""
    generation = KVRollGeneration(trainer, compression)
    trainer.vllm_generation = generation
    trainer.use_vllm = True
    # "server" keeps TRL away from the colocated-vLLM internals (e.g. llm.llm_engine in the tool loop).
    trainer.vllm_mode = "server"
    trainer._last_loaded_step = -1
    return generation
