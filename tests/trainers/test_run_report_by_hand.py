"""Every number of a report.md against a hand computation from logs written here, and the report's budget, IS range,
step rows, --out check and plots (each test names the change it catches)."""
import json

from kvroll.cli import main as cli_main

ROWS = [  # three GRPO-like rollout steps and one PPO-like step between rollouts (no reward, a sync)
    {"step": 1, "elapsed_s": 5.0, "reward": 0.2, "kvroll/rollout_tokens_per_second": 50.0,
     "kvroll/rollout_seconds": 2.0, "kvroll/step_seconds": 4.0, "kvroll/completion_length/mean": 10.0,
     "kvroll/truncated_fraction": 0.5, "kvroll/kv_bytes": 1.0 * 2**20, "kvroll/kv_bytes_full_equivalent": 4.0 * 2**20,
     "kvroll/evicted_tokens": 6.0, "sampling/sampling_logp_difference/mean": 0.01,
     "sampling/importance_sampling_ratio/min": 0.9, "sampling/importance_sampling_ratio/max": 1.1,
     "kvroll/budget": 16},
    {"step": 2, "elapsed_s": 7.0, "loss": 0.1, "kvroll/step_seconds": 2.0, "kvroll/sync_seconds": 0.004},
    {"step": 3, "elapsed_s": 12.5, "reward": 0.4, "kvroll/rollout_tokens_per_second": 100.0,
     "kvroll/rollout_seconds": 1.0, "kvroll/step_seconds": 3.0, "kvroll/completion_length/mean": 20.0,
     "kvroll/truncated_fraction": 0.0, "kvroll/kv_bytes": 3.0 * 2**20, "kvroll/kv_bytes_full_equivalent": 4.0 * 2**20,
     "kvroll/evicted_tokens": 2.0, "sampling/sampling_logp_difference/mean": 0.03,
     "sampling/importance_sampling_ratio/min": 0.8, "sampling/importance_sampling_ratio/max": 1.5,
     "kvroll/budget": 32},
    {"step": 4, "elapsed_s": 20.0, "reward": 1.0, "kvroll/rollout_tokens_per_second": 20.0,
     "kvroll/rollout_seconds": 4.0, "kvroll/step_seconds": 5.0, "kvroll/completion_length/mean": 30.0,
     "kvroll/truncated_fraction": 0.25, "kvroll/kv_bytes": 2.0 * 2**20, "kvroll/kv_bytes_full_equivalent": 4.0 * 2**20,
     "kvroll/evicted_tokens": 4.0, "sampling/sampling_logp_difference/mean": 0.02,
     "sampling/importance_sampling_ratio/min": 0.95, "sampling/importance_sampling_ratio/max": 1.05,
     "kvroll/budget": 32},
]


def _run(tmp_path, rows=ROWS):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def test_every_summary_number_by_hand(tmp_path):
    """Halves: 3 rewarded steps, half = 1: 0.2 | 1.0. Rate: (50*2 + 100*1 + 20*4) / (2+1+4) = 40.0 tokens/s. Share:
    (2+1+4) / (4+2+3+5) = 50%. Lengths 20.0, truncated 0.25. KV 2 MiB / 4 MiB = 0.50x at the LAST budget (32, not
    the first 16: mutant M7); evicted 4. |dlogp| 0.020; IS 0.800 (the min of the mins, not the max: M10) to 1.500."""
    assert cli_main(["report", str(_run(tmp_path))]) == 0
    text = (tmp_path / "report.md").read_text()
    assert "* 4 logged steps (last step 4, 20.0 s); mean reward first half 0.200, last half 1.000." in text
    assert ("* Rollouts: 40.0 generated tokens/s, 50% of the steps' wall time; completions 20.0 tokens on average, "
            "0.25 truncated.") in text
    assert ("* KV held for a step's rows: 2.00 MiB against 4.00 MiB with full KV (0.50x) at budget 32; 4 tokens "
            "evicted a step.") in text
    assert "* Mismatch: mean |dlogp| 0.020; IS ratio 0.800-1.500." in text
    assert "| 2 | - | - | - | - | - | - | - | - | - | - | - | - | - | 4.00 |" in text
    assert "| 3 | 0.400 | 100.0 | - | 20.0 | - | 0.00 | 3.00 | 4.00 | 2 | 0.030 | 0.800 | 1.500 | - | - |" in text


