"""Rollout metrics (issue 14 §2): the per-row KV accounting on hand-made rows; a 2-step ``kvroll train`` run whose
log history and TensorBoard event file hold every metric; ``kvroll report`` on that run and on a folder without
logs."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvroll.cli import main as cli_main
from kvroll.trainers.metrics import percentile, rollout_metrics
from kvroll.trainers.train import main as train_main

from .tiny_model import tiny_llama, tokenizer

CONFIG = Path(__file__).parents[2] / "configs" / "grpo_smollm2.yaml"
EVERY_METRIC = [
    "kvroll/rollout_seconds", "kvroll/rollout_share", "kvroll/step_seconds", "kvroll/rollout_tokens_per_second",
    "kvroll/completion_length/mean", "kvroll/completion_length/p50", "kvroll/completion_length/p90",
    "kvroll/completion_length/max", "kvroll/truncated_fraction", "kvroll/budget", "kvroll/kv_bytes",
    "kvroll/kv_bytes_full_equivalent", "kvroll/kv_ratio", "kvroll/evicted_tokens", "kvroll/kv_cache_mib",
    "kvroll/sync_seconds", "kvroll/sync_bytes", "kvroll/sync_gb_per_s", "kvroll/sync_version",
    "sampling/sampling_logp_difference/mean", "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/mean", "sampling/importance_sampling_ratio/max", "kvroll/is_masked_fraction"]


def test_per_row_kv_accounting_by_hand():
    # prompts 10 and 4 tokens; completions 6 (ends with stop 2), 8 (the limit, no stop), 3 (stop); capacity 8
    stats = rollout_metrics([10, 10, 4], [[5, 5, 5, 5, 5, 2], [7] * 8, [9, 9, 2]], max_new_tokens=8, stop_ids={2},
                            capacity=8, bytes_per_token=100)
    written = [10 + 6 - 1, 10 + 8 - 1, 4 + 3 - 1]  # 15, 17, 6: the last sampled token is never cached
    assert stats["kvroll/kv_bytes_full_equivalent"] == 100 * sum(written)
    assert stats["kvroll/kv_bytes"] == 100 * (8 + 8 + 6)
    assert stats["kvroll/evicted_tokens"] == (15 - 8) + (17 - 8)
    assert stats["kvroll/kv_ratio"] == pytest.approx(22 / 38)
    assert stats["kvroll/truncated_fraction"] == pytest.approx(1 / 3)
    assert (stats["kvroll/completion_length/mean"], stats["kvroll/completion_length/max"]) == (17 / 3, 8)
    assert stats["kvroll/completion_length/p50"] == 6 and stats["kvroll/completion_length/p90"] == pytest.approx(7.6)
    full = rollout_metrics([10], [[1, 2]], max_new_tokens=8, stop_ids={2}, capacity=None, bytes_per_token=100)
    assert full["kvroll/evicted_tokens"] == 0 and full["kvroll/kv_ratio"] == 1.0


def test_a_completion_stopping_at_the_limit_is_not_truncated():
    """Truncated = the limit reached without a stop (TRL's ``completions/clipped_ratio``: the last id is not EOS):
    a row that samples its stop id as the limit's last token finished, and an empty row is not truncated."""
    rows = [[5] * 7 + [2], [5] * 8, [5, 2], [5] * 7 + [3], []]  # stop at the limit, the limit, stop, other stop
    stats = rollout_metrics([4] * 5, rows, max_new_tokens=8, stop_ids={2, 3}, capacity=None, bytes_per_token=1)
    clipped = [len(ids) > 0 and ids[-1] not in {2, 3} and len(ids) >= 8 for ids in rows]  # by hand: row 1 only
    assert clipped == [False, True, False, False, False]
    assert stats["kvroll/truncated_fraction"] == pytest.approx(1 / 5)


def test_percentile_matches_numpy():
    import numpy as np

    values = [3, 1, 4, 1, 5, 9, 2, 6]
    for q in (0, 10, 50, 90, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def tensorboard_scalars(out: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(out.rglob("events.out.tfevents.*"))
    assert files, f"no TensorBoard event file under {out}"
    scalars: dict[str, list[float]] = {}
    for file in files:
        events = EventAccumulator(str(file), size_guidance={"scalars": 0})
        events.Reload()
        for tag in events.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend(e.value for e in events.Scalars(tag))
    return scalars


def test_two_step_run_logs_every_metric_to_tensorboard_and_reports(tmp_path, capsys):
    tok = tokenizer()
    model_dir, out = tmp_path / "tiny", tmp_path / "run"
    tiny_llama(tok).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    assert train_main(["--config", str(CONFIG), "--model", str(model_dir), "--output_dir", str(out),
                       "--max_steps", "2", "--max_completion_length", "12", "--kvroll_budget", "16",
                       "--kvroll_policy_kwargs", '{"buffer": 4, "window": 4}', "--task_size", "8",
                       "--save_strategy", "no", "--report_to", "tensorboard"]) == 0
    printed = capsys.readouterr().out
    assert f"kvroll train: report in {out / 'report.md'}" in printed
    assert "KV " in printed and "evicted " in printed

    steps = [h for h in json.loads((out / "log_history.json").read_text()) if "reward" in h]
    assert [h["step"] for h in steps] == [1, 2]
    for h in steps:
        missing = [name for name in EVERY_METRIC if not math.isfinite(h.get(name, math.nan))]
        assert not missing, f"step {h['step']} lacks {missing}"
        # the same rows seen by TRL: its lengths and truncation agree with the adapter's
        assert h["kvroll/completion_length/mean"] == pytest.approx(h["completions/mean_length"])
        assert h["kvroll/completion_length/max"] == h["completions/max_length"] <= 12
        assert h["kvroll/truncated_fraction"] == pytest.approx(h["completions/clipped_ratio"])
        # the tiny model: 2 layers x K,V x 2 KV heads x head_dim 8 x fp32 = 256 bytes a token; its completions are
        # short (EOS is likely), and the 29-token prompt is compressed to the budget (16) at prefill, so each row
        # holds 16 + c - 1 tokens up to its 16 + 4 (buffer) slots
        evicted_bytes = 256 * h["kvroll/evicted_tokens"]
        assert h["kvroll/kv_bytes"] + evicted_bytes == h["kvroll/kv_bytes_full_equivalent"]
        assert 8 * 16 * 256 <= h["kvroll/kv_bytes"] <= 8 * 20 * 256 and h["kvroll/evicted_tokens"] >= 8 * (29 - 20)
        assert 0 < h["kvroll/kv_ratio"] < 0.7 and h["kvroll/budget"] == 16
        assert 0 < h["kvroll/rollout_share"] < 1 and h["kvroll/rollout_tokens_per_second"] > 0
        assert h["kvroll/sync_version"] == h["step"]  # the build's sync, then one before step 2's rollout
    scalars = tensorboard_scalars(out)
    for name in EVERY_METRIC:
        assert len(scalars.get(f"train/{name}", [])) == 2, f"{name} not in the event file twice"
    assert scalars["train/kvroll/evicted_tokens"] == pytest.approx([h["kvroll/evicted_tokens"] for h in steps])

    report = (out / "report.md").read_text()
    assert "| step | reward |" in report and "kvroll rkv budget 16" in report
    assert "grpo, long arithmetic task" in report  # the shipped config's task_style, through run.json
    assert json.loads((out / "run.json").read_text())["kvroll_mode"] == "colocate"
    assert "rollouts: kvroll rkv budget 16 (colocate mode)," in report
    for png in ("reward.png", "tokens_per_s.png", "completion_lengths.png", "mismatch.png"):
        assert (out / png).stat().st_size > 1000
    # re-rendered by the command, elsewhere
    assert cli_main(["report", str(out), "--out", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / "report.md").read_text() == report


def test_ppo_steps_between_rollouts_are_logged_and_counted(tmp_path, capsys):
    """PPO logs the optimizer steps between its rollouts without a reward: metrics.jsonl keeps them, the console
    prints the rollouts' lines alone with the sync logged on the step before, and the report's rollout share is the
    rollouts' seconds over every step's (it averaged the rollout steps' shares alone: 50% here instead of 25%)."""
    from types import SimpleNamespace

    from kvroll.bench.run_report import markdown, read_run, rollout_share
    from kvroll.trainers.train_log import RewardPrinter

    logs = [{"reward": 1.0, "kvroll/rollout_seconds": 2.0, "kvroll/step_seconds": 4.0, "kvroll/sync_seconds": 0.003},
            {"loss": 0.1, "kvroll/step_seconds": 4.0},
            {"loss": 0.2, "kvroll/step_seconds": 4.0, "kvroll/sync_seconds": 0.005},
            {"reward": 3.0, "kvroll/rollout_seconds": 2.0, "kvroll/step_seconds": 4.0},
            {"eval_reward": 2.0}, {"train_runtime": 16.0, "train_loss": 0.1}]
    printer = RewardPrinter(tmp_path, max_steps=4)
    for step, entry in enumerate(logs, 1):
        printer.on_log(None, SimpleNamespace(is_world_process_zero=True, global_step=min(step, 4)), None,
                       logs=dict(entry))
    printer.summary()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step")]
    assert [line.split()[1] for line in lines] == ["1/4", "4/4"]
    assert "sync 3.00ms" in lines[0] and "sync 5.00ms" in lines[1]  # the sync before the second rollout
    rows, _ = read_run(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and printer.logged_steps == 4
    assert rollout_share(rows) == pytest.approx(0.25)
    report = markdown(rows, {}, tmp_path, {}, None)
    assert "* 4 logged steps (last step 4" in report and "mean reward first half 1.000, last half 3.000" in report
    assert "25% of the steps' wall time" in report
    # logs without step times (an older run) keep the mean of the steps' shares
    assert rollout_share([{"kvroll/rollout_share": 0.5}, {"kvroll/rollout_share": 0.3}]) == pytest.approx(0.4)


def test_report_of_a_folder_without_logs_is_one_line(tmp_path, capsys):
    assert cli_main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"kvroll report: error: RUN_DIR {tmp_path} holds no training logs") and "\n" not in err
    assert cli_main(["report", str(tmp_path / "missing")]) == 2
    assert "is not a directory" in capsys.readouterr().err


@pytest.mark.parametrize("name, content, message", [
    ("metrics.jsonl", '{"step": 1, "reward": 0.5}\n{"step": 2, "rew', None),  # cut short: left out with a note
    ("metrics.jsonl", '{"step": 1, "rew\n{"step": 2, "reward": 0.5}\n', "metrics.jsonl:1 is not JSON"),
    ("metrics.jsonl", "1\n2\n", "metrics.jsonl:1 is int '1', not a JSON object"),
    ("metrics.jsonl", b"\xff\xfe", "metrics.jsonl is not UTF-8 text"),
    ("run.json", '{"model": \n', "run.json:2 is not JSON"),
    ("run.json", "[1]", "run.json is not a JSON object"),
    ("log_history.json", '{"step": 1}', "log_history.json is not a list of logged steps"),
])
def test_report_of_corrupt_logs_names_the_file_and_line(tmp_path, capsys, name, content, message):
    """A log that is not what kvroll train writes is one line naming the file (and line) and the fix, exit status
    2, no traceback; a metrics.jsonl whose last line a killed run cut short is reported without that line."""
    if name != "metrics.jsonl" and name != "log_history.json":
        (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward": 0.5}\n')
    (tmp_path / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    code = cli_main(["report", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    if message is None:
        assert code == 0 and "metrics.jsonl:2 is cut short" in err
        assert "* 1 logged step (last step 1" in (tmp_path / "report.md").read_text()
        return
    assert code == 2 and message in err and err.startswith("kvroll report: error: ") and "\n" not in err, err


def test_report_header_names_the_rollout_mode_and_workers(tmp_path):
    from kvroll.bench.run_report import markdown

    rows = [{"step": 1, "reward": 0.5}]
    ray = {"model": "smollm2", "trainer": "grpo", "rollouts": "kvroll rkv budget 80", "kvroll_mode": "ray",
           "kvroll_num_workers": 2}
    assert "rollouts: kvroll rkv budget 80 (ray mode, 2 workers), " in markdown(rows, ray, tmp_path, {}, None)
    one = {**ray, "kvroll_num_workers": 1}
    assert "(ray mode, 1 worker), " in markdown(rows, one, tmp_path, {}, None)
    plain = {"model": "smollm2", "trainer": "grpo", "rollouts": "TRL model.generate"}  # no kvroll, or an older run
    assert "rollouts: TRL model.generate, " in markdown(rows, plain, tmp_path, {}, None)


def test_report_of_a_run_without_kvroll_takes_trls_lengths(tmp_path):
    """A run with TRL's own rollouts (use_kvroll false) logs TRL's completion keys, not kvroll's: the summary takes
    them (it printed '-' before), and the plots of keys it lacks draw no legend (matplotlib warned)."""
    import warnings

    from kvroll.bench.run_report import markdown, write_plots

    rows = [{"step": s, "reward": 0.5, "completions/mean_length": 16.0 - s, "completions/clipped_ratio": 1.0}
            for s in (1, 2)]
    text = markdown(rows, {}, tmp_path, {}, None)
    assert "completions 14.5 tokens on average, 1.00 truncated." in text
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        write_plots(tmp_path, rows)


def test_step_line_leaves_out_what_the_step_did_not_log():
    """The console line of a kvroll step is as before; a step of TRL's own rollouts (use_kvroll false) logs no
    kvroll/* keys, and its line leaves them out instead of printing 'nan'."""
    from kvroll.trainers.train_log import step_line

    kvroll_logs = {"reward": 0.5, "completions/mean_length": 100.0, "kvroll/kv_bytes": 16.9 * 2**20,
                   "kvroll/kv_bytes_full_equivalent": 45.0 * 2**20, "kvroll/evicted_tokens": 640.0,
                   "sampling/sampling_logp_difference/mean": 0.246, "kvroll/rollout_seconds": 19.3}
    assert step_line(1, 10, kvroll_logs, 0.00173, 41.0) == ("step   1/10  reward 0.500  len 100  KV 16.9 MiB (full "
                                                            "45.0)  evicted 640  |dlogp| 0.246  rollout 19.3s  "
                                                            "sync 1.73ms  elapsed 41s")
    trl_logs = {"reward": 0.25, "completions/mean_length": 16.0}
    line = step_line(2, 10, trl_logs, None, 12.0)
    assert line == "step   2/10  reward 0.250  len 16  elapsed 12s" and "nan" not in line


def test_kvroll_fields_with_use_kvroll_false_warn_that_they_are_ignored():
    """use_kvroll=False with kvroll fields set (a baseline run from a kvroll config): a warning names them; none
    with the defaults, and none with use_kvroll=True."""
    import warnings

    from kvroll.trainers import GRPOConfig

    def caught(**kw):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            GRPOConfig(output_dir="/tmp/unused", use_cpu=True, report_to="none", **kw)
        return [str(w.message) for w in seen if "use_kvroll=False" in str(w.message)]

    assert caught(use_kvroll=False) == [] and caught(use_kvroll=True, kvroll_budget=64) == []
    message, = caught(use_kvroll=False, kvroll_budget=64, kvroll_policy="longflow")
    assert message.startswith("kvroll_policy='longflow', kvroll_budget=64 are ignored: use_kvroll=False")


def test_a_cut_short_line_is_dropped_when_reporting_and_resuming(tmp_path, capsys):
    """A killed run's last metrics line, cut short: the report leaves it out (also before a blank line; alone, the
    run holds no logs), and a run resumed from a checkpoint drops it instead of failing on it."""
    from kvroll.bench.run_report import read_run
    from kvroll.trainers.train_log import RewardPrinter

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward": 0.5}\n{"step": 2, "rew\n\n')
    rows, _ = read_run(tmp_path)
    assert [r["step"] for r in rows] == [1] and "metrics.jsonl:2 is cut short" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "rew')
    assert cli_main(["report", str(tmp_path)]) == 2
    assert "holds no training logs" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward": 0.5}\n{"step": 2, "reward": 0.7}\n{"step": 3, "r')
    printer = RewardPrinter(tmp_path, max_steps=4, resume_step=2)
    assert printer.kept == 2 and (tmp_path / "metrics.jsonl").read_text().count("\n") == 2


def test_kv_bytes_per_token_without_head_dim_divides_by_the_query_heads():
    """A config without ``head_dim`` (Qwen2's): head_dim = hidden / attention heads, not / KV heads; K and V of
    every layer and KV head: 3 layers x K,V x 2 KV heads x (64 / 8) x 2 bytes."""
    from types import SimpleNamespace

    import torch

    from kvroll.trainers.metrics import kv_bytes_per_token

    config = SimpleNamespace(num_hidden_layers=3, hidden_size=64, num_attention_heads=8, num_key_value_heads=2)
    assert kv_bytes_per_token(config, torch.bfloat16) == 3 * 2 * 2 * 8 * 2 == 192
    config.head_dim = 16  # an explicit head_dim wins
    assert kv_bytes_per_token(config, torch.float32) == 3 * 2 * 2 * 16 * 4


def test_step_timer_shares_each_steps_own_rollout_seconds(monkeypatch):
    """``kvroll/rollout_share`` = the rollout seconds of this optimizer step over its wall time: each step starts
    its rollout count at 0 (a share that kept counting earlier steps' rollouts read 0.75 on step 2 here)."""
    from types import SimpleNamespace

    from kvroll.trainers import metrics

    clock = iter([0.0, 4.0, 10.0, 12.0])  # step 1 takes 4 s, step 2 takes 2 s
    monkeypatch.setattr(metrics, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    logged = []
    generation = SimpleNamespace(step_rollout_seconds=7.0, _log=lambda name, value: logged.append((name, value)))
    timer = metrics.StepTimer(generation)
    for rollout in (1.0, 0.5):
        timer.on_step_begin(None, None, None)
        generation.step_rollout_seconds += rollout  # what the adapter adds for the step's generation
        timer.on_step_end(None, None, None)
    assert logged == [("kvroll/step_seconds", 4.0), ("kvroll/rollout_share", 0.25),
                      ("kvroll/step_seconds", 2.0), ("kvroll/rollout_share", 0.25)]


def test_report_summary_and_table_of_an_odd_number_of_steps(tmp_path, capsys):
    """Three rollout steps by hand: the first half is step 1, the last half step 3 (the middle one in neither), as in
    the console's last line; truncation is kvroll's own (TRL's clipped ratio only when kvroll logged none); evicted is
    the steps' mean; the table's KV columns are MiB (2**20 bytes)."""
    from types import SimpleNamespace

    from kvroll.bench.run_report import markdown, read_run
    from kvroll.trainers.train_log import RewardPrinter

    steps = [(0.0, 0.5, 10.0), (1.0, 0.25, 20.0), (5.0, 0.0, 60.0)]  # reward, truncated, evicted
    printer = RewardPrinter(tmp_path, max_steps=3)
    for step, (reward, truncated, evicted) in enumerate(steps, 1):
        logs = {"reward": reward, "kvroll/truncated_fraction": truncated, "completions/clipped_ratio": 0.9,
                "kvroll/kv_bytes": 3.0 * 2**20, "kvroll/kv_bytes_full_equivalent": 6.0 * 2**20,
                "kvroll/kv_ratio": 0.5, "kvroll/evicted_tokens": evicted, "kvroll/budget": 16}
        printer.on_log(None, SimpleNamespace(is_world_process_zero=True, global_step=step), None, logs=logs)
    printer.summary()
    assert "mean reward first half 0.000, last half 5.000;" in capsys.readouterr().out
    rows, _ = read_run(tmp_path)
    text = markdown(rows, {}, tmp_path, {}, None)
    assert "mean reward first half 0.000, last half 5.000." in text
    assert "0.25 truncated." in text  # (0.5 + 0.25 + 0) / 3
    assert ("KV held for a step's rows: 3.00 MiB against 6.00 MiB with full KV (0.50x) at budget 16; 30 tokens "
            "evicted a step.") in text
    assert "| 1 | 0.000 | - | - | - | - | 0.50 | 3.00 | 6.00 | 10 | - | - | - | - | - |" in text


def test_report_ratios_and_rates_agree_with_the_figures_beside_them(tmp_path):
    """The summary's KV ratio is its two MiB figures' ratio (the mean of the steps' ratios differed: 0.41 printed
    beside 16.88 / 41.80 MiB); its tokens/s the steps' tokens over their rollout seconds (the mean of the steps' rates
    is not a rate); its budget the last one logged (PPO's steps between rollouts log none). Session 42's audit."""
    from kvroll.bench.run_report import markdown, rollout_rate

    rows = [{"step": 1, "reward": 1.0, "kvroll/kv_bytes": 1.0 * 2**20, "kvroll/kv_bytes_full_equivalent": 10.0 * 2**20,
             "kvroll/kv_ratio": 0.1, "kvroll/rollout_tokens_per_second": 100.0, "kvroll/rollout_seconds": 1.0,
             "kvroll/budget": 32},
            {"step": 2, "reward": 2.0, "kvroll/kv_bytes": 3.0 * 2**20, "kvroll/kv_bytes_full_equivalent": 2.0 * 2**20,
             "kvroll/kv_ratio": 1.5, "kvroll/rollout_tokens_per_second": 10.0, "kvroll/rollout_seconds": 9.0,
             "kvroll/budget": 32},
            {"step": 3, "loss": 0.1}]  # an optimizer step between rollouts (PPO): no budget, no rollout
    text = markdown(rows, {}, tmp_path, {}, None)
    # mean KV 2.00 MiB against 6.00: 0.33x (the steps' ratios' mean is 0.80)
    assert "KV held for a step's rows: 2.00 MiB against 6.00 MiB with full KV (0.33x) at budget 32;" in text
    assert rollout_rate(rows) == pytest.approx((100.0 * 1.0 + 10.0 * 9.0) / 10.0)  # 190 tokens in 10 s: 19, not 55
    assert "* Rollouts: 19.0 generated tokens/s" in text
    assert rollout_rate([{"kvroll/rollout_tokens_per_second": 4.0}, {"kvroll/rollout_tokens_per_second": 6.0}]) == 5.0


@pytest.mark.parametrize("policy", ["longflow", "h2o", "streaming"])
def test_kv_accounting_of_a_step_policy_matches_the_cache(policy):
    """Exact for the step policies, the one-token completion (EOS first) included: a 31-token prompt is compressed
    to budget - 1 = 15 at prefill and that token is never fed back, so the slot holds 15, not min(31, 16)."""
    from kvroll import CompressionConfig, RolloutEngine, SamplingParams

    tok = tokenizer()
    engine = RolloutEngine(tiny_llama(tok).eval(), compression=CompressionConfig(policy, 16), max_batch=1,
                           tokenizer=tok)
    prompt = list(range(100, 131))
    for max_new in (1, 2, 5):
        ids = engine.generate([prompt], SamplingParams(max_new_tokens=max_new, seed=0, ignore_eos=True))[0].token_ids
        stats = rollout_metrics([31], [ids], max_new, set(), capacity=16, bytes_per_token=1,
                                prompt_keep=engine.cache.prefill_limit())
        held = int(engine.cache.count[:, 0].max())
        assert (stats["kvroll/kv_bytes"], stats["kvroll/evicted_tokens"]) == (held, 31 + max_new - 1 - held), max_new


def test_a_resumed_run_continues_the_kept_steps_elapsed_and_summary(tmp_path, capsys):
    """Resumed at step 2 of a run that took 100 s: elapsed_s continues from 100 s (the report's "last step" time),
    and the console's halves are the whole run's, as the report's."""
    from types import SimpleNamespace

    from kvroll.bench.run_report import markdown, read_run
    from kvroll.trainers.train_log import RewardPrinter

    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "elapsed_s": 50.0 * s, "reward": 0.0})
                                                    + "\n" for s in (1, 2)))
    printer = RewardPrinter(tmp_path, max_steps=4, resume_step=2)
    for step in (3, 4):
        printer.on_log(None, SimpleNamespace(is_world_process_zero=True, global_step=step), None, logs={"reward": 1.0})
    printer.summary()
    assert "mean reward first half 0.000, last half 1.000;" in capsys.readouterr().out
    rows, _ = read_run(tmp_path)
    assert [r["elapsed_s"] >= 100.0 for r in rows[2:]] == [True, True]
    assert "mean reward first half 0.000, last half 1.000." in markdown(rows, {}, tmp_path, {}, None)


def test_an_epoch_based_run_prints_the_trainers_step_count(tmp_path, capsys):
    """max_steps -1 (num_train_epochs decides): the lines read step N/<the trainer's max_steps>, not N/-1."""
    from types import SimpleNamespace

    from kvroll.trainers.train_log import RewardPrinter

    printer = RewardPrinter(tmp_path, max_steps=-1)
    state = SimpleNamespace(is_world_process_zero=True, global_step=1, max_steps=6)
    printer.on_train_begin(None, state, None)
    printer.on_log(None, state, None, logs={"reward": 1.0})
    assert "step   1/6  reward 1.000" in capsys.readouterr().out


def test_only_rank_zero_logs_and_a_free_sync_is_shown(tmp_path, capsys):
    """Another rank's logs write no metrics.jsonl line and print nothing (every rank runs the callback); a weight
    sync that took 0 s (colocate, shared weights) is shown as 0.00ms, not left out as a sync not logged."""
    from types import SimpleNamespace

    from kvroll.trainers.train_log import RewardPrinter, step_line

    printer = RewardPrinter(tmp_path, max_steps=2)
    printer.on_log(None, SimpleNamespace(is_world_process_zero=False, global_step=1), None, logs={"reward": 1.0})
    assert (tmp_path / "metrics.jsonl").read_text() == "" and printer.logged_steps == 0
    assert capsys.readouterr().out == ""
    assert "sync 0.00ms" in step_line(1, 2, {"reward": 1.0}, 0.0, 3.0)


def test_a_resumed_run_drops_the_logged_steps_past_its_checkpoint_and_a_fresh_one_starts_empty(tmp_path):
    """metrics.jsonl of a run stopped at step 4 after checkpoint-2: resumed from checkpoint-2, steps 3-4 go (they are
    logged again, once); a fresh run starts the file empty instead of appending to an earlier run's steps."""
    from types import SimpleNamespace

    from kvroll.trainers.train_log import RewardPrinter

    def steps() -> list[int]:
        return [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]

    four = "".join(json.dumps({"step": s, "reward": 0.5}) + "\n" for s in (1, 2, 3, 4))
    (tmp_path / "metrics.jsonl").write_text(four)
    printer = RewardPrinter(tmp_path, max_steps=4, resume_step=2)
    printer.on_log(None, SimpleNamespace(is_world_process_zero=True, global_step=3), None, logs={"reward": 1.0})
    assert steps() == [1, 2, 3]
    (tmp_path / "metrics.jsonl").write_text(four)
    printer = RewardPrinter(tmp_path, max_steps=4)
    assert steps() == []
    printer.on_log(None, SimpleNamespace(is_world_process_zero=True, global_step=1), None, logs={"reward": 1.0})
    assert steps() == [1]
