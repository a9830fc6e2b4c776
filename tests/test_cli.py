"""``kvroll`` as a new user meets it: --help, bad files, models and output paths, Ctrl-C (train's: tests/trainers)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvroll.cli import main

ROOT = Path(__file__).parents[1]
CONFIG = ROOT / "configs" / "grpo_smollm2.yaml"


def test_help_lists_only_commands_that_run(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--help"])
    assert stop.value.code == 0
    text = capsys.readouterr().out
    listed = re.search(r"\{([a-z,]+)\}", text).group(1).split(",")
    assert set(listed) == {"generate", "eval", "train", "bench", "report"}
    assert set(re.findall(r"kvroll (\w+)", text)) <= set(listed)
    for command in listed:
        with pytest.raises(SystemExit) as stop:
            main([command, "--help"])
        assert stop.value.code == 0, command


def test_bad_input_is_answered_before_torch_loads(tmp_path):
    """In a fresh interpreter: one line, status 2, and neither torch nor TRL imported (a typo costs ~0.3 s)."""
    (tmp_path / "file").write_text("x")
    script = f"""
import json, sys
from kvroll.cli import main
runs = [["train", "--config", "missing.yaml"],
        ["train", "--config", {str(CONFIG)!r}, "--max_stpes", "3"],
        ["train", "--config", {str(CONFIG)!r}, "--model", "/no/such/model"],
        ["generate", "--prompt", "hi", "--out", {str(tmp_path / "file" / "out.jsonl")!r}],
        ["eval", "fidelity", "--prompts", "missing.jsonl"],
        ["train", "--config", {str(CONFIG)!r}, "--kvroll_policy", "longflw"],
        ["generate", "--prompt", "hi", "--policy", "rkvv"],
        ["eval", "fidelity", "--policies", "full,nope"]]
codes = [main(argv) for argv in runs]
print(json.dumps({{"codes": codes, "heavy": [m for m in ("torch", "transformers", "trl") if m in sys.modules]}}))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    result = json.loads(done.stdout)
    assert result == {"codes": [2] * 8, "heavy": []}, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 8 and all(re.match(r"kvroll (train|generate|eval): error: ", line) for line in lines)
    assert "missing.yaml does not exist" in lines[0] and "did you mean --max_steps" in lines[1]
    assert "/no/such/model does not exist" in lines[2] and "file is a file" in lines[3]
    assert "--kvroll_policy 'longflw' is not a known policy" in lines[5] and "did you mean 'longflow'?" in lines[5]
    assert "--policy 'rkvv' is not a known policy" in lines[6] and "did you mean 'rkv'?" in lines[6]
    assert "--policies 'nope' is not a known policy; choose one of ['full', " in lines[7]


@pytest.fixture
def no_engine(monkeypatch):
    """Fails the test if a model would load: every check must come first."""
    import kvroll.bench.fidelity
    import kvroll.rollout.engine

    def loads(*args, **kwargs):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr(kvroll.rollout.engine, "RolloutEngine", loads)
    monkeypatch.setattr(kvroll.bench.fidelity, "run_fidelity", loads)


def _bad_files(tmp_path: Path) -> dict[str, Path]:
    (tmp_path / "file").write_text("x")
    (tmp_path / "latin1.jsonl").write_bytes('{"prompt": "caf\xe9"}\n'.encode("latin-1"))
    (tmp_path / "broken.jsonl").write_text('{"prompt": "a"}\n{"prompt": \n')
    return {"missing": tmp_path / "missing.jsonl", "latin1": tmp_path / "latin1.jsonl",
            "broken": tmp_path / "broken.jsonl", "under_file": tmp_path / "file" / "out"}


