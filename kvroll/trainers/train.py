"""``kvroll train``: GRPO, RLOO or PPO with compressed-KV rollouts on the offline arithmetic task (the main job).

    kvroll train --config configs/grpo_smollm2.yaml
    kvroll train --config configs/rloo_smollm2.yaml         # trainer: rloo (TRL's RLOOTrainer, RLOOConfig fields)
    kvroll train --config configs/ppo_smollm2.yaml          # trainer: ppo (kvroll's PPOTrainer, PPOConfig fields)
    kvroll train --config configs/grpo_smollm2.yaml --max_steps 20 --kvroll_policy longflow --kvroll_budget 32
    kvroll train --config configs/grpo_smollm2.yaml --resume   # continue from the last checkpoint in output_dir

Every ``GRPOConfig`` (``RLOOConfig``, ``PPOConfig``) field, TRL's and kvroll's, is a flat YAML key and a ``--flag``;
the task adds ``model`` and
``task_*``. Prints the rewards each step; saves checkpoints as ``save_strategy`` says, and at the end the model,
``log_history.json`` and ``metrics.jsonl`` (one line per logged step) to ``output_dir``, and renders them with
``kvroll report`` (``report.md`` + PNGs there).

The config file, every flag and YAML key, the model, the policy's name, ``output_dir`` and the checkpoint to resume
from (``--resume`` or TRL's ``resume_from_checkpoint``) are checked before torch and TRL load, so bad input costs a
fraction of a second (an abbreviated flag of a name read then, ``--output_d``, is refused: argparse would take it);
it and the configs' ``ValueError`` s (``kvroll_budget=-1``) are one line with exit status 2. A Ray cluster that
cannot be joined or cannot hold the workers (``kvroll_mode: ray``) is one line with exit status 1. Ctrl-C stops with
one line saying at which step and what was kept (exit status 130).
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import difflib
import importlib.util
import json
import os
import re
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path

from kvroll.usage import (UsageError, check_model, check_policy_names, check_writable_dir, close_progress_bars,
                          interrupted, read_yaml)
from kvroll.files import exclusive, move_to_previous

CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")  # transformers' checkpoint folders
# the names check_inputs reads from argv before TRL's parser (flag_value: exact spellings only); --trainer's
# abbreviation is refused after the parse, naming the trainer it gave
READ_BEFORE_PARSING = ("config", "model", "output_dir", "value_model_name_or_path", "resume_from_checkpoint")


@dataclass
class TaskArguments:
    """What to train and on which generated problems."""

    model: str = field(default="smollm2", metadata={"help": "'smollm2' (embedded) or a local HF model directory."})
    task_size: int = field(default=256, metadata={"help": "Number of generated arithmetic problems."})
    task_seed: int = field(default=0, metadata={"help": "Seed of the problem generator."})
    task_max_operand: int = field(default=20, metadata={"help": "Operands are drawn from [0, task_max_operand]."})
    task_reasoning: bool = field(default=False, metadata={"help": "Ask for worked (longer) answers (short style)."})
    task_ops: str = field(default="+", metadata={"help": "Operators to draw from, a string of '+', '-', '*'."})
    task_style: str = field(default="short", metadata={
        "help": "'short': a worked example in the prompt, answers of tens of tokens, scored on <answer>N</answer>; "
                "'long': a ~30-token prompt, explanations of 100+ tokens, scored on 'answer is N'."})
    trainer: str = field(default="grpo", metadata={"help": "'grpo' (TRL's GRPOTrainer), 'rloo' (TRL's RLOOTrainer) "
                                                           "or 'ppo' (kvroll's PPOTrainer); picks the config fields "
                                                           "the parser reads."})

    def __post_init__(self):
        from kvroll.checks import plain
        from kvroll.trainers.arithmetic import STYLES, check_problem_args  # no torch: before the heavy imports

        if self.task_style not in STYLES:
            raise ValueError(f"task_style={self.task_style!r} is invalid: use one of {', '.join(STYLES)}.")
        check_problem_args(self.task_size, self.task_max_operand, self.task_ops, prefix="task_")
        for name in ("task_size", "task_max_operand", "task_seed"):  # numpy integers as Python ints
            setattr(self, name, plain(getattr(self, name)))
        if self.task_style == "long" and self.task_reasoning:
            raise ValueError("task_reasoning=True applies to task_style='short' only (the long style always asks "
                             "for explanations); drop task_reasoning or use task_style: short.")


# The dataclasses TRL's parser reads for each trainer, bases included, as (package, file, class). Their fields are
# read from the source, so that a mistyped flag or YAML key is refused before torch and TRL import (seconds);
# tests/trainers/test_train_cli.py checks these names against dataclasses.fields of the real configs.
CONFIG_SOURCES = {
    "grpo": (("transformers", "training_args.py", "TrainingArguments"), ("trl", "trainer/base_config.py", "_BaseConfig"),
             ("trl", "trainer/grpo_config.py", "GRPOConfig"), ("kvroll", "trainers/args.py", "KVRollArguments"),
             ("kvroll", "trainers/grpo.py", "GRPOConfig")),
    "rloo": (("transformers", "training_args.py", "TrainingArguments"), ("trl", "trainer/base_config.py", "_BaseConfig"),
             ("trl", "trainer/rloo_config.py", "RLOOConfig"), ("kvroll", "trainers/args.py", "KVRollArguments"),
             ("kvroll", "trainers/rloo.py", "RLOOConfig")),
    "ppo": (("transformers", "training_args.py", "TrainingArguments"), ("kvroll", "trainers/args.py", "KVRollArguments"),
            ("kvroll", "trainers/ppo_config.py", "PPOConfig")),
}
# kvroll's config class of each trainer is its sources' last (in kvroll.trainers, beside its XTrainer)
CONFIG_CLASSES = {name: sources[-1][2] for name, sources in CONFIG_SOURCES.items()}
TRAINER_CLASSES = {name: config.replace("Config", "Trainer") for name, config in CONFIG_CLASSES.items()}


def add_train_parser(subparsers) -> None:
    """Register ``kvroll train``; everything after ``train`` goes to TRL's parser (``--config file.yaml``, flags)."""
    p = subparsers.add_parser("train", help="GRPO, RLOO or PPO with compressed-KV rollouts (kvroll train --config "
                                            "FILE.yaml)",
                              add_help=False, prefix_chars="\0")  # no options of its own: TRL's parser reads them
    p.add_argument("train_args", nargs=argparse.REMAINDER)
    # past its checks a ValueError is a bug, not bad input: kvroll.cli.main keeps its traceback
    p.set_defaults(func=lambda ns: main(ns.train_args), usage_errors_only=True)


