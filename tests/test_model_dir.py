"""Odd model folders that passed ``model_dir_problem`` and then failed inside transformers with a traceback: a link
to a missing weights file, a shards' index without a shard, a GGUF file where the engine loads without gguf_file=."""
import json
import os
from pathlib import Path

import pytest

from kvroll.cli import main
from kvroll.model_dir import model_dir_problem


def _folder(tmp_path: Path, name: str, files: dict) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (folder / "tokenizer.json").write_text("{}")
    for file, text in files.items():
        (folder / file).write_text(text)
    return folder


def test_a_link_to_a_missing_weights_file_is_no_weights(tmp_path):
    """An HF-cache snapshot copied without its blobs: model.safetensors -> ../../blobs/<hash>, which is not there."""
    folder = _folder(tmp_path, "snapshot", {})
    os.symlink("../../blobs/0123abcd", folder / "model.safetensors")
    assert model_dir_problem(folder).startswith("has a config.json but no weights")
    os.symlink("model.safetensors", folder / "pytorch_model.bin")  # a link to a link to nothing
    assert model_dir_problem(folder).startswith("has a config.json but no weights")
    blob = tmp_path / "blob"
    blob.write_text("")
    (folder / "model.safetensors").unlink()
    os.symlink(blob, folder / "model.safetensors")  # a link to a file: weights
    assert model_dir_problem(folder, tokenizer=True) is None


def test_a_folder_named_like_weights_is_no_weights(tmp_path):
    folder = _folder(tmp_path, "dir", {})
    (folder / "model.safetensors").mkdir()
    assert model_dir_problem(folder).startswith("has a config.json but no weights")


@pytest.mark.parametrize("shards, loadable", [
    ([], False),  # a '*.json'-only download: the index and no shard
    (["model-00001-of-00002.safetensors"], True),  # one of two: transformers' to say which is missing
    (["weights-a.bin"], True),  # a shard name no pattern matches, named by the index
])
def test_a_shards_index_counts_with_a_shard_it_names(tmp_path, shards, loadable):
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    if shards == ["weights-a.bin"]:
        index = {"weight_map": {"a": "weights-a.bin"}}
        name = "pytorch_model.bin.index.json"
    else:
        name = "model.safetensors.index.json"
    folder = _folder(tmp_path, "sharded", {name: json.dumps(index), **{s: "" for s in shards}})
    problem = model_dir_problem(folder)
    assert problem is None if loadable else problem.startswith("has a config.json but no weights"), problem


def test_a_gguf_folder_is_refused_where_the_engine_loads_it(tmp_path):
    """load_model reads the folder without gguf_file=: a config.json + a GGUF file is no model for it (transformers:
    'no file named model.safetensors'); a trainer, which may pass gguf_file in model_init_kwargs, still takes it."""
    folder = _folder(tmp_path, "gguf", {"model-q4.gguf": ""})
    (folder / "tokenizer.json").unlink()
    assert model_dir_problem(folder, tokenizer=True) is None  # the trainers' check
    problem = model_dir_problem(folder, tokenizer=True, gguf=False)
    assert problem.startswith("has its weights only as a GGUF file, which kvroll's engine does not read; convert "
                              "it once with AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)"), problem


@pytest.mark.parametrize("command", ["generate", "eval"])
def test_the_engine_commands_refuse_a_gguf_folder_in_one_line(tmp_path, capsys, command):
    folder = _folder(tmp_path, "gguf", {"model-q4.gguf": ""})
    argv = {"generate": ["generate", "--prompt", "hi", "--model", str(folder)],
            "eval": ["eval", "fidelity", "--policies", "full", "--budgets", "64", "--model", str(folder),
                     "--out", str(tmp_path / "fid")]}[command]
    assert main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and f"--model {folder} has its weights only as a GGUF file" in err[0], err


def test_the_engine_api_refuses_a_gguf_folder(tmp_path):
    from kvroll import RolloutEngine

    folder = _folder(tmp_path, "gguf", {"model-q4.gguf": ""})
    with pytest.raises(ValueError, match=r"has its weights only as a GGUF file"):
        RolloutEngine(str(folder))
