"""``kvroll train``: the arithmetic task, the shipped YAML config, a 2-step run on a tiny model directory, bad input
answered in one line before TRL loads, the configs' errors, Ctrl-C and ``--resume``."""
from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import pytest

from kvroll.policies.registry import POLICIES
from kvroll.trainers.arithmetic import arithmetic_problems, correctness_reward, format_reward
from kvroll.trainers.train import TaskArguments, build_parser, config_fields, main

from .tiny_model import tiny_llama, tokenizer

CONFIG = Path(__file__).parents[2] / "configs" / "grpo_smollm2.yaml"
RLOO_CONFIG = Path(__file__).parents[2] / "configs" / "rloo_smollm2.yaml"


def test_problems_are_reproducible_and_correct():
    problems = arithmetic_problems(50, seed=3, max_operand=9, ops="+-*")
    assert problems == arithmetic_problems(50, seed=3, max_operand=9, ops="+-*")
    for p in problems:
        a, op, b = p["question"].removeprefix("What is ").removesuffix("?").split()
        assert str(eval(f"{int(a)} {op} {int(b)}")) == p["answer"]


def test_rewards():
    completions = [[{"role": "assistant", "content": c}] for c in
                   ["3 + 4 = 7 so <answer>7</answer>", "<answer> 8 </answer>", "the answer is 7", "<answer>x</answer>"]]
    assert format_reward(completions) == [1.0, 1.0, 0.0, 0.0]
    assert correctness_reward(completions, answer=["7"] * 4) == [1.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("trainer", ["grpo", "ppo"])
def test_help_lists_resume_and_the_parser_still_returns_two_configs(trainer, capsys):
    with pytest.raises(SystemExit) as done:
        main(["--trainer", trainer, "--help"])
    assert done.value.code == 0
    assert "--resume [CHECKPOINT]" in capsys.readouterr().out
    assert len(build_parser(trainer).parse_args_and_config(["--config", str(CONFIG)] if trainer == "grpo" else [])) == 2


def test_shipped_config_parses():
    task, args = build_parser().parse_args_and_config(["--config", str(CONFIG)])
    assert task.model == "smollm2" and args.use_kvroll and args.kvroll_policy in POLICIES
    assert args.num_generations == 4 and args.per_device_train_batch_size % args.num_generations == 0


@pytest.mark.parametrize("trainer", ["grpo", "rloo", "ppo"])
def test_use_kvroll_from_yaml_and_flags_is_a_bool(tmp_path, trainer):
    """The configs refuse a use_kvroll that is not a bool; TRL's parser turns YAML's and the flags' spellings into
    bools first."""
    config = tmp_path / "c.yaml"
    config.write_text(f"trainer: {trainer}\nuse_kvroll: true\noutput_dir: {tmp_path}\nreport_to: none\n"
                      "per_device_train_batch_size: 4\n" + ("num_generations: 4\n" if trainer != "ppo" else ""))
    parser = build_parser(trainer)
    assert parser.parse_args_and_config(["--config", str(config)])[1].use_kvroll is True
    for flag, expected in (("false", False), ("True", True), ("no", False)):
        _, args = parser.parse_args_and_config(["--config", str(config), "--use_kvroll", flag])
        assert args.use_kvroll is expected


def test_rloo_runs_from_its_shipped_config(tmp_path, capsys):
    """``trainer: rloo`` (configs/rloo_smollm2.yaml) trains TRL's RLOOTrainer with kvroll's rollouts; a GRPO-only
    field is refused naming RLOOConfig, before TRL loads."""
    from kvroll.trainers import RLOOConfig, RLOOTrainer

    task, args = build_parser("rloo").parse_args_and_config(["--config", str(RLOO_CONFIG)])
    assert task.trainer == "rloo" and type(args) is RLOOConfig and args.use_kvroll and args.num_generations == 4
    code, err = _run(["--config", str(RLOO_CONFIG), "--vllm_importance_sampling_correction", "true"], capsys)
    assert code == 2 and "not a field of RLOOConfig or TaskArguments" in err[0]
    tok = tokenizer()
    model_dir = tmp_path / "tiny"
    tiny_llama(tok).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    out = tmp_path / "run"
    built = []
    real_init = RLOOTrainer.__init__

    def spy(self, *a, **kw):
        built.append(type(self))
        real_init(self, *a, **kw)

    import unittest.mock
    with unittest.mock.patch.object(RLOOTrainer, "__init__", spy):
        assert main(["--config", str(RLOO_CONFIG), "--model", str(model_dir), "--output_dir", str(out), "--max_steps",
                     "2", "--max_completion_length", "12", "--kvroll_budget", "16", "--task_size", "8"]) == 0
    assert built == [RLOOTrainer]
    printed = capsys.readouterr().out
    assert "rloo, G=4" in printed and "step   2/2  reward" in printed and "|dlogp|" not in printed
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all("kvroll/rollout_seconds" in r for r in rows)


def test_two_step_run_saves_model_and_logs(tmp_path, capsys):
    tok = tokenizer()
    model_dir = tmp_path / "tiny"
    tiny_llama(tok).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    out = tmp_path / "run"
    assert main(["--config", str(CONFIG), "--model", str(model_dir), "--output_dir", str(out), "--max_steps", "2",
                 "--max_completion_length", "12", "--kvroll_budget", "16", "--task_size", "8"]) == 0
    printed = capsys.readouterr().out
    assert "8 rows x 1 rank a step, grpo, G=4" in printed  # per_device_train_batch_size rows on one rank
    assert "step   1/2  reward" in printed and "step   2/2  reward" in printed and "done in" in printed
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    # the shipped config's long task: format and correctness read from "answer is N"
    assert all("rewards/final_answer_format_reward/mean" in r and "kvroll/rollout_seconds" in r for r in rows)
    assert "format " in printed and "correct " in printed
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    history = json.loads((out / "log_history.json").read_text())
    assert history[-1]["step"] == 2


def test_cli_routes_train_to_trl_parser():
    from kvroll.cli import build_parser

    ns = build_parser().parse_args(["train", "--config", str(CONFIG), "--max_steps", "3"])
    assert ns.command == "train" and ns.train_args == ["--config", str(CONFIG), "--max_steps", "3"]


# ---- bad input, config errors, Ctrl-C and --resume --------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny random model directory (the embedded tokenizer): kvroll train's model for the runs below."""
    tok = tokenizer()
    model_dir = tmp_path_factory.mktemp("tiny")
    tiny_llama(tok).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    return model_dir


def _run(argv: list[str], capsys) -> tuple[int, list[str]]:
    """``kvroll train ARGV``: (exit status, stderr lines); stdout stays in ``capsys``."""
    from kvroll.cli import main as kvroll

    code = kvroll(["train", *argv])
    captured = capsys.readouterr()
    print(captured.out, end="")
    return code, captured.err.splitlines()


@pytest.mark.parametrize("trainer, config_cls", [("grpo", "GRPOConfig"), ("rloo", "RLOOConfig"), ("ppo", "PPOConfig")])
def test_names_read_from_the_sources_are_the_parsers_fields(trainer, config_cls):
    import kvroll.trainers

    real = {f.name for cls in (TaskArguments, getattr(kvroll.trainers, config_cls)) for f in fields(cls) if f.init}
    assert config_fields(trainer) == real


@pytest.mark.parametrize("case, message", [
    ("missing", "--config {tmp}/missing.yaml does not exist"),
    ("yaml", "--config {tmp}/syntax.yaml is not valid YAML (expected ',' or ']'"),
    ("latin1", "--config {tmp}/latin1.yaml is not UTF-8 text"),
    ("list", "--config {tmp}/list.yaml must hold a mapping"),
    ("key", "--config {tmp}/key.yaml: unknown key 'max_stpes', not a field of GRPOConfig or TaskArguments; did you "
            "mean max_steps?"),
    ("flag", "--kvroll_budjet is not an option: not a field of GRPOConfig or TaskArguments (kvroll train --help "
             "lists them); did you mean --kvroll_budget?"),
    ("flag_far", "--zzzz is not an option: not a field of GRPOConfig or TaskArguments (kvroll train --help lists "
                 "them)."),
    ("value_model", "--value_model_name_or_path {tmp}/nope does not exist"),
    ("value_model_yaml", "{tmp}/ppo.yaml: value_model_name_or_path {tmp}/nope does not exist"),
    ("model_flag", "--model {tmp}/nope does not exist"),
    ("model_yaml", "{tmp}/model.yaml: model {tmp}/nope does not exist"),
    ("not_a_model", "--model {tmp} is not a Hugging Face model directory"),
    ("output_dir", "--output_dir {tmp}/file/run is not a writable directory: {tmp}/file is a file"),
    ("resume", "--resume: output_dir {tmp}/empty holds no checkpoint-N folder"),
    ("resume_path", "--resume {tmp} is not a checkpoint folder"),
    ("trainer", "trainer='dpo' is invalid"),
    ("trainer_list", "trainer=['grpo'] is invalid"),
    ("positional", "kvroll train takes no positional argument; did you mean --config {config}?"),
    # abbreviations argparse would take, of the names read before parsing: the checks would read another value
    ("output_dir_abbreviated", "--output_d abbreviates --output_dir, which kvroll train reads before parsing"),
    ("config_abbreviated", "--conf abbreviates --config"),
    ("resume_from_checkpoint", "--resume_from_checkpoint {tmp} is not a checkpoint folder"),
    ("resume_from_checkpoint_true", "--resume: output_dir {tmp}/empty holds no checkpoint-N folder"),
])
def test_bad_input_is_one_line_before_trl_loads(tmp_path, capsys, monkeypatch, tiny_dir, case, message):
    import kvroll.trainers.train as train_module

    def trl_loads(*args, **kwargs):
        raise AssertionError("TRL's parser was built before the input was checked")

    monkeypatch.setattr(train_module, "build_parser", trl_loads)
    (tmp_path / "file").write_text("x")
    (tmp_path / "syntax.yaml").write_text("model: smollm2\nbudgets: [1, 2\n")
    (tmp_path / "latin1.yaml").write_bytes("task_ops: '+' # pi\xe8ce\n".encode("latin-1"))
    (tmp_path / "list.yaml").write_text("- max_steps\n")
    (tmp_path / "key.yaml").write_text(f"model: {tiny_dir}\nmax_stpes: 3\n")
    (tmp_path / "model.yaml").write_text(f"model: {tmp_path}/nope\n")
    (tmp_path / "ppo.yaml").write_text(f"trainer: ppo\nvalue_model_name_or_path: {tmp_path}/nope\n")
    (tmp_path / "trainer_list.yaml").write_text("trainer: [grpo]\n")
    (tmp_path / "resume_true.yaml").write_text(f"model: {tiny_dir}\noutput_dir: {tmp_path}/empty\n"
                                               "resume_from_checkpoint: true\n")
    flags = {"missing": ["--config", f"{tmp_path}/missing.yaml"], "yaml": ["--config", f"{tmp_path}/syntax.yaml"],
             "latin1": ["--config", f"{tmp_path}/latin1.yaml"], "list": ["--config", f"{tmp_path}/list.yaml"],
             "key": ["--config", f"{tmp_path}/key.yaml"], "flag": ["--config", str(CONFIG), "--kvroll_budjet", "8"],
             "model_flag": ["--model", f"{tmp_path}/nope"], "model_yaml": ["--config", f"{tmp_path}/model.yaml"],
             "not_a_model": ["--model", str(tmp_path)],
             "output_dir": ["--model", str(tiny_dir), "--output_dir", f"{tmp_path}/file/run"],
             "resume": ["--model", str(tiny_dir), "--output_dir", f"{tmp_path}/empty", "--resume"],
             "resume_path": ["--model", str(tiny_dir), "--resume", str(tmp_path)],
             "trainer": ["--trainer", "dpo"], "flag_far": ["--zzzz", "1"],
             "trainer_list": ["--config", f"{tmp_path}/trainer_list.yaml"],
             "positional": [str(CONFIG), "--max_steps", "2"],
             "output_dir_abbreviated": ["--model", str(tiny_dir), "--output_d", f"{tmp_path}/run"],
             "config_abbreviated": ["--conf", str(CONFIG)],
             "resume_from_checkpoint": ["--model", str(tiny_dir), "--resume_from_checkpoint", str(tmp_path)],
             "resume_from_checkpoint_true": ["--config", f"{tmp_path}/resume_true.yaml"],
             "value_model": ["--trainer", "ppo", "--model", str(tiny_dir), "--value_model_name_or_path",
                             f"{tmp_path}/nope"],
             "value_model_yaml": ["--config", f"{tmp_path}/ppo.yaml", "--model", str(tiny_dir)]}[case]
    code, err = _run(flags, capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith("kvroll train: error: ")
    assert message.format(tmp=tmp_path, config=CONFIG) in err[0]
    assert not err[0].endswith("?.") and err[0][-1] in ".?"  # one sentence end


@pytest.mark.parametrize("flags, message", [
    (["--kvroll_policy", "nope"], "--kvroll_policy 'nope' is not a known policy"),
    (["--kvroll_budget", "-1"], "CompressionConfig.budget=-1 is invalid"),
    (["--max_steps", "abc"], "argument --max_steps/--max-steps: invalid int value: 'abc'"),
    (["--trainer", "ppo", "--kl_penalty", "advantage"], "kl_penalty='advantage' is invalid"),
    (["--task_style", "medium"], "task_style='medium' is invalid: use one of short, long"),
    (["--task_reasoning", "true"], "task_reasoning=True applies to task_style='short' only"),
    (["--max_completion_length", "0"], "max_completion_length=0 is invalid with use_kvroll=True: use an integer >= 1"),
    (["--top_p", "2"], "top_p=2.0 is invalid with use_kvroll=True: top_p must be in (0, 1]"),
    (["--top_k", "-1"], "top_k=-1 is invalid with use_kvroll=True"),
    (["--repetition_penalty", "0"], "repetition_penalty=0.0 is invalid with use_kvroll=True"),
    (["--generation_kwargs", '{"top_k": -1}'], "generation_kwargs['top_k']=-1 is invalid with use_kvroll=True"),
    (["--generation_kwargs", '{"do_sample": false}'], "generation_kwargs['do_sample']=False is invalid"),
    (["--task_ops", "/"], "task_ops='/' is invalid"),
    (["--task_size", "0"], "task_size=0 is invalid: use an integer >= 1"),
    # PPO's batch sizes are read before TrainingArguments checks them (a ZeroDivisionError traceback, or -4 taken)
    (["--trainer", "ppo", "--per_device_train_batch_size", "0"], "per_device_train_batch_size=0 is invalid: use an "
                                                                 "integer >= 1"),
    (["--trainer", "ppo", "--gradient_accumulation_steps", "-2"], "gradient_accumulation_steps=-2 is invalid"),
    # an abbreviated --trainer: the fields were chosen for grpo, the parse said ppo
    (["--traine", "ppo"], "trainer='ppo' was given as an abbreviated flag; spell it --trainer ppo"),
])
def test_config_errors_are_one_line(tmp_path, capsys, monkeypatch, tiny_dir, flags, message):
    import kvroll.trainers.train as train_module

    monkeypatch.setattr(train_module, "train", lambda *a, **k: pytest.fail("a model was loaded"))
    config = [] if "ppo" in flags else ["--config", str(CONFIG)]
    code, err = _run([*config, "--model", str(tiny_dir), "--output_dir", str(tmp_path), *flags], capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith("kvroll train: error: ") and message in err[0]


@pytest.mark.parametrize("config, flags", [
    ("grpo_smollm2.yaml", ["--kvroll_budget", "100000"]),
    ("grpo_smollm2_ray.yaml", ["--kvroll_budget", "100000"]),  # before a Ray cluster starts, not in a worker
    ("grpo_smollm2.yaml", ["--kvroll_policy_kwargs", '{"buffer": 100000}']),
])
def test_a_budget_past_the_models_positions_is_one_line_before_the_model_loads(tmp_path, capsys, monkeypatch,
                                                                                tiny_dir, config, flags):
    import trl

    monkeypatch.setattr(trl.GRPOTrainer, "__init__", lambda *a, **k: pytest.fail("the model was loaded"))
    code, err = _run(["--config", str(CONFIG.parent / config), "--model", str(tiny_dir), "--output_dir",
                      str(tmp_path), *flags], capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith("kvroll train: error: Invalid kvroll settings"), err
    assert "exceeds the model's max_position_embeddings=512" in err[0] and "100000" in err[0]


@pytest.mark.ray
def test_a_cluster_that_cannot_be_joined_is_one_line(tmp_path, capsys, tiny_dir):
    """kvroll_mode: ray joins at the first sync, after the model loaded: a ConnectionError there is one line."""
    pytest.importorskip("ray")
    code, err = _run(["--config", str(CONFIG.parent / "grpo_smollm2_ray.yaml"), "--model", str(tiny_dir),
                      "--output_dir", str(tmp_path), "--max_steps", "1", "--kvroll_ray_address", "127.0.0.1:1"], capsys)
    ours = [line for line in err if line.startswith("kvroll train: error: ")]  # beside the weights' progress bar
    assert code == 1 and len(ours) == 1 and not any("Traceback" in line for line in err), repr(err)[-1500:]
    assert ours[0].startswith("kvroll train: error: kvroll_ray_address='127.0.0.1:1' is unreachable")


def test_errors_past_the_checks_keep_their_traceback(tmp_path, monkeypatch, tiny_dir):
    import kvroll.trainers.train as train_module
    from kvroll.cli import main as kvroll

    def bug(*args, **kwargs):
        raise ValueError("an internal error")

    monkeypatch.setattr(train_module, "train", bug)
    with pytest.raises(ValueError, match="an internal error"):
        kvroll(["train", "--config", str(CONFIG), "--model", str(tiny_dir), "--output_dir", str(tmp_path)])


def test_interrupted_run_keeps_its_logs_and_resume_continues_it(tmp_path, capsys, monkeypatch, tiny_dir):
    """Ctrl-C (raised where a real one lands: inside the training loop) after step 3 of 4, then --resume."""
    from kvroll.trainers.train_log import RewardPrinter

    def ctrl_c_at_step_3(self, args, state, control, **kwargs):
        if state.global_step == 3:
            raise KeyboardInterrupt

    out = tmp_path / "run"
    flags = ["--config", str(CONFIG), "--model", str(tiny_dir), "--output_dir", str(out), "--max_steps", "4",
             "--save_steps", "2", "--max_completion_length", "8", "--kvroll_budget", "16", "--task_size", "8"]
    with monkeypatch.context() as patch:
        patch.setattr(RewardPrinter, "on_step_end", ctrl_c_at_step_3, raising=False)
        code, err = _run(flags, capsys)
    # stderr also holds the progress bars of loading and training; the last line is the one kvroll prints
    assert code == 130 and err[-1] == (f"kvroll train: interrupted after step 3/4; kept {out}/metrics.jsonl (2 "
                                       f"logged steps), {out}/log_history.json; last checkpoint {out}/checkpoint-2 "
                                       "(continue with --resume)")
    assert not any(line.startswith("Traceback") for line in err)
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    history = json.loads((out / "log_history.json").read_text())  # the line says it kept it: written at the stop
    assert [h["step"] for h in history if "reward" in h] == [1, 2]
    assert not (out / "model.safetensors").exists()

    capsys.readouterr()
    code, err = _run([*flags, "--resume"], capsys)
    printed = capsys.readouterr().out
    assert code == 0 and f"resuming from {out}/checkpoint-2" in printed
    assert "step   3/4" in printed and "step   4/4" in printed and "step   1/4" not in printed
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    history = json.loads((out / "log_history.json").read_text())
    assert [h["step"] for h in history if "reward" in h] == [1, 2, 3, 4]  # steps 1-2 come from the checkpoint
    assert (out / "model.safetensors").is_file() and (out / "checkpoint-4").is_dir()


def test_sigint_stops_a_training_run_with_one_line(tmp_path, tiny_dir):
    """A real Ctrl-C (SIGINT) to ``kvroll train`` mid-run: status 130 within seconds, one line, no traceback."""
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "run"
    stderr = (tmp_path / "stderr.txt").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvroll.cli", "train", "--config", str(CONFIG), "--model", str(tiny_dir),
         "--output_dir", str(out), "--max_steps", "500", "--save_strategy", "no", "--max_completion_length", "8",
         "--kvroll_budget", "16", "--task_size", "8"],
        stdout=subprocess.PIPE, stderr=stderr, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"})
    try:
        for line in proc.stdout:  # wait for the first step, so the signal lands inside the training loop
            if line.startswith("step   1/500"):
                break
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:  # still running: SIGABRT makes faulthandler print every thread's stack
            proc.send_signal(signal.SIGABRT)
            proc.wait(timeout=30)
            raise AssertionError("kvroll train did not stop within 60 s of SIGINT; its threads:\n"
                                 + (tmp_path / "stderr.txt").read_text()[-6000:]) from None
    finally:
        proc.kill()
    stopped_in = time.monotonic() - sent
    err = (tmp_path / "stderr.txt").read_text().splitlines()
    assert code == 130 and stopped_in < 20, (code, stopped_in)
    assert not any("Traceback" in line for line in err), "\n".join(err)
    assert err[-1].startswith("kvroll train: interrupted after step ") and f"kept {out}/metrics.jsonl (" in err[-1]
    assert "no checkpoint yet (save_strategy=no" in err[-1]
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["step"] == 1


def test_a_ctrl_c_that_python_drops_in_a_finalizer_is_raised_at_the_next_callback(monkeypatch):
    """A SIGINT handled while a ``__del__`` runs: Python prints the KeyboardInterrupt and drops it (the run went on,
    once, 30 steps past a Ctrl-C); the guard raises it again at the trainer's next callback, and its exit puts the
    previous handler back."""
    import gc
    import os
    import signal
    import sys

    from kvroll.trainers.train_log import InterruptGuard

    class InterruptedWhileCollected:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):  # the handler runs at the next bytecode boundaries, still inside __del__
                pass

    dropped = []  # Python's "Exception ignored in ... __del__" goes to sys.unraisablehook
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: dropped.append(unraisable.exc_type))
    before = signal.getsignal(signal.SIGINT)
    with InterruptGuard() as guard:
        guard.on_step_begin(None, None, None)  # nothing pending: no raise
        InterruptedWhileCollected()
        gc.collect()
        assert dropped == [KeyboardInterrupt]
        with pytest.raises(KeyboardInterrupt):
            guard.on_step_end(None, None, None)
    assert signal.getsignal(signal.SIGINT) is before


def test_what_main_reads_before_parsing_follows_argparse(tmp_path):
    """``--resume`` before another flag continues from output_dir's last checkpoint (the flag is not its path); a
    flag given twice is read as argparse reads it, the last one winning; a config's ``env`` key (TRL's parser sets
    those environment variables) is no unknown field; ``--resume`` alone picks the newest checkpoint-N by number."""
    from kvroll.trainers.train import check_names, flag_value, last_checkpoint, split_resume

    assert split_resume(["--resume", "--max_steps", "3"]) == (["--max_steps", "3"], "")
    assert split_resume(["--resume", "out/checkpoint-5", "--max_steps", "3"]) == (["--max_steps", "3"],
                                                                                 "out/checkpoint-5")
    assert flag_value(["--output_dir", "a", "--output-dir=b", "--model", "m"], "output_dir") == "b"
    check_names([], {"env": {"OMP_NUM_THREADS": "1"}, "max_steps": 2}, "c.yaml", config_fields("grpo"), "grpo")
    with pytest.raises(ValueError, match="unknown key 'envv'"):
        check_names([], {"envv": {}}, "c.yaml", config_fields("grpo"), "grpo")
    for step in (2, 10, 9):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    assert last_checkpoint(tmp_path) == tmp_path / "checkpoint-10"


def test_a_yaml_bool_for_an_integer_field_is_one_line(tmp_path, capsys, tiny_dir):
    """YAML's ``true`` reaches the config as a bool (TRL's parser converts only strings): an integer field refuses it
    (a bool is an int to Python), before a model loads."""
    config = tmp_path / "c.yaml"
    config.write_text(f"use_kvroll: true\nkvroll_num_workers: true\nmodel: {tiny_dir}\noutput_dir: {tmp_path}\n"
                      "report_to: none\n")
    code, err = _run(["--config", str(config)], capsys)
    assert code == 2 and len(err) == 1 and "kvroll_num_workers=True is invalid: use an integer >= 1" in err[0]


def test_resume_skips_a_checkpoint_a_kill_left_half_saved(tmp_path, capsys):
    """A run SIGKILLed while saving checkpoint-12 leaves it without trainer_state.json (transformers writes it last):
    ``--resume`` alone continues the newest complete checkpoint (was: the half-saved one, a FileNotFoundError
    traceback inside transformers)."""
    from kvroll.trainers.train import last_checkpoint, resume_checkpoint

    for step in (6, 12):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "model.safetensors").write_text("")
    (tmp_path / "checkpoint-6" / "trainer_state.json").write_text("{}")
    assert resume_checkpoint("", str(tmp_path)) == str(tmp_path / "checkpoint-6")
    assert "checkpoint-12 has no trainer_state.json" in capsys.readouterr().err
    (tmp_path / "checkpoint-6" / "trainer_state.json").unlink()
    assert last_checkpoint(tmp_path) is None
    with pytest.raises(ValueError, match="holds no checkpoint-N folder to continue from"):
        resume_checkpoint("", str(tmp_path))