def build_parser(trainer: str = "grpo"):
    """TRL's parser over (TaskArguments, GRPOConfig, RLOOConfig or PPOConfig); without CUDA it defaults to CPU and
    fp32."""
    import torch
    from trl import TrlParser

    import kvroll.trainers

    parser = TrlParser((TaskArguments, getattr(kvroll.trainers, CONFIG_CLASSES[trainer])), prog="kvroll train")
    if not torch.cuda.is_available():
        parser.set_defaults(use_cpu=True, bf16=False)  # TRL defaults to bf16, which a CPU runs as slow autocast
    # for --help only: main takes --resume out of argv first (split_resume); SUPPRESS sets no attribute, so the
    # parser returns the two dataclasses alone
    parser.add_argument("--resume", nargs="?", const="", default=argparse.SUPPRESS, metavar="CHECKPOINT",
                        help="continue from CHECKPOINT, or without one from the newest checkpoint-N in "
                             "output_dir (the trainer's resume_from_checkpoint)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Check the input (no torch yet), parse it with TRL's parser, train; bad input raises ``UsageError``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    argv = [part for arg in argv for part in (arg.split("=", 1) if arg.startswith("--config=") else [arg])]
    argv, resume = split_resume(argv)
    if "--help" not in argv and "-h" not in argv:
        resume = check_inputs(argv, resume)
    parser = build_parser(trainer_name(argv))
    parser.error = lambda message: _refuse(message)  # one line, not argparse's usage of every TRL flag
    try:
        task, args = parser.parse_args_and_config(argv)
    except ValueError as err:  # the configs' __post_init__ checks (kvroll_policy='nope', kvroll_budget=-1, ...)
        raise UsageError(str(err)) from None
    if task.trainer != trainer_name(argv):  # e.g. an abbreviated --trainer, which trainer_name() does not read
        raise UsageError(f"trainer={task.trainer!r} was given as an abbreviated flag; spell it --trainer "
                         f"{task.trainer} (the config fields are chosen before parsing).")
    with contextlib.ExitStack() as stack:
        if os.environ.get("RANK", "0") == "0":  # one lock per run: its first rank's (torchrun / accelerate set RANK)
            try:  # a second run into this output_dir would move this one's checkpoints to previous-* under it
                stack.enter_context(exclusive(Path(args.output_dir), "kvroll train", "output_dir"))
            except ValueError as err:
                raise UsageError(str(err)) from None
        return train(task, args, resume)


def _refuse(message: str):
    raise UsageError(message)


def split_resume(argv: list[str]) -> tuple[list[str], str | None]:
    """Take ``--resume [CHECKPOINT]`` out of ``argv``: '' for the last checkpoint in output_dir, None without it."""
    rest, resume, i = [], None, 0
    while i < len(argv):
        if argv[i] == "--resume":
            has_path = i + 1 < len(argv) and not argv[i + 1].startswith("--")
            resume, i = (argv[i + 1] if has_path else ""), i + (2 if has_path else 1)
            continue
        if argv[i].startswith("--resume="):
            resume = argv[i].split("=", 1)[1]
        else:
            rest.append(argv[i])
        i += 1
    return rest, resume


def trainer_name(argv: list[str] | None, config: dict | None = None) -> str:
    """``--trainer`` from the command line, else the ``trainer`` key of the ``--config`` YAML, else 'grpo'."""
    argv = list(sys.argv[1:] if argv is None else argv)
    name = flag_value(argv, "trainer")
    if name is None:
        if config is None and flag_value(argv, "config") is not None:
            config = read_yaml("--config", flag_value(argv, "config"))
        name = (config or {}).get("trainer")
    name = name or "grpo"
    if not isinstance(name, str) or name not in CONFIG_SOURCES:
        raise UsageError(f"trainer={name!r} is invalid; choose 'grpo', 'rloo' or 'ppo'.")
    return name


def flag_value(argv: list[str], name: str) -> str | None:
    """The value of ``--name VALUE`` / ``--name=VALUE`` (or the dashed spelling) in ``argv``, the last one wins."""
    value = None
    for i, arg in enumerate(argv):
        key, eq, rest = arg.partition("=")
        if key in (f"--{name}", f"--{name.replace('_', '-')}"):
            value = rest if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    return value


def check_inputs(argv: list[str], resume: str | None) -> str | None:
    """Everything checkable before torch loads; returns the checkpoint to resume from (None: start afresh)."""
    if argv and not argv[0].startswith("-"):  # kvroll train configs/x.yaml: TRL's parser would refuse it seconds later
        hint = f"--config {argv[0]}" if argv[0].endswith((".yaml", ".yml")) else f"--FIELD {argv[0]}"
        raise UsageError(f"{argv[0]!r} is not an option: kvroll train takes no positional argument; did you mean "
                         f"{hint}?")
    config_path = flag_value(argv, "config")
    config = read_yaml("--config", config_path) if config_path is not None else {}
    trainer = trainer_name(argv, config)
    names = config_fields(trainer)
    if names is not None:  # a source not found: TRL's parser checks the names instead, a few seconds later
        check_names(argv, config, config_path, names, trainer)
    model, output_dir = (flag_value(argv, name) or config.get(name) for name in ("model", "output_dir"))
    check_model(_source(argv, config_path, "model"), str(model or "smollm2"))
    policy = flag_value(argv, "kvroll_policy") or config.get("kvroll_policy")
    if policy is not None:
        check_policy_names(_source(argv, config_path, "kvroll_policy"), policy)
    value_model = flag_value(argv, "value_model_name_or_path") or config.get("value_model_name_or_path")
    if trainer == "ppo" and value_model:
        check_model(_source(argv, config_path, "value_model_name_or_path"), str(value_model), tokenizer=False)
    output_dir = str(output_dir or "trainer_output")  # TrainingArguments' default
    check_writable_dir(_source(argv, config_path, "output_dir"), output_dir)
    if resume is None:  # TRL's own field: a checkpoint path, or true (YAML) for the last one in output_dir
        given = flag_value(argv, "resume_from_checkpoint")
        given = given if given is not None else config.get("resume_from_checkpoint")
        if given is True or str(given).lower() == "true":
            resume = ""
        elif given not in (None, False, "") and str(given).lower() not in ("false", "none", "null"):
            if not (Path(str(given)) / "trainer_state.json").is_file():
                raise UsageError(f"{_source(argv, config_path, 'resume_from_checkpoint')} {given} is not a "
                                 "checkpoint folder (it has no trainer_state.json); pass a checkpoint-N folder, "
                                 "or --resume alone for the last one in output_dir.")
            resume = str(given)
    return resume_checkpoint(resume, output_dir)


def _source(argv: list[str], config_path: str | None, name: str) -> str:
    """How an error names where a value came from: ``--model`` or ``configs/x.yaml: model``."""
    return f"--{name}" if flag_value(argv, name) is not None or config_path is None else f"{config_path}: {name}"


def check_names(argv: list[str], config: dict, config_path: str | None, names: set[str], trainer: str) -> None:
    """Every YAML key and ``--flag`` is a field (a flag may be abbreviated or spelled with dashes, as argparse)."""
    where = f"{CONFIG_CLASSES[trainer]} or TaskArguments"
    for key in config:
        if key not in names and key != "env":  # env: TRL's parser sets those environment variables
            raise UsageError(f"--config {config_path}: unknown key {key!r}, not a field of {where}"
                             f"{_did_you_mean(key, names, '') or '.'}")
    options = {"config", "help"} | {spelling for name in names for spelling in
                                    (name, f"no_{name}", name.replace("_", "-"), f"no-{name.replace('_', '-')}")}
    for arg in argv:
        key = arg.partition("=")[0][2:]
        if not (arg.startswith("--") and key):
            continue
        matches = {option.replace("-", "_") for option in options if option.startswith(key)}
        if not matches:
            raise UsageError(f"--{key} is not an option: not a field of {where} (kvroll train --help lists them)"
                             f"{_did_you_mean(key, names, '--') or '.'}")
        if key.replace("-", "_") not in matches and len(matches) == 1 and (name := matches.pop()) in \
                READ_BEFORE_PARSING:  # argparse would take the abbreviation; the checks above did not read it
            raise UsageError(f"--{key} abbreviates --{name}, which kvroll train reads before parsing; spell it "
                             f"--{name}.")


def _did_you_mean(key: str, names: set[str], prefix: str) -> str:
    close = difflib.get_close_matches(key.replace("-", "_"), sorted(names), n=1)
    return f"; did you mean {prefix}{close[0]}?" if close else ""


def config_fields(trainer: str) -> set[str] | None:
    """The field names TRL's parser will read for ``trainer``, from the sources; None if a source is not found."""
    names = {f.name for f in fields(TaskArguments)}
    for package, file, class_name in CONFIG_SOURCES[trainer]:
        spec = importlib.util.find_spec(package)  # a top-level package: found, not imported
        source = Path(spec.origin).parent / file if spec and spec.origin else None
        try:
            tree = ast.parse(source.read_text(encoding="utf-8"))
        except (AttributeError, OSError, SyntaxError):
            return None
        body = next((node.body for node in tree.body if isinstance(node, ast.ClassDef) and node.name == class_name),
                    None)
        if body is None:
            return None
        names |= {node.target.id for node in body if isinstance(node, ast.AnnAssign)
                  and isinstance(node.target, ast.Name) and _is_init_field(node)}
    return names


def _is_init_field(node: ast.AnnAssign) -> bool:
    """False for ``ClassVar`` annotations and ``field(init=False)``, which the parser does not read."""
    if "ClassVar" in ast.unparse(node.annotation):
        return False
    keywords = node.value.keywords if isinstance(node.value, ast.Call) else []
    return not any(k.arg == "init" and isinstance(k.value, ast.Constant) and k.value.value is False for k in keywords)


def resume_checkpoint(resume: str | None, output_dir: str) -> str | None:
    """``--resume`` alone: the last ``checkpoint-N`` in output_dir; ``--resume PATH``: that checkpoint."""
    if resume is None:
        return None
    if resume == "":
        last = last_checkpoint(Path(output_dir))
        if last is None:
            raise UsageError(f"--resume: output_dir {output_dir} holds no checkpoint-N folder to continue from; "
                             "checkpoints are saved every save_steps steps with save_strategy: steps.")
        return str(last)
    if not (Path(resume) / "trainer_state.json").is_file():
        raise UsageError(f"--resume {resume} is not a checkpoint folder (it has no trainer_state.json); pass a "
                         "checkpoint-N folder, or --resume alone for the last one in output_dir.")
    return resume


def last_checkpoint(output_dir: Path) -> Path | None:
    """The newest complete ``checkpoint-N`` in output_dir. transformers writes ``trainer_state.json`` last: a folder
    without it is one a run was killed while saving (resuming from it fails inside transformers), so it is skipped,
    said on stderr."""
    steps = {int(m.group(1)): p for p in (output_dir.iterdir() if output_dir.is_dir() else [])
             if p.is_dir() and (m := CHECKPOINT.match(p.name))}
    for step in sorted(steps, reverse=True):
        if (steps[step] / "trainer_state.json").is_file():
            return steps[step]
        print(f"kvroll train: {steps[step]} has no trainer_state.json (a run stopped while saving it); skipped",
              file=sys.stderr, flush=True)
    return None


EARLIER_RUN_FILES = ("metrics.jsonl", "log_history.json", "run.json", "report.md", "reward.png", "tokens_per_s.png",
                     "completion_lengths.png", "mismatch.png")


def keep_previous_run(output_dir: Path) -> Path | None:
    """A fresh run into an output_dir that holds an earlier run's checkpoints or logs: those move to
    ``output_dir/previous-<UTC time>/`` (said on stderr), so that ``--resume`` continues this run, not the earlier
    one, and the earlier run's logs are not truncated. Returns that folder, or None when there was nothing."""
    found = [p for p in (output_dir.iterdir() if output_dir.is_dir() else [])
             if (p.is_dir() and CHECKPOINT.match(p.name)) or (p.is_file() and p.name in EARLIER_RUN_FILES)]
    return move_to_previous(output_dir, found, "kvroll train", "an earlier run")


def train(task: TaskArguments, args, resume: str | None = None) -> int:
    import kvroll.trainers
    from kvroll.trainers.arithmetic import arithmetic_dataset, reward_funcs
    from kvroll.trainers.train_log import InterruptGuard, RewardPrinter

    dataset = arithmetic_dataset(task.task_size, task.task_seed, task.task_max_operand, task.task_ops,
                                 task.task_reasoning, style=task.task_style)
    trainer_cls = getattr(kvroll.trainers, TRAINER_CLASSES[task.trainer])
    try:
        trainer = trainer_cls(model=task.model, reward_funcs=reward_funcs(task.task_style), args=args,
                              train_dataset=dataset)
    except ValueError as err:  # input the trainer refuses as it sets up (e.g. the model's architecture)
        raise UsageError(str(err)) from err
    if resume is None and isinstance(args.resume_from_checkpoint, str) and args.resume_from_checkpoint:
        resume = args.resume_from_checkpoint  # train() called without main's checks
    resume_step = CHECKPOINT.match(Path(resume).name) if resume else None
    if resume is None and trainer.accelerator.is_main_process:
        keep_previous_run(Path(args.output_dir))
    trainer.accelerator.wait_for_everyone()  # the other ranks write into output_dir only once it is sorted
    printer = RewardPrinter(Path(args.output_dir), args.max_steps, int(resume_step.group(1)) if resume_step else None)
    trainer.add_callback(printer)
    if trainer.accelerator.is_main_process:
        rollout = (f"kvroll {args.kvroll_policy} budget {args.kvroll_budget}" if args.use_kvroll
                   else "TRL model.generate")
        # PPO rolls out rollout_batch_size rows a rank at once, then takes several optimizer steps on them
        rows, per = ((args.rollout_batch_size, "rollout") if task.trainer == "ppo"
                     else (args.per_device_train_batch_size, "step"))
        ranks = trainer.accelerator.num_processes
        print(f"kvroll train: {task.model}, {len(dataset)} problems, rollouts: {rollout}, "
              f"{rows} rows x {ranks} rank{'s' if ranks != 1 else ''} a {per}, "
              f"{task.trainer}, G={getattr(args, 'num_generations', 1)}, max_completion_length={args.max_completion_length}"
              + (f", resuming from {resume}" if resume else ""), flush=True)
        run_info = {"model": task.model, "trainer": task.trainer, "rollouts": rollout, "max_steps": args.max_steps,
                    "max_completion_length": args.max_completion_length, "task_style": task.task_style,
                    "task_reasoning": task.task_reasoning}
        if args.use_kvroll:
            run_info["kvroll_mode"] = args.kvroll_mode
            if args.kvroll_mode == "ray":
                run_info["kvroll_num_workers"] = args.kvroll_num_workers
        (Path(args.output_dir) / "run.json").write_text(json.dumps(run_info, indent=1))  # kvroll report's header
    from kvroll.rollout.cluster import ClusterError

    guard = InterruptGuard()
    trainer.add_callback(guard)
    try:
        with guard:
            trainer.train(resume_from_checkpoint=resume)
    except KeyboardInterrupt:
        return interrupted("train", stopped_at(trainer, printer, args))
    except ClusterError as err:  # kvroll_mode: ray, at the first sync: no cluster to join, or none big enough
        close_progress_bars()
        print(f"kvroll train: error: {' '.join(str(err).splitlines())}", file=sys.stderr, flush=True)
        return 1
    trainer.save_model(args.output_dir)
    if trainer.accelerator.is_main_process:
        (Path(args.output_dir) / "log_history.json").write_text(json.dumps(trainer.state.log_history, indent=1))
        if args.max_steps <= 0:  # run.json's max_steps: the steps the trainer computed from num_train_epochs
            info = json.loads((Path(args.output_dir) / "run.json").read_text())
            (Path(args.output_dir) / "run.json").write_text(json.dumps({**info, "max_steps": trainer.state.max_steps},
                                                                       indent=1))
        printer.summary()
        from kvroll.bench.run_report import write_run_report

        try:
            report = write_run_report(Path(args.output_dir))
        except UsageError as err:  # no step logged (logging_steps past max_steps; a resume at max_steps): trained
            print(f"kvroll train: no report.md: {err}", flush=True)
        else:
            print(f"kvroll train: report in {report}", flush=True)
    return 0


def stopped_at(trainer, printer, args) -> str:
    """Where an interrupted run stopped and what it kept (the logs are written here; the model is not saved)."""
    out = Path(args.output_dir)
    if trainer.accelerator.is_main_process:
        (out / "log_history.json").write_text(json.dumps(trainer.state.log_history, indent=1))
    last = last_checkpoint(out)
    strategy = getattr(args.save_strategy, "value", args.save_strategy)
    checkpoint = (f"last checkpoint {last} (continue with --resume)" if last else
                  f"no checkpoint yet (save_strategy={strategy}, save_steps={args.save_steps})")
    return (f"after step {trainer.state.global_step}/{trainer.state.max_steps or args.max_steps}; kept {printer.path} "
            f"({printer.logged_steps} logged steps), {out / 'log_history.json'}; {checkpoint}")


if __name__ == "__main__":
    from kvroll.cli import main as cli_main

    raise SystemExit(cli_main(["train", *sys.argv[1:]]))
