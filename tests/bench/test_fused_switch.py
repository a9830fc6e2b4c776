"""``kvroll bench --fused_mlp true`` / ``--fused_qkv_rotary true`` / ``--fused_add_norm true``: each switch
reaches every engine of the sweep and the report says it is on; off by default; a non-boolean value is refused
before anything is measured."""
import json
from pathlib import Path

import pytest

from kvroll.bench import models
from kvroll.bench.config import BenchConfig, load_config
from kvroll.cli import main
from tests.conftest import tiny_model

CPU_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "bench" / "cpu_smollm2.yaml"


@pytest.mark.parametrize("name,bad", [("fused_mlp", "yes"), ("fused_qkv_rotary", 1), ("fused_add_norm", "no")])
def test_switch_is_off_by_default_and_validated(name, bad):
    assert getattr(load_config(CPU_CONFIG), name) is False
    with pytest.raises(ValueError, match=f"{name}={bad!r} is invalid: it must be true or false"):
        BenchConfig(model="smollm2", **{name: bad})


def test_sweep_engines_take_the_switch(tmp_path, monkeypatch):
    from kvroll.kernels import fused_mlp

    built = []
    monkeypatch.setattr(models, "build_model", lambda *args: built.append(tiny_model("llama")) or built[-1])
    rc = main(["bench", "--config", str(CPU_CONFIG), "--out", str(tmp_path), "--no-progress", "--policies",
               "full,longflow", "--hf_generate", "false", "--fused_mlp", "true"])
    report = json.loads((tmp_path / "report.json").read_text())
    assert rc == 0 and report["environment"]["fused_mlp"] is True
    assert [r["policy"] for r in report["measurements"]] == ["full", "longflow"]
    assert "fused MLP (gate+up matmul, SiLU*mul kernel) on" in (tmp_path / "report.md").read_text()
    if fused_mlp.triton is not None:
        assert all(type(layer.mlp).__name__ == "FusedLlamaMLP" for layer in built[0].model.layers)


def test_sweep_engines_take_the_qkv_rotary_switch(tmp_path, monkeypatch):
    """``--fused_qkv_rotary true`` reaches every engine and the report; off, the report says nothing of it."""
    from kvroll.kernels import rotary

    built = []
    monkeypatch.setattr(models, "build_model", lambda *args: built.append(tiny_model("qwen3")) or built[-1])
    args = ["bench", "--config", str(CPU_CONFIG), "--no-progress", "--policies", "full,longflow",
            "--hf_generate", "false"]
    rc = main([*args, "--out", str(tmp_path / "on"), "--fused_qkv_rotary", "true"])
    report = json.loads((tmp_path / "on" / "report.json").read_text())
    assert rc == 0 and report["environment"]["fused_qkv_rotary"] is True
    assert report["environment"]["fused_mlp"] is False
    assert [r["policy"] for r in report["measurements"]] == ["full", "longflow"]
    assert "fused QKV + rotary (one QKV matmul, rotary kernel) on" in (tmp_path / "on" / "report.md").read_text()
    if rotary.triton is not None:
        assert all(type(layer.self_attn).__name__ == "FusedQwen3Attention" for layer in built[0].model.layers)
    assert main([*args, "--out", str(tmp_path / "off")]) == 0
    assert json.loads((tmp_path / "off" / "report.json").read_text())["environment"]["fused_qkv_rotary"] is False
    assert "fused QKV" not in (tmp_path / "off" / "report.md").read_text()
    assert type(built[1].model.layers[0].self_attn).__name__ == "Qwen3Attention"


def test_sweep_engines_take_the_add_norm_switch(tmp_path, monkeypatch):
    """``--fused_add_norm true`` reaches every engine and the report; off, the report says nothing of it."""
    from kvroll.kernels import add_rms_norm

    built = []
    monkeypatch.setattr(models, "build_model", lambda *args: built.append(tiny_model("llama")) or built[-1])
    args = ["bench", "--config", str(CPU_CONFIG), "--no-progress", "--policies", "full,longflow",
            "--hf_generate", "false"]
    rc = main([*args, "--out", str(tmp_path / "on"), "--fused_add_norm", "true"])
    report = json.loads((tmp_path / "on" / "report.json").read_text())
    assert rc == 0 and report["environment"]["fused_add_norm"] is True
    assert report["environment"]["fused_mlp"] is False and report["environment"]["fused_qkv_rotary"] is False
    assert [r["policy"] for r in report["measurements"]] == ["full", "longflow"]
    assert "fused residual add + RMSNorm (one kernel) on" in (tmp_path / "on" / "report.md").read_text()
    if add_rms_norm.triton is not None:
        assert all(type(layer).__name__ == "FusedLlamaDecoderLayer" for layer in built[0].model.layers)
    assert main([*args, "--out", str(tmp_path / "off")]) == 0
    assert json.loads((tmp_path / "off" / "report.json").read_text())["environment"]["fused_add_norm"] is False
    assert "fused residual add" not in (tmp_path / "off" / "report.md").read_text()
    assert type(built[1].model.layers[0]).__name__ == "LlamaDecoderLayer"
