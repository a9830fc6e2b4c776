"""``kvroll bench``: the CPU config's report (schema, tables, PNGs of the measured data), partial reports of an
interrupted sweep, and bad input rejected before anything is measured."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvroll.bench import models
from kvroll.bench.config import load_config, parse_overrides
from kvroll.bench.report import rate_text
from kvroll.bench.schema import REPORT_SCHEMA
from kvroll.cli import main

ROOT = Path(__file__).resolve().parents[2]
CPU_CONFIG = ROOT / "configs" / "bench" / "cpu_smollm2.yaml"


@pytest.fixture(scope="module")
def cpu_report(tmp_path_factory):
    """One real sweep of the CPU config (the embedded model): (exit code, out folder, report.json)."""
    out = tmp_path_factory.mktemp("bench_cpu")
    rc = main(["bench", "--config", str(CPU_CONFIG), "--out", str(out), "--no-progress"])
    return rc, out, json.loads((out / "report.json").read_text())


def _png_data(path: Path) -> dict:
    """The PNG's pixels must be a real picture; returns the numbers it says it draws."""
    from PIL import Image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(path) as img:
        assert img.width >= 400 and img.height >= 300
        colors = img.convert("RGB").getcolors(maxcolors=1 << 20)
        assert len(colors) > 20  # axes, text, bars / lines: not a blank canvas
        return json.loads(img.text["kvroll:data"])


def test_cpu_report_validates_and_holds_every_point(cpu_report):
    import jsonschema

    rc, out, report = cpu_report
    jsonschema.validate(report, REPORT_SCHEMA)
    assert rc == 0 and report["status"] == "complete" and report["errors"] == []
    names = [(r["policy"], r["budget"]) for r in report["measurements"]]
    assert names == [("full", None), ("hf_generate", None), ("longflow", 40), ("rkv", 40)]
    env = report["environment"]
    assert env["device"] == "cpu" and env["command"].startswith("kvroll bench --config") and env["weight_bytes"] > 1e8
    lines = (out / "measurements.jsonl").read_text().splitlines()
    assert [json.loads(x)["policy"] for x in lines] == [p for p, _ in names]
    assert load_config(out / "config.yaml").to_dict() == report["config"]