def test_a_fresh_run_into_a_used_output_dir_keeps_the_earlier_run_aside(tmp_path, capsys, monkeypatch, tiny_dir):
    """A fresh run (no --resume) into the output_dir of a finished run, stopped at step 1 before its first
    checkpoint: the earlier run's checkpoint and logs move to previous-<time>/, and the stop line names no checkpoint
    (was: the earlier run's checkpoint-2 as "last checkpoint ... (continue with --resume)", which --resume then
    continued, and the earlier run's metrics.jsonl truncated)."""
    from kvroll.trainers.train_log import RewardPrinter

    out = tmp_path / "run"
    flags = ["--config", str(CONFIG), "--model", str(tiny_dir), "--output_dir", str(out), "--max_steps", "2",
             "--save_steps", "2", "--max_completion_length", "8", "--kvroll_budget", "16", "--task_size", "8"]
    assert _run(flags, capsys)[0] == 0 and (out / "checkpoint-2").is_dir()

    def ctrl_c_at_step_1(self, args, state, control, **kwargs):
        if state.global_step == 1:
            raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(RewardPrinter, "on_step_end", ctrl_c_at_step_1, raising=False)
        code, err = _run([*flags, "--kvroll_budget", "24"], capsys)
    assert code == 130 and "no checkpoint yet" in err[-1] and "checkpoint-2" not in err[-1]
    (kept,) = out.glob("previous-*")
    assert any(line.startswith(f"kvroll train: {out} held an earlier run") for line in err)
    assert (kept / "checkpoint-2" / "trainer_state.json").is_file() and not (out / "checkpoint-2").exists()
    assert [json.loads(line)["step"] for line in (kept / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert json.loads((kept / "run.json").read_text())["rollouts"] == "kvroll rkv budget 16"


def test_a_run_into_an_output_dir_another_run_is_writing_is_refused_before_training(tmp_path, capsys, monkeypatch,
                                                                                        tiny_dir):
    """A second `kvroll train` into the output_dir of one still running is refused in one line, before its trainer is
    built (was: it moved the running one's checkpoints and logs to previous-*). Only the first rank locks."""
    from kvroll.files import exclusive
    from kvroll.trainers import train as train_module

    out = tmp_path / "run"
    monkeypatch.setattr(train_module, "train", lambda *a: 0)  # the run itself is another test's
    flags = ["--config", str(CONFIG), "--model", str(tiny_dir), "--output_dir", str(out)]
    with exclusive(out, "kvroll train", "output_dir"):
        code, err = _run(flags, capsys)
        assert code == 2
        assert err == [f"kvroll train: error: output_dir {out} is in use by another kvroll train (pid "
                       f"{__import__('os').getpid()}); wait for it to finish, or pass another output_dir."]
        monkeypatch.setenv("RANK", "1")
        assert _run(flags, capsys)[0] == 0  # a later rank of the same run does not take the lock
        monkeypatch.delenv("RANK")
    assert _run(flags, capsys)[0] == 0


def test_a_run_that_logged_no_step_still_succeeds(tmp_path, capsys, tiny_dir):
    """logging_steps past max_steps: the run trains and saves its model; its end says there is no report (was: exit
    status 2 and "kvroll train: error: RUN_DIR ... holds no training logs" after the model was saved)."""
    out = tmp_path / "run"
    code, err = _run(["--config", str(CONFIG), "--model", str(tiny_dir), "--output_dir", str(out), "--max_steps", "2",
                      "--logging_steps", "10", "--save_strategy", "no", "--max_completion_length", "8",
                      "--kvroll_budget", "16", "--task_size", "8"], capsys)
    assert code == 0 and not any("error" in line for line in err)
    assert "kvroll train: no report.md: RUN_DIR" in capsys.readouterr().out
    assert (out / "model.safetensors").is_file() and not (out / "report.md").exists()