@pytest.mark.parametrize("case, message", [
    ("missing", "missing.jsonl does not exist"),
    ("latin1", "latin1.jsonl is not UTF-8 text"),
    ("broken", "broken.jsonl:2 is not JSON"),
    ("model", "--model /no/such/model does not exist"),
    ("out", "out.jsonl cannot be written: "),
])
def test_generate_rejects_bad_input(tmp_path, capsys, no_engine, case, message):
    files = _bad_files(tmp_path)
    if case == "model":
        argv = ["generate", "--prompt", "hi", "--model", "/no/such/model"]
    elif case == "out":
        argv = ["generate", "--prompt", "hi", "--out", str(files["under_file"] / "out.jsonl")]
    else:
        argv = ["generate", "--prompts-file", str(files[case])]
    assert main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("kvroll generate: error: ") and message in err[0]


@pytest.mark.parametrize("case, message", [
    ("missing", "--prompts"), ("latin1", "is not UTF-8 text"), ("broken", "broken.jsonl:2 is not JSON"),
    ("model", "--model /no/such/model does not exist"), ("out", "is not a writable directory: "),
])
def test_eval_fidelity_rejects_bad_input(tmp_path, capsys, no_engine, case, message):
    files = _bad_files(tmp_path)
    argv = ["eval", "fidelity", "--policies", "full", "--budgets", "64", "--out", str(tmp_path / "fid")]
    if case == "model":
        argv += ["--model", "/no/such/model"]
    elif case == "out":
        argv += ["--out", str(files["under_file"])]
    else:
        argv += ["--prompts", str(files[case])]
    assert main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("kvroll eval: error: ") and message in err[0]


def _bad_model_dirs(tmp_path: Path) -> dict[str, Path]:
    """A damaged config.json, a config that is not an object, a config with no weights beside it, and a model with
    no tokenizer's vocabulary (tokenizer_config.json alone holds none)."""
    dirs = {name: tmp_path / name for name in ("badjson", "listjson", "noweights", "notokenizer")}
    for path in dirs.values():
        path.mkdir()
    (dirs["badjson"] / "config.json").write_text("{not json")
    (dirs["listjson"] / "config.json").write_text("[1, 2]")
    (dirs["noweights"] / "config.json").write_text('{"model_type": "llama"}')
    (dirs["noweights"] / "tokenizer.json").write_text("{}")
    (dirs["notokenizer"] / "config.json").write_text('{"model_type": "llama"}')
    (dirs["notokenizer"] / "model.safetensors").write_text("")
    (dirs["notokenizer"] / "tokenizer_config.json").write_text("{}")
    return dirs


@pytest.mark.parametrize("case, message", [
    ("badjson", "badjson has a config.json that cannot be read as JSON ("),
    ("listjson", "listjson has a config.json that is not a JSON object (it holds a list)"),
    ("noweights", "noweights has a config.json but no weights (no *.safetensors, pytorch_model*.bin or *.gguf "),
    ("notokenizer", "notokenizer has no tokenizer files (no tokenizer.json, tokenizer.model or vocab.json); copy "),
])
@pytest.mark.parametrize("command", ["generate", "eval", "train"])
def test_a_model_directory_that_cannot_load_is_one_line_before_torch(tmp_path, capsys, no_engine, case, message,
                                                                      command):
    """transformers raised a 15-frame OSError traceback for these, after torch and the model's config loaded."""
    model = str(_bad_model_dirs(tmp_path)[case])
    argv = {"generate": ["generate", "--prompt", "hi", "--model", model],
            "eval": ["eval", "fidelity", "--policies", "full", "--budgets", "64", "--model", model,
                     "--out", str(tmp_path / "fid")],
            "train": ["train", "--config", "configs/grpo_smollm2.yaml", "--model", model,
                      "--output_dir", str(tmp_path / "run")]}[command]
    assert main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"kvroll {command}: error: --model {model} ") and message in err[0]