def test_cpu_report_numbers_are_consistent(cpu_report):
    _, _, report = cpu_report
    rows = {r["policy"]: r for r in report["measurements"]}
    full, hf, longflow, rkv = rows["full"], rows["hf_generate"], rows["longflow"], rows["rkv"]
    assert full["x_full"] == 1.0 and hf["x_hf"] == 1.0
    assert rkv["x_full"] == pytest.approx(rkv["tok_s"] / full["tok_s"])
    assert longflow["x_hf"] == pytest.approx(longflow["tok_s"] / hf["tok_s"])
    assert longflow["capacity"] == 40 and rkv["capacity"] == 48 and full["capacity"] == 32 + 48
    assert longflow["kv_bytes_per_seq"] < rkv["kv_bytes_per_seq"] < full["kv_bytes_per_seq"]
    assert not longflow["extrapolated"] and longflow["run_tokens"] == 48 and longflow["batch"] == 2
    # R-KV compresses every 8 steps once its 40 + 8 slots are full (prompt 32): events at steps 16, 24, 32, 40
    assert rkv["events"] >= 3 and rkv["event_interval_steps"] == 8 and 0 < rkv["policy_share"] < 1
    assert longflow["events"] == 0 and "policy_share" not in longflow
    for r in report["measurements"]:
        assert r["floor_step_ms"] < r["steady_step_ms"]  # nothing beats the roofline
    # the floor's live tokens: a periodic policy's averaged over the steady window's decode steps. LongFlow's cache
    # stays full (40). R-KV's fills to 48, then an event leaves 40 (+ the step's token): a host replay of that
    # schedule over the same steps (a mark per token on a CPU; the last quarter of the marks) gives its mean
    assert longflow["mean_live_tokens"] == longflow["live_tokens_end"] == 40
    count, after = 32, []  # the prompt's 32 tokens; then the count after each decode step 1..47
    for _ in range(47):
        count = (40 if count + 1 > 48 else count) + 1
        after.append(count)
    marks = list(range(1, 49))
    first = marks[len(marks) * 3 // 4]  # the steady window: tokens first + 1 .. 48, decode steps first .. 47
    window = after[first - 1:47]
    assert rkv["live_tokens_end"] == after[-1] == 47
    assert rkv["mean_live_tokens"] == pytest.approx(sum(window) / len(window)) and len(window) == 11
    # the step profiled for the kernels' times (CUDA) holds that mean, rounded; a step policy's its capacity
    assert rkv["kernel_live_tokens"] == round(sum(window) / len(window)) and longflow["kernel_live_tokens"] == 40


def test_cpu_report_markdown_has_the_tables(cpu_report):
    _, out, report = cpu_report
    text = (out / "report.md").read_text()
    for title in ("## Generated tokens/s", "## KV memory per sequence", "## Steady decode step against the roofline",
                  "## Periodic policy work", "## Plots"):
        assert title in text
    rkv = next(r for r in report["measurements"] if r["policy"] == "rkv")
    assert f"| rkv 40 | 2 (2) | 48 | {rate_text(rkv['tok_s'])} | {rkv['x_full']:,.2f}x |" in text
    assert f"{100 * rkv['policy_share']:,.1f}%" in text
    for png in report["plots"].values():
        assert f"]({png})" in text and (out / png).is_file()


def test_cpu_report_pngs_draw_the_measured_data(cpu_report):
    _, out, report = cpu_report
    rows = report["measurements"]
    throughput = _png_data(out / report["plots"]["throughput"])
    assert throughput["tok_s"] == [r["tok_s"] for r in rows]
    assert throughput["extrapolated"] == [False] * len(rows)  # every compressing run here is whole (48 tokens)
    steps = _png_data(out / report["plots"]["step"])
    assert sorted(s["step_ms"] for s in steps.values()) == sorted([c[1] for c in r["step_curve"]]
                                                                  for r in rows if r["kind"] == "engine")
    memory = _png_data(out / report["plots"]["memory"])
    assert memory["kv_mib_per_seq"] == [r["kv_bytes_per_seq"] / 2**20 for r in rows]
    assert memory["largest_batch"] == [r["largest_batch"] for r in rows]


@pytest.fixture
def tiny_bench(monkeypatch):
    """The sweep on conftest's tiny random Llama instead of the embedded model (seconds, not a minute)."""
    from tests.conftest import tiny_model

    monkeypatch.setattr(models, "build_model", lambda *args: tiny_model("llama"))


def test_interrupted_sweep_keeps_what_it_measured(tmp_path, tiny_bench, monkeypatch, capsys):
    from kvroll.bench import measure

    def interrupt(bench, policy, *args):
        raise KeyboardInterrupt

    monkeypatch.setattr(measure, "measure_policy", interrupt)
    rc = main(["bench", "--config", str(CPU_CONFIG), "--out", str(tmp_path), "--no-progress", "--policies", "full,rkv"])
    assert rc == 130 and "interrupted" in capsys.readouterr().err
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["status"] == "interrupted"
    assert [r["policy"] for r in report["measurements"]] == ["full", "hf_generate"]
    assert len((tmp_path / "measurements.jsonl").read_text().splitlines()) == 2
    assert "**partial** (interrupted)" in (tmp_path / "report.md").read_text()
    assert (tmp_path / "tokens_per_s.png").is_file()


def test_failed_point_is_reported_and_the_sweep_goes_on(tmp_path, tiny_bench, monkeypatch):
    from kvroll.bench import measure

    def oom(*args):
        raise RuntimeError("out of memory (simulated)")

    monkeypatch.setattr(measure, "measure_hf", oom)
    rc = main(["bench", "--config", str(CPU_CONFIG), "--out", str(tmp_path), "--no-progress",
               "--policies", "full,longflow"])
    report = json.loads((tmp_path / "report.json").read_text())
    assert rc == 1 and report["status"] == "complete"
    assert [r["policy"] for r in report["measurements"]] == ["full", "longflow"]
    assert report["errors"][0]["policy"] == "hf_generate" and "simulated" in report["errors"][0]["error"]
    assert "## Errors" in (tmp_path / "report.md").read_text()


@pytest.mark.parametrize("override, message", [
    (["--policies", "full,nosuchpolicy"], "'nosuchpolicy', which is not a known policy"),
    (["--policies", "[]"], "policies is empty"),
    (["--batch_sizes", "[]"], "batch_sizes is empty"),
    (["--output_lengths", "[]"], "output_lengths is empty"),
    (["--budgets", "[]"], "budgets of 'longflow' is empty"),
    (["--batch_sizes", "0"], "batch_sizes holds 0"),
    (["--budgets", "{rkv: [40]}"], "gives no budget for 'longflow'"),
    (["--policies", "full,lagkv"], "lagkv at budget 40"),
    (["--hf_new_tokens", "16,4"], "hf_new_tokens=[16, 4]"),
    (["--output_lengths", "8", "--full_steps", "2"], "hf_new_tokens=[4, 16] runs past the shortest output length 8"),
    (["--no_such_field", "1"], "unknown field(s) ['no_such_field']"),
    (["--model", "/nonexistent/model"], "model='/nonexistent/model'"),
    (["--architecture", "qwen3-1.7b"], "set exactly one of them"),
    (["--seed", "abc"], "seed='abc' is invalid: it must be an integer in [0, 2**63)"),
    (["--seed", "-1"], "seed=-1 is invalid"),
    (["--temperature", ".nan"], "temperature=nan is invalid"),
    (["--temperature", "true"], "temperature=True is invalid"),
    (["--temperature", "1.0e-9"], "temperature=1e-09 is invalid: it must be 0 (greedy) or a finite number >= 1e-05"),
    (["--model", "123"], "model=123 is invalid: it must be a string"),
    (["--policies", "[[full]]"], "policies holds ['full'], which is not a known policy"),
    (["--reserve_gb", "true"], "reserve_gb=True is invalid"),
    (["--reserve_gb", ".inf"], "reserve_gb=inf is invalid"),
    (["--budgets", "[1,"], "--budgets '[1,' is not a valid YAML value"),
    # the embedded model has 8,192 positions (its config.json); the CPU config sweeps full with a 32-token prompt
    (["--budgets", "9000"], "longflow at budget 9000: CompressionConfig.budget=9000 exceeds the model's "
                            "max_position_embeddings=8192"),
    (["--policy_kwargs", "{rkv: {buffer: 9000}}"], "rkv at budget 40: CompressionConfig.buffer=9000 exceeds"),
    (["--prompt_length", "9000"], "prompt_length=9000 exceeds the model's max_position_embeddings=8192"),
    (["--output_lengths", "48,8161"], "output_lengths holds 8161: prompt_length=32 + 8161 = 8193 exceeds the model's "
                                      "max_position_embeddings=8192, and policy 'full' keeps every token at its true "
                                      "position; use output_lengths <= 8160"),
    (["--model", "null", "--architecture", "qwen3-0.6b", "--prompt_length", "40961"],
     "prompt_length=40961 exceeds the model's max_position_embeddings=40960"),
    (["--budgets", "64,64"], "budgets of 'longflow'=[64, 64] lists 64 twice"),
    (["--hf_generate", "'false'"], "hf_generate='false' is invalid: it must be true or false"),  # truthy
    (["--budgets", "{longflow: [40], longflw: [32]}"], "budgets names ['longflw'], which are not known policies"),
    (["--batch_sizes", "2,2"], "batch_sizes=[2, 2] lists 2 twice"),
    (["--output_lengths", "48,48"], "output_lengths=[48, 48] lists 48 twice"),
])
def test_bad_config_is_rejected_before_measuring(tmp_path, monkeypatch, capsys, override, message):
    def no_model(*args):
        raise AssertionError("the model was loaded before the config was checked")

    monkeypatch.setattr(models, "build_model", no_model)
    rc = main(["bench", "--config", str(CPU_CONFIG), "--out", str(tmp_path / "out"), *override])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and err.startswith("kvroll bench: error:")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("config, message", [
    ("{not json", "has a config.json that cannot be read as JSON"),
    ('{"model_type": "llama"}', "has a config.json but no weights (no *.safetensors, "),
])
def test_a_model_directory_that_cannot_load_is_rejected_before_measuring(tmp_path, monkeypatch, capsys, config,
                                                                          message):
    """transformers raised an OSError traceback for these once the sweep loaded the model."""
    monkeypatch.setattr(models, "build_model", lambda *a: pytest.fail("the model was loaded before the check"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(config)
    rc = main(["bench", "--config", str(CPU_CONFIG), "--out", str(tmp_path / "out"), "--model", str(model)])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"kvroll bench: error: model='{model}' {message}"), err
    assert "or set 'architecture' for random weights" in err and not (tmp_path / "out").exists()


def test_compressing_policies_may_run_past_the_positions_full_may_not():
    """As generate: past max_position_embeddings is an error for full only (the others' cache stays bounded)."""
    overrides = ["--output_lengths", "8161", "--policies", "longflow,rkv"]
    assert load_config(CPU_CONFIG, overrides).output_lengths == [8161]
    assert load_config(CPU_CONFIG, ["--output_lengths", "8160"]).output_lengths == [8160]


def test_unwritable_out_is_rejected_before_measuring(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(models, "build_model", lambda *a: pytest.fail("measured before checking --out"))
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    rc = main(["bench", "--config", str(CPU_CONFIG), "--out", str(blocker / "out")])
    assert rc == 2 and f"--out {blocker / 'out'} is not a writable directory" in capsys.readouterr().err


def test_overrides_are_read_as_yaml_and_lists():
    got = parse_overrides(["--batch_sizes", "2,max", "--hf_generate=false", "--budgets", "{rkv: [64, 128]}",
                           "--reserve-gb", "0.5"])
    assert got == {"batch_sizes": [2, "max"], "hf_generate": False, "budgets": {"rkv": [64, 128]}, "reserve_gb": 0.5}
    with pytest.raises(ValueError, match="--budgets has no value"):
        parse_overrides(["--budgets"])
    assert parse_overrides(["--budgets", "64,,128,"]) == {"budgets": [64, 128]}  # empty items dropped, not None


def test_gpu_config_sweeps_the_paper_points():
    config = load_config(ROOT / "configs" / "bench" / "qwen3_1.7b_h100.yaml")
    points = [(p["policy"], p["budget"]) for p in config.points()]
    assert points == [("full", None), ("hf_generate", None), ("longflow", 3200), ("rkv", 1024), ("lagkv", 1024),
                      ("hardkv", 1024), ("snapkv", 1024)]
    assert config.output_lengths == [16384] and config.architecture == "qwen3-1.7b"


@pytest.mark.parametrize("name", sorted(models.ARCHITECTURES))
def test_every_architecture_builds_with_its_shapes(name):
    """Each random-weight architecture builds through ``build_model`` (one layer, a small vocabulary, on the CPU)
    with the shapes its published config gives, and runs a forward."""
    spec = dict(models.ARCHITECTURES[name], num_hidden_layers=1, vocab_size=512)
    net = models.build_model(None, spec, torch.float32, torch.device("cpu"), seed=0)
    cfg = net.config
    attn = net.model.layers[0].self_attn
    assert attn.q_proj.weight.shape == (cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size)
    assert attn.k_proj.weight.shape == (cfg.num_key_value_heads * cfg.head_dim, cfg.hidden_size)
    assert net.model.layers[0].mlp.down_proj.weight.shape == (cfg.hidden_size, cfg.intermediate_size)
    assert net(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 512)
    assert net.generation_config.eos_token_id is None


def test_throughput_plot_hatches_the_extrapolated_rates(tmp_path):
    """A compressing policy's rate from a shorter real run is hatched (and flagged in the PNG's data); a whole run,
    ``full``'s context sweep and HF's two runs are not."""
    from kvroll.bench.plots import partial, plot_throughput

    rows = [{"kind": "engine", "policy": "full", "budget": None, "batch": 2, "length": 48, "run_tokens": 24,
             "tok_s": 14.0},
            {"kind": "hf_generate", "policy": "hf_generate", "budget": None, "batch": 2, "length": 48,
             "run_tokens": 16, "tok_s": 13.0},
            {"kind": "engine", "policy": "rkv", "budget": 40, "batch": 2, "length": 48, "run_tokens": 48,
             "tok_s": 15.0},
            {"kind": "engine", "policy": "longflow", "budget": 40, "batch": 2, "length": 48, "run_tokens": 16,
             "tok_s": 17.0}]
    assert [partial(r) for r in rows] == [False, False, False, True]
    data = plot_throughput(rows, tmp_path / "t.png")
    assert data["extrapolated"] == [False, False, False, True] and _png_data(tmp_path / "t.png") == data


def test_engine_rates_and_step_over_floor_by_their_definitions(cpu_report):
    """A compressing policy's run of the whole output (nothing extrapolated): its rate is the decode rate of the
    run's marks; every row's step / floor is its steady step over its floor."""
    _, _, report = cpu_report
    for r in report["measurements"]:
        assert r["step_over_floor"] == pytest.approx(r["steady_step_ms"] / r["floor_step_ms"])
        if r["kind"] == "engine" and r["policy"] != "full":
            assert not r["extrapolated"] and r["run_tokens"] == r["length"]
            assert r["tok_s"] == pytest.approx(r["decode_tok_s"])


def test_a_config_that_is_not_utf8_or_a_typo_in_an_override_is_named(tmp_path, monkeypatch, capsys):
    """A latin-1 config is one line naming --config (was: "'utf-8' codec can't decode ..." with no file); an unknown
    --FIELD is blamed on the overrides, not on the config file that does not hold it."""
    monkeypatch.setattr(models, "build_model", lambda *a: pytest.fail("measured before checking the config"))
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("model: caf\xe9\n".encode("latin-1"))
    assert main(["bench", "--config", str(latin1), "--out", str(tmp_path / "out")]) == 2
    assert main(["bench", "--config", str(CPU_CONFIG), "--out", str(tmp_path / "out"), "--polices", "full"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"kvroll bench: error: --config {latin1} is not UTF-8 text (byte 10: invalid continuation " \
                     "byte); save it as UTF-8."
    assert err[1].startswith("kvroll bench: error: the --FIELD overrides: unknown field(s) ['polices']")
    assert not (tmp_path / "out").exists()


def test_a_sweep_into_a_used_out_keeps_the_earlier_one(tmp_path, tiny_bench, monkeypatch, capsys):
    """A second sweep into the same --out (the default is runs/bench/<config name>) moves the first one's files
    to previous-<time>/ (was: its measurements dropped, its PNGs left beside the new report)."""
    from kvroll.bench import measure

    args = ["bench", "--config", str(CPU_CONFIG), "--out", str(tmp_path), "--no-progress", "--hf_generate", "false"]
    assert main(args + ["--policies", "full,longflow"]) == 0
    first = json.loads((tmp_path / "report.json").read_text())
    monkeypatch.setattr(measure, "measure_full", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt))
    assert main(args + ["--policies", "full,rkv"]) == 130
    (kept,) = tmp_path.glob("previous-*")
    assert f"its files moved to {kept}" in capsys.readouterr().err
    assert json.loads((kept / "report.json").read_text())["measurements"] == first["measurements"]
    assert len((kept / "measurements.jsonl").read_text().splitlines()) == 2 and (kept / "tokens_per_s.png").is_file()
    assert json.loads((tmp_path / "report.json").read_text())["measurements"] == []
    assert not list(tmp_path.glob("*.png"))


def test_a_sweep_into_an_out_another_sweep_is_writing_is_refused_before_moving_anything(tmp_path, monkeypatch, capsys):
    """A second `kvroll bench` into the --out of one still running is refused at once, naming --out (was: each moved
    the other's report, measurements and PNGs to previous-* as it started)."""
    from kvroll.files import exclusive

    monkeypatch.setattr(models, "build_model", lambda *a: pytest.fail("measured while another sweep holds --out"))
    (tmp_path / "report.json").write_text('{"measurements": []}')
    with exclusive(tmp_path, "kvroll bench", "--out"):
        assert main(["bench", "--config", str(CPU_CONFIG), "--out", str(tmp_path), "--no-progress"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"kvroll bench: error: --out {tmp_path} is in use by another kvroll bench (pid "
                   f"{__import__('os').getpid()}); wait for it to finish, or pass another --out."]
    assert (tmp_path / "report.json").is_file() and not list(tmp_path.glob("previous-*"))


def test_two_writers_of_one_report_each_rename_a_whole_file(tmp_path, monkeypatch):
    """Two sweeps with one --out rewrite report.json at once: each writes a temporary file of its own (was: one shared
    report.json.tmp, so the second writer's rename took the first's file away and the first failed with
    FileNotFoundError). The second write lands while the first is about to rename."""
    from kvroll import files
    from kvroll.bench import report as reports

    replace, nested = files.os.replace, []

    def other_writer_meanwhile(src, dst):
        if not nested:
            nested.append(src)
            reports.write_json(dst, {"writer": "second"})
        replace(src, dst)

    monkeypatch.setattr(files.os, "replace", other_writer_meanwhile)
    reports.write_json(tmp_path / "report.json", {"writer": "first"})
    assert nested  # renamed into place, not written where a reader (or a kill) sees half a file
    assert json.loads((tmp_path / "report.json").read_text()) == {"writer": "first"}
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]  # no temporary file left


def test_a_report_write_cut_short_leaves_the_earlier_report_whole(tmp_path, monkeypatch):
    """A write that stops halfway (as a kill would: here text that cannot be encoded past its first bytes) leaves the
    report.json written before whole: the new text goes to a temporary file, renamed into place only when complete."""
    from kvroll.bench import report as reports

    reports.write_json(tmp_path / "report.json", {"measurements": [1]})
    monkeypatch.setattr(reports.json, "dumps", lambda *args, **kwargs: '{"measurements": [1, 2], "cut": "\ud800"}')
    with pytest.raises(UnicodeEncodeError):
        reports.write_json(tmp_path / "report.json", {"measurements": [1, 2]})
    monkeypatch.undo()
    assert json.loads((tmp_path / "report.json").read_text()) == {"measurements": [1]}
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]  # the cut temporary file removed


def test_a_bad_config_is_answered_before_torch_loads(tmp_path):
    """In a fresh interpreter: status 2 and one line each, torch not imported (it cost ~2 s before the error: the
    config module, the architectures and the sweep's --out check imported it)."""
    script = f"""
import json, sys
from kvroll.cli import main
config = ["bench", "--config", {str(CPU_CONFIG)!r}, "--out", {str(tmp_path / "out")!r}]
runs = [["bench", "--config", "missing.yaml"], [*config, "--batch_szes", "2"], [*config, "--model", "/no/such/model"],
        [*config, "--model", "null", "--architecture", "qwen9"], [*config, "--batch_sizes", "0"],
        [*config, "--hf_new_tokens", "[80, 16]"], [*config, "--policies", "full,rkvv"]]
codes = [main(argv) for argv in runs]
print(json.dumps({{"codes": codes, "torch": "torch" in sys.modules}}))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert json.loads(done.stdout) == {"codes": [2] * 7, "torch": False}, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 7 and all(line.startswith("kvroll bench: error: ") for line in lines), lines
    assert "unknown field(s) ['batch_szes']" in lines[1] and "architecture='qwen9' is unknown" in lines[3]
    assert "'rkvv', which is not a known policy" in lines[6] and not (tmp_path / "out").exists()
