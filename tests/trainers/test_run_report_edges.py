"""kvroll report and RewardPrinter on logs the trainer really writes: an evaluation's log is no step, a reward
function's null mean, log_history.json behind an empty metrics.jsonl, a value that is not a number, one note for a
cut line."""
import json
from types import SimpleNamespace

import pytest

from kvroll.cli import main as cli_main


def _jsonl(rows) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def test_a_cut_short_last_line_is_noted_once(tmp_path, capsys):
    """`kvroll report` read the logs twice (the early check, then the render): the stderr note came twice."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward": 0.5}\n{"step": 2, "rew')
    assert cli_main(["report", str(tmp_path)]) == 0
    assert capsys.readouterr().err.count("is cut short") == 1


def test_an_evaluation_log_is_not_a_training_step(tmp_path):
    """transformers adds "epoch" (and, in log_history, "step") to an evaluation's eval_* logs; such a log was
    counted as a training step (3 logged steps, step 1 twice in the table) and appended to metrics.jsonl."""
    from kvroll.bench.run_report import read_run, training_row
    from kvroll.trainers.train_log import RewardPrinter

    evaluation = {"eval_loss": 0.3, "eval_reward": 0.9, "epoch": 0.5}
    assert not training_row(evaluation) and not training_row({**evaluation, "step": 1})
    history = [{"reward": 0.5, "epoch": 0.5, "step": 1}, {**evaluation, "step": 1},
               {"reward": 1.0, "epoch": 1.0, "step": 2}, {"train_runtime": 3.0, "epoch": 1.0, "step": 2}]
    (tmp_path / "log_history.json").write_text(json.dumps(history))
    rows, _ = read_run(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    printer = RewardPrinter(tmp_path / "run", max_steps=2)
    printer.on_log(None, SimpleNamespace(is_world_process_zero=True, global_step=1), None, logs=dict(evaluation))
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == "" and printer.logged_steps == 0


@pytest.mark.parametrize("metrics", ["", '{"step": 1, "rew'])  # started and logged nothing; killed in its first line
def test_a_metrics_jsonl_without_steps_falls_back_to_log_history(tmp_path, metrics):
    """The error said "holds no training logs (metrics.jsonl or log_history.json with logged steps)" while
    log_history.json held logged steps: an empty metrics.jsonl hid it."""
    from kvroll.bench.run_report import read_run

    (tmp_path / "metrics.jsonl").write_text(metrics)
    (tmp_path / "log_history.json").write_text(json.dumps([{"reward": 0.25, "step": 1}]))
    rows, _ = read_run(tmp_path)
    assert [(r["step"], r["reward"]) for r in rows] == [(1, 0.25)]


@pytest.mark.parametrize("row, message", [
    ({"step": 1, "reward": "0.5"}, "step 1 logs reward='0.5', not a number"),
    ({"step": "a", "reward": 0.5}, "step 'a' logs step='a', not a number"),
    ({"step": 2, "kvroll/kv_bytes": [1]}, "step 2 logs kvroll/kv_bytes=[1], not a number"),
])
def test_a_figure_that_is_not_a_number_is_one_line(tmp_path, capsys, row, message):
    """A traceback (TypeError in _mean) before; a step "a" was reported as "last step a"."""
    (tmp_path / "metrics.jsonl").write_text(_jsonl([row]))
    assert cli_main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvroll report: error: ") and "metrics.jsonl: " + message in err and "\n" not in err, err
    assert not (tmp_path / "report.md").exists()


def test_a_reward_function_that_returned_none_for_every_row_does_not_stop_training(tmp_path, capsys):
    """TRL logs the mean of a reward function that returned None for every row as null (and "reward" as null when
    all did): step_line's format raised a TypeError inside on_log, which ended the training run."""
    from kvroll.trainers.train_log import RewardPrinter, step_line

    printer = RewardPrinter(tmp_path, max_steps=2)
    state = SimpleNamespace(is_world_process_zero=True, global_step=1)
    printer.on_log(None, state, None, logs={"reward": 1.0, "rewards/format_reward/mean": 1.0,
                                            "rewards/judge/mean": None})
    printer.on_log(None, SimpleNamespace(is_world_process_zero=True, global_step=2), None,
                   logs={"reward": None, "rewards/judge/mean": None})
    printer.summary()
    out = capsys.readouterr().out
    assert "step   1/2  reward 1.000  format 1.00  elapsed" in out and "step   2/2  reward -  elapsed" in out
    assert "mean reward first half 1.000, last half 1.000" in out
    assert step_line(3, 3, {"reward": None}, None, 1.0) == "step   3/3  reward -  elapsed 1s"