@pytest.mark.parametrize("files, config, loadable", [
    (["model.safetensors"], {}, True),
    (["model-00001-of-00002.safetensors", "model.safetensors.index.json"], {}, True),  # shards
    (["model.safetensors.index.json"], {}, False),  # a '*.json'-only download: no shard (which are: transformers')
    (["pytorch_model.bin"], {}, True),
    (["pytorch_model-00001-of-00002.bin", "pytorch_model.bin.index.json"], {}, True),
    (["model.fp16.safetensors"], {}, True),  # model_init_kwargs: {variant: fp16}
    (["model-q4.gguf"], {}, True),  # model_init_kwargs: {gguf_file: ...}
    (["weights.pt"], {"transformers_weights": "weights.pt"}, True),  # the file the config names
    (["weights.pt"], {"transformers_weights": "other.pt"}, False),
    (["tokenizer.json", "training_args.bin", "optimizer.pt"], {}, False),  # a tokenizer or trainer-state folder
])
def test_model_dir_problem_knows_transformers_weight_files(tmp_path, files, config, loadable):
    from kvroll.model_dir import model_dir_problem

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **config}))
    for name in files:
        (tmp_path / name).write_text("")
    problem = model_dir_problem(tmp_path)
    assert problem is None if loadable else problem.startswith("has a config.json but no weights"), problem
    assert model_dir_problem(tmp_path, weights=False) is None


@pytest.mark.parametrize("files, has_tokenizer", [
    (["tokenizer.json"], True), (["tokenizer.model"], True), (["vocab.json", "merges.txt"], True),
    (["vocab.txt"], True), (["spiece.model"], True), (["sentencepiece.bpe.model"], True), (["cl100k.tiktoken"], True),
    (["tekken.json"], True),  # Mistral's own format
    (["model-q4.gguf"], True),  # a GGUF file carries its tokenizer
    (["tokenizer_config.json", "special_tokens_map.json"], False), ([], False),
])
def test_model_dir_problem_knows_a_tokenizers_files(tmp_path, files, has_tokenizer):
    from kvroll.model_dir import model_dir_problem

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    for name in ["model.safetensors", *files]:
        (tmp_path / name).write_text("")
    assert model_dir_problem(tmp_path) is None  # the tokenizer is checked only where asked for
    problem = model_dir_problem(tmp_path, tokenizer=True)
    assert problem is None if has_tokenizer else problem.startswith("has no tokenizer files"), problem


def test_a_model_directory_that_cannot_load_is_a_value_error_in_the_api(tmp_path):
    from kvroll import RolloutEngine
    from kvroll.rollout.model import load_config

    dirs = _bad_model_dirs(tmp_path)
    with pytest.raises(ValueError, match=r"badjson' has a config.json that cannot be read as JSON"):
        RolloutEngine(str(dirs["badjson"]))
    with pytest.raises(ValueError, match=r"noweights' has a config.json but no weights"):
        RolloutEngine(str(dirs["noweights"]))
    # transformers failed here after the weights loaded, with advice to install sentencepiece
    with pytest.raises(ValueError, match=r"notokenizer' has no tokenizer files .*\(or pass a tokenizer: tokenizer="):
        RolloutEngine(str(dirs["notokenizer"]))
    assert load_config(str(dirs["noweights"])).model_type == "llama"  # the config alone reads without weights


def test_eval_fidelity_refuses_a_reference_past_the_positions_before_loading(tmp_path, capsys, no_engine):
    """The reference run is full's: --max-new-tokens 9000 on smollm2's 8,192 positions fails for any prompt."""
    argv = ["eval", "fidelity", "--policies", "rkv", "--budgets", "64", "--max-new-tokens", "9000",
            "--out", str(tmp_path / "fid")]
    assert main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "a one-token prompt + max_new_tokens=9000 = 9001 exceeds the model's " \
        "max_position_embeddings=8192; policy 'full'" in err[0]
    assert err[0].startswith("kvroll eval: error: --max-new-tokens=9000: ") and "lower --max-new-tokens" in err[0]
    assert not (tmp_path / "fid").exists()


