"""The embedded model's one-time conversion into $KVROLL_CACHE_DIR, when processes convert at once.

Three `kvroll eval fidelity` processes started side by side on a fresh machine each converted the GGUF; they shared
one temporary folder, and the first to rename it into place pulled it from under the others ("No such file or
directory" while writing the weights). transformers is replaced by stand-ins that write the two files the cache
check reads, so the test takes milliseconds.
"""
import json
import os
from types import SimpleNamespace

import pytest
import transformers

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