def test_a_logged_object_without_a_step_is_left_out(tmp_path):
    """Mutant M12 (no "step" filter): KeyError 'step' on a metrics.jsonl object without one."""
    assert cli_main(["report", str(_run(tmp_path, [{"step": 1, "reward": 0.5}, {"reward": 0.9}]))]) == 0
    assert "* 1 logged step (last step 1" in (tmp_path / "report.md").read_text()


def test_a_folder_that_is_no_run_is_named_before_an_unwritable_out(tmp_path, capsys):
    """Both wrong: the RUN_DIR's error, one line (mutant M16 said --out's); --out a file, RUN_DIR a run: --out's
    error, one line, and nothing written."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    (tmp_path / "empty").mkdir()
    assert cli_main(["report", str(tmp_path / "empty"), "--out", str(blocker)]) == 2
    err = capsys.readouterr().err.strip()
    assert "holds no training logs" in err and "\n" not in err, err
    (tmp_path / "run").mkdir()
    run = _run(tmp_path / "run")
    assert cli_main(["report", str(run), "--out", str(blocker / "sub")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"kvroll report: error: --out {blocker / 'sub'} is not a writable directory: {blocker} is a file."
    assert not (run / "report.md").exists() and not (run / "reward.png").exists()


def test_the_plots_carry_their_series_and_a_legend(tmp_path, monkeypatch):
    """Each PNG's kvroll:data chunk holds the series drawn (mutant M28 dropped them) and a chart with series has
    a legend (mutant M27 drew none)."""
    from matplotlib.axes import Axes
    from PIL import Image

    from kvroll.bench.run_report import write_plots

    legends = []
    real = Axes.legend
    monkeypatch.setattr(Axes, "legend", lambda self, *a, **k: legends.append(k.get("loc")) or real(self, *a, **k))
    write_plots(tmp_path, ROWS)
    data = json.loads(Image.open(tmp_path / "reward.png").text["kvroll:data"])
    assert data == {"step": [1, 2, 3, 4], "reward": [0.2, None, 0.4, 1.0]}
    mismatch = json.loads(Image.open(tmp_path / "mismatch.png").text["kvroll:data"])
    assert mismatch["importance-sampling ratio max"] == [1.1, None, 1.5, 1.05]
    assert legends.count("upper left") == 4  # reward, throughput, lengths, mismatch each have a series


def test_an_is_range_with_a_bound_not_logged_names_the_one_it_has(tmp_path):
    """A bound no step logged printed as "-" beside the other's minus sign ("--1.500", "0.800--", "--inf")."""
    cases = [({"sampling/importance_sampling_ratio/max": 1.5}, "IS ratio max 1.500 (no min logged)."),
             ({"sampling/importance_sampling_ratio/max": float("inf")}, "IS ratio max inf (no min logged)."),
             ({"sampling/importance_sampling_ratio/min": 0.8}, "IS ratio min 0.800 (no max logged)."),
             ({}, "IS ratio -.")]
    for number, (logged, want) in enumerate(cases):
        (tmp_path / str(number)).mkdir()
        run = _run(tmp_path / str(number), [{"step": 1, "reward": 0.5, **logged}])
        assert cli_main(["report", str(run)]) == 0
        line = next(x for x in (run / "report.md").read_text().splitlines() if x.startswith("* Mismatch"))
        assert line == f"* Mismatch: mean |dlogp| -; {want}", line


def test_a_run_without_run_json_says_so_in_its_header(tmp_path):
    """Without run.json the report had its title and no settings line; with one, that line (not this one)."""
    (tmp_path / "grpo_run").mkdir()
    run = _run(tmp_path / "grpo_run", [{"step": 1, "reward": 0.5}])
    assert cli_main(["report", str(run)]) == 0
    lines = (run / "report.md").read_text().splitlines()
    assert lines[:3] == [f"# kvroll train: {run}", "", "* Model and settings unknown: no run.json in grpo_run."]
    (run / "run.json").write_text(json.dumps({"model": "m", "rollouts": "kvroll rkv budget 16"}))
    assert cli_main(["report", str(run)]) == 0
    text = (run / "report.md").read_text()
    assert "* Model m, grpo, rollouts: kvroll rkv budget 16," in text and "no run.json" not in text
