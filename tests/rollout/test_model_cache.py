"""The embedded model's one-time conversion into $KVROLL_CACHE_DIR, when processes convert at once.

Three `kvroll eval fidelity` processes started side by side on a fresh machine each converted the GGUF; they shared
one temporary folder, and the first to rename it into place pulled it from under the others ("No such file or
directory" while writing the weights). transformers is replaced by stand-ins that write the two files the cache
check reads, so the test takes milliseconds.
"""
import json
import os
import sys
from types import SimpleNamespace

import pytest

from kvroll.rollout import model as model_mod


class _Tokenizer:
    def save_pretrained(self, path):
        (path / "tokenizer.json").write_text("{}")


class _Model:
    def __init__(self, tag, during_save):
        self.config = SimpleNamespace(quantization_config="q4_1")
        self.tag, self.during_save = tag, during_save

    def save_pretrained(self, path):
        (path / "config.json").write_text(json.dumps({"quantization_config": "q4_1", "tag": self.tag}))
        self.during_save()  # another process may finish its conversion here
        (path / "model.safetensors").write_text(self.tag)


@pytest.fixture
def converter(tmp_path, monkeypatch):
    """Converts with stand-ins; ``hooks`` runs one callable per conversion, in the middle of its weights' save."""
    monkeypatch.setenv("KVROLL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(model_mod, "smollm2_gguf_path", lambda: tmp_path / "model.gguf")
    hooks, tags = [], iter(["first", "second", "third"])
    # the module smollm2_checkpoint's `from transformers import ...` reads now: importing transformers.processing_utils
    # (collecting tests/bench/test_bench.py does) puts a new transformers module in sys.modules, so a module object
    # imported at this file's collection may no longer be it
    transformers = sys.modules["transformers"]
    monkeypatch.setattr(transformers, "AutoTokenizer",
                        SimpleNamespace(from_pretrained=lambda *a, **k: _Tokenizer()))
    monkeypatch.setattr(transformers, "AutoModelForCausalLM", SimpleNamespace(
        from_pretrained=lambda *a, **k: _Model(next(tags), hooks.pop(0) if hooks else lambda: None)))
    return SimpleNamespace(cache=tmp_path / "cache", hooks=hooks)


def test_a_conversion_finished_by_another_process_meanwhile_is_taken(converter):
    inner = []
    converter.hooks.append(lambda: inner.append(model_mod.smollm2_checkpoint()))
    target = model_mod.smollm2_checkpoint()
    assert inner == [target]
    assert (target / "model.safetensors").read_text() == "second"  # the folder renamed first stays
    config = json.loads((target / "config.json").read_text())
    assert "quantization_config" not in config and config["tag"] == "second"
    assert sorted(p.name for p in converter.cache.iterdir()) == [target.name]  # no temporary folder left
    assert model_mod.smollm2_checkpoint() == target  # and the next call reads the cache


def test_an_incomplete_cached_conversion_is_named(converter):
    target = converter.cache / "smollm2-135m-instruct-v2"
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")  # weights missing
    with pytest.raises(RuntimeError, match=r"smollm2-135m-instruct-v2 holds an incomplete conversion.*delete"):
        model_mod.smollm2_checkpoint()
    assert sorted(p.name for p in converter.cache.iterdir()) == [target.name]


def test_the_cached_folder_has_the_umask_s_permissions(converter):
    umask = os.umask(0o022)
    try:
        target = model_mod.smollm2_checkpoint()
    finally:
        os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o755


def test_a_killed_conversions_folder_goes_and_a_running_ones_stays(converter):
    """A conversion SIGKILLed midway leaves its temporary folder (~540 MB); the next use removes it once it is an hour
    old, and leaves a recent one (another process may be converting into it)."""
    converter.cache.mkdir(parents=True)
    killed = converter.cache / "smollm2-135m-instruct-v2.tmp-killed"
    running = converter.cache / "smollm2-135m-instruct-v2.tmp-running"
    for folder in (killed, running):
        folder.mkdir()
        (folder / "model.safetensors").write_text("half")
    os.utime(killed, (0, 0))
    target = model_mod.smollm2_checkpoint()
    assert sorted(p.name for p in converter.cache.iterdir()) == sorted([target.name, running.name])