def test_generate_refuses_full_past_the_positions_before_loading(capsys, no_engine):
    """smollm2 has 8,192 positions: max_new_tokens=9000 with 'full' fails for any prompt, so before the model
    loads (the engine then checks the real prompt's length); a compressing policy is only warned about, later."""
    assert main(["generate", "--prompt", "hi", "--policy", "full", "--max-new-tokens", "9000"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("kvroll generate: error: a one-token prompt + --max-new-tokens=9000 "
                                               "= 9001 exceeds the model's max_position_embeddings=8192; policy "
                                               "'full'") and "lower --max-new-tokens to <= 8191" in err[0]


def test_generate_writes_nothing_when_interrupted(tmp_path, capsys, monkeypatch):
    import kvroll.rollout.engine

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(kvroll.rollout.engine, "RolloutEngine", interrupted)
    assert main(["generate", "--prompt", "hi", "--out", str(tmp_path / "out.jsonl")]) == 130
    assert capsys.readouterr().err == "kvroll generate: interrupted before it finished\n"
    assert not (tmp_path / "out.jsonl").exists()


def test_generate_refuses_an_out_path_only_a_write_would_reject(capsys, no_engine):
    """root passes os.access everywhere; /proc accepts no new file, found before any model loads."""
    assert main(["generate", "--prompt", "hi", "--out", "/proc/kvroll-out.jsonl"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "/proc/kvroll-out.jsonl cannot be written: cannot create a file in /proc" in err[0]


def test_generate_keeps_its_rows_when_the_out_write_fails_late(tmp_path, capsys, monkeypatch):
    """The folder was writable at the check and is not at the end: the rows go to a file in the temp folder."""
    import kvroll.cli

    monkeypatch.setattr(kvroll.cli, "check_writable_file", lambda flag, path: None)
    monkeypatch.setattr(kvroll.cli, "tempfile_dir", lambda: str(tmp_path))
    argv = ["generate", "--prompt", "2+2=", "--n", "3", "--max-new-tokens", "3", "--policy",
            "full", "--out", "/proc/kvroll/out.jsonl"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    kept = sorted(tmp_path.glob("kvroll-generate-*.jsonl"))
    assert len(kept) == 1 and err == (f"kvroll generate: error: --out /proc/kvroll/out.jsonl could not be written "
                                      f"(No such file or directory); the 3 rows are in {kept[0]}.")
    rows = [json.loads(line) for line in kept[0].read_text().splitlines()]
    assert [(r["prompt_index"], r["sample_index"]) for r in rows] == [(0, 0), (0, 1), (0, 2)]
    assert all(1 <= len(r["token_ids"]) <= 3 for r in rows)


@pytest.mark.parametrize("argv, message", [
    (["--num-prompts", "0"], "argument --num-prompts: 0 is invalid: must be an integer >= 1"),
    (["--num-prompts", "-1"], "argument --num-prompts: -1 is invalid"),  # was: the last prompt silently dropped
    (["--budgets", ""], "argument --budgets: '' is invalid: give comma-separated integers >= 1, each once"),
    (["--budgets", "64,x"], "argument --budgets: '64,x' is invalid"),
    (["--budgets", "64,64"], "argument --budgets: '64,64' is invalid"),
    (["--policies", ""], "argument --policies: '' is empty"),  # was: every policy
    (["--policies", "rkv,full,rkv"], "argument --policies: 'rkv,full,rkv' names 'rkv' twice"),
    (["--threads", "-1"], "argument --threads: -1 is invalid"),
    (["--max-new-tokens", "abc"], "argument --max-new-tokens: 'abc' is not an integer: give an integer >= 1"),
])
def test_eval_fidelity_rejects_bad_arguments_at_parsing(tmp_path, capsys, no_engine, argv, message):
    with pytest.raises(SystemExit) as stop:
        main(["eval", "fidelity", "--out", str(tmp_path / "fid"), *argv])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("kvroll eval fidelity: error: ") and message in err[-1]
    assert not (tmp_path / "fid").exists()


def test_eval_fidelity_threads_zero_is_torchs_choice():
    from kvroll.cli import build_parser

    parse = build_parser().parse_args
    assert parse(["eval", "fidelity", "--threads", "0"]).threads is None  # as before the checks: torch's default
    assert parse(["eval", "fidelity", "--threads", "3"]).threads == 3


def test_eval_fidelity_refuses_a_budget_past_the_positions_before_loading(tmp_path, capsys, no_engine):
    """smollm2 has 8,192 positions (its config.json, read without the weights)."""
    argv = ["eval", "fidelity", "--policies", "full,rkv", "--budgets", "64,9000", "--out", str(tmp_path / "fid")]
    assert main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "budget=9000 exceeds the model's max_position_embeddings=8192" in err[0]
    assert not (tmp_path / "fid").exists()


@pytest.mark.parametrize("rows, message", [
    (['{"messages": [{"role": "user"}]}'], 'line 1: message 0 is {"role": "user"}; each message needs a \'role\' '
                                           "string and a 'content' string"),
    (['{"prompt": "hi"}', '{"messages": [{"role": "user", "content": 5}]}'], "line 2: message 0 is "),
    (['{"messages": [{"role": "user", "content": "hi"}, "hello"]}'], 'line 1: message 1 is "hello"'),
    (['{"messages": []}'], "line 1: 'messages' must be a non-empty list of {'role': ..., 'content': ...} dicts"),
    (['{"messages": "hi"}'], "line 1: 'messages' must be a non-empty list"),
])
def test_generate_rejects_malformed_messages_at_read_time(tmp_path, capsys, no_engine, rows, message):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(rows) + "\n")
    assert main(["generate", "--prompts-file", str(path)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"kvroll generate: error: --prompts-file {path}: ") and message in err[0]


@pytest.mark.parametrize("argv, budget", [(["--policy", "full"], None), (["--policy", "longflow"], 256),
                                          (["--policy", "rkv", "--budget", "64"], 64)])
def test_generate_budget_defaults_to_none_for_full(monkeypatch, capsys, argv, budget):
    """--policy full without --budget: no 'budget=256 is ignored' warning; a compressing policy still gets 256."""
    import warnings

    import kvroll.rollout.engine

    seen = {}

    def engine(model, compression, **kwargs):
        seen["compression"] = compression
        raise KeyboardInterrupt  # stop before the model loads

    monkeypatch.setattr(kvroll.rollout.engine, "RolloutEngine", engine)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the warning would fail the run
        assert main(["generate", "--prompt", "hi", *argv]) == 130
    assert seen["compression"].policy == argv[1] and seen["compression"].budget == budget


class _FakeEngine:
    """Stands in for RolloutEngine: records what generate is given and answers one Completion per (prompt, sample),
    in input order, whose tokens are the prompt's own (so each row shows which prompt it belongs to)."""

    seen: dict = {}

    class tokenizer:  # noqa: N801 (an attribute, as engine.tokenizer)
        @staticmethod
        def apply_chat_template(chat, add_generation_prompt, return_dict):
            return [ord(c) for c in "|".join(f"{m['role']}:{m['content']}" for m in chat)]

        @staticmethod
        def decode(ids, skip_special_tokens):
            return "".join(chr(i) for i in ids)

    stats = {"prefill_tokens": 0}

    def __init__(self, model, compression, max_batch, device):
        _FakeEngine.seen.update(compression=compression, max_batch=max_batch)

    def generate(self, prompts, sampling, n, progress):
        from kvroll.rollout.engine import Completion

        _FakeEngine.seen.update(prompts=prompts, sampling=sampling, n=n)
        return [Completion(p, s, ids, token_ids=ids[-4:], logprobs=[-0.5] * 4, finish_reason="length")
                for p, ids in enumerate(prompts) for s in range(n)]

    def kv_cache_bytes(self):
        return 1024


def test_generate_writes_every_prompt_and_sample_in_order_with_the_flags_given(tmp_path, capsys, monkeypatch):
    """Three prompts (one a chat, a blank line between two) x --n 2: six rows in (prompt, sample) order, each with
    its own prompt's tokens; every sampling flag and --policy-arg (read as JSON) reaches the engine."""
    import kvroll.rollout.engine

    monkeypatch.setattr(kvroll.rollout.engine, "RolloutEngine", _FakeEngine)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "first"}\n\n{"messages": [{"role": "system", "content": "be brief"}, '
                       '{"role": "user", "content": "second"}]}\n{"prompt": "third"}\n')
    out = tmp_path / "rows.jsonl"
    argv = ["generate", "--prompts-file", str(prompts), "--n", "2", "--policy", "rkv", "--budget", "64",
            "--policy-arg", "buffer=8", "--max-new-tokens", "4", "--temperature", "0.5", "--top-p", "0.9",
            "--top-k", "5", "--min-p", "0.1", "--repetition-penalty", "1.2", "--seed", "7", "--max-batch", "3",
            "--out", str(out)]
    assert main(argv) == 0
    seen = _FakeEngine.seen
    assert seen["compression"].policy == "rkv" and seen["compression"].budget == 64
    assert seen["compression"].params.buffer == 8 and seen["max_batch"] == 3 and seen["n"] == 2
    s = seen["sampling"]
    assert (s.max_new_tokens, s.temperature, s.top_p, s.top_k, s.min_p, s.repetition_penalty, s.seed) == \
        (4, 0.5, 0.9, 5, 0.1, 1.2, 7)
    texts = ["".join(map(chr, ids)) for ids in seen["prompts"]]
    assert texts == ["user:first", "system:be brief|user:second", "user:third"]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["prompt_index"], r["sample_index"]) for r in rows] == [(p, s) for p in range(3) for s in range(2)]
    assert [r["completion"] for r in rows] == ["irst", "irst", "cond", "cond", "hird", "hird"]
    for r in rows:
        assert set(r) == {"prompt_index", "sample_index", "completion", "num_tokens", "finish_reason", "token_ids",
                          "logprobs"}
        assert r["num_tokens"] == len(r["token_ids"]) == len(r["logprobs"]) == 4 and r["finish_reason"] == "length"
    printed = re.findall(r"^--- prompt (\d) sample (\d) \(4 tokens, length\) ---$", capsys.readouterr().out, re.M)
    assert printed == [(str(p), str(s)) for p in range(3) for s in range(2)]
    assert main(["generate", "--prompt", " two words ", "--max-new-tokens", "4"]) == 0  # one user message, verbatim
    assert ["".join(map(chr, ids)) for ids in _FakeEngine.seen["prompts"]] == ["user: two words "]


def test_generate_refuses_a_blank_prompt_row_and_an_out_directory_before_loading(tmp_path, capsys, no_engine):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi"}\n{"prompt": "   "}\n')
    assert main(["generate", "--prompts-file", str(prompts)]) == 2
    assert main(["generate", "--prompt", "hi", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"kvroll generate: error: --prompts-file {prompts}: line 2 needs a non-empty 'prompt' string or a "
                   "'messages' list",
                   f"kvroll generate: error: --out {tmp_path} is a directory; give a file name."]


def test_a_bad_prompt_row_is_named_by_its_line_in_the_file(tmp_path, capsys, no_engine):
    """Blank lines are skipped, not renumbered: the bad row on line 3 (after a blank line 2) is called line 3."""
    prompts, fidelity = tmp_path / "prompts.jsonl", tmp_path / "fidelity.jsonl"
    prompts.write_text('{"prompt": "hi"}\n\n{"prompt": ""}\n')
    fidelity.write_text('{"content": "hi"}\n\n\n{"text": "hi"}\n')
    assert main(["generate", "--prompts-file", str(prompts)]) == 2
    assert main(["eval", "fidelity", "--prompts", str(fidelity), "--out", str(tmp_path / "fid")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"kvroll generate: error: --prompts-file {prompts}: line 3 needs a non-empty 'prompt'")
    assert err[1] == f"kvroll eval: error: --prompts {fidelity}: line 4 needs a 'content' string"


@pytest.mark.parametrize("argv, message", [
    (["--temperature", "-1"], "--temperature=-1.0 is invalid: temperature must be a finite number >= 0"),
    (["--top-p", "2"], "--top-p=2.0 is invalid: top_p must be in (0, 1]"),
    (["--repetition-penalty", "0"], "--repetition-penalty=0.0 is invalid: "),
    (["--budget", "1"], "--budget=1 is invalid for policy 'longflow': budget must be an integer >= 2"),
    (["--device", "tpu"], "--device='tpu' is not a device ("),
])
def test_generate_names_the_flag_of_a_bad_sampling_value_or_budget(capsys, no_engine, argv, message):
    """The API's checks (SamplingParams.top_p=, CompressionConfig.budget=, RolloutEngine.device=) are reported as
    the flags given, before the model loads."""
    assert main(["generate", "--prompt", "hi", *argv]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"kvroll generate: error: {message}")


def test_generate_says_nothing_was_written_when_interrupted_mid_generation(tmp_path, capsys, monkeypatch):
    """Ctrl-C during generate: exit 130, one line with the tokens done and that --out was not written."""
    import kvroll.rollout.engine

    class Interrupted(_FakeEngine):
        def generate(self, prompts, sampling, n, progress):
            progress.update(3)
            raise KeyboardInterrupt

    monkeypatch.setattr(kvroll.rollout.engine, "RolloutEngine", Interrupted)
    out = tmp_path / "out.jsonl"
    assert main(["generate", "--prompt", "hi", "--n", "2", "--max-new-tokens", "4", "--out", str(out)]) == 130
    assert capsys.readouterr().err.splitlines()[-1] == \
        f"kvroll generate: interrupted while generating (after 3 of at most 8 tokens); nothing written to {out}"
    assert not out.exists()


def test_generate_full_with_a_budget_is_one_note_line(monkeypatch, capsys):
    """--policy full --budget 64: the budget is dropped with one line, not the API's two-line UserWarning."""
    import warnings

    import kvroll.rollout.engine

    seen = {}

    def engine(model, compression, **kwargs):
        seen["compression"] = compression
        raise KeyboardInterrupt  # stop before the model loads

    monkeypatch.setattr(kvroll.rollout.engine, "RolloutEngine", engine)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert main(["generate", "--prompt", "hi", "--policy", "full", "--budget", "64"]) == 130
    assert seen["compression"].budget is None
    assert capsys.readouterr().err.splitlines()[0] == \
        "kvroll generate: note: --budget 64 is ignored: --policy full keeps every token"


def test_eval_fidelity_refuses_an_empty_prompts_file_before_torch(tmp_path, capsys, no_engine):
    """An empty --prompts file is one line before the model loads, and --out is not created."""
    prompts, out = tmp_path / "empty.jsonl", tmp_path / "fid"
    prompts.write_text("\n\n")
    assert main(["eval", "fidelity", "--prompts", str(prompts), "--policies", "full", "--out", str(out)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"kvroll eval: error: --prompts {prompts} holds no prompts; give one JSON line with a 'content' per prompt."]
    assert not out.exists()


def test_eval_fidelity_says_which_rows_it_kept_when_interrupted(tmp_path, capsys, monkeypatch):
    """Ctrl-C after two of five rows: exit 130, one line naming the count and the files that hold them."""
    import kvroll.bench.fidelity as fidelity

    def two_rows_then_ctrl_c(*args, on_row, **kwargs):
        report = {"results": []}
        for row in range(2):
            report["results"].append(row)
            on_row(report)
        raise KeyboardInterrupt

    monkeypatch.setattr(fidelity, "run_fidelity", two_rows_then_ctrl_c)
    monkeypatch.setattr(fidelity, "to_markdown", lambda report, command: "")
    out = tmp_path / "fid"
    argv = ["eval", "fidelity", "--policies", "full,random,h2o", "--budgets", "64,128", "--out", str(out)]
    assert main(argv) == 130
    assert capsys.readouterr().err.splitlines()[-1] == (f"kvroll eval: interrupted after 2 of 5 (policy, budget) "
                                                        f"rows; {out / 'fidelity.json'} and fidelity.md hold them")
    assert json.loads((out / "fidelity.json").read_text()) == {"results": [0, 1]}
