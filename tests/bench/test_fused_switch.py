"""``kvroll bench --fused_mlp true`` / ``--fused_qkv_rotary true`` / ``--fused_add_norm true``: each switch
reaches every engine of the sweep and the report says it is on; off by default; a non-boolean value is refused
before anything is measured."""
import importlib
import json
from pathlib import Path

import pytest

from kvroll.bench import models
from kvroll.bench.config import BenchConfig, load_config
from kvroll.cli import main
from kvroll.kernels.fusions import FUSIONS
from tests.conftest import tiny_model

CPU_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "bench" / "cpu_smollm2.yaml"


@pytest.mark.parametrize("name,bad", [("fused_mlp", "yes"), ("fused_qkv_rotary", 1), ("fused_add_norm", "no")])
def test_switch_is_auto_by_default_and_validated(name, bad):
    assert getattr(load_config(CPU_CONFIG), name) is None  # on for CUDA, off on CPU (the engine's resolve_fusions)
    with pytest.raises(ValueError, match=f"{name}={bad!r} is invalid: it must be true, false or null"):
        BenchConfig(model="smollm2", **{name: bad})


# switch -> (the sweep's model, the module of a decoder layer it swaps, its fused class, what report.md says of it on,
#            what report.md must not say with every switch off)
SWITCHES = {
    "fused_mlp": ("llama", lambda layer: layer.mlp, "FusedLlamaMLP", "fused MLP (gate+up matmul, SiLU*mul kernel) on",
                  "fused MLP"),
    "fused_qkv_rotary": ("qwen3", lambda layer: layer.self_attn, "FusedQwen3Attention",
                         "fused QKV + rotary (one QKV matmul, rotary kernel) on", "fused QKV"),
    "fused_add_norm": ("llama", lambda layer: layer, "FusedLlamaDecoderLayer",
                       "fused residual add + RMSNorm (one kernel) on", "fused residual add"),
}


def sweep(out, monkeypatch, family, *flags):
    """``kvroll bench`` of full and longflow on ``tiny_model(family)``: (its exit code, report.json, report.md, the
    model it built)."""
    built = []
    monkeypatch.setattr(models, "build_model", lambda *args: built.append(tiny_model(family)) or built[-1])
    rc = main(["bench", "--config", str(CPU_CONFIG), "--out", str(out), "--no-progress", "--policies",
               "full,longflow", "--hf_generate", "false", *flags])
    return rc, json.loads((out / "report.json").read_text()), (out / "report.md").read_text(), built[0]


@pytest.mark.parametrize("name", FUSIONS)
def test_sweep_engines_take_the_switch(name, tmp_path, monkeypatch):
    """``--<switch> true`` reaches every engine and the report; the other switches stay off."""
    family, swap, fused_class, said, _ = SWITCHES[name]
    rc, report, md, model = sweep(tmp_path, monkeypatch, family, f"--{name}", "true")
    assert rc == 0 and report["environment"][name] is True
    assert all(report["environment"][other] is False for other in FUSIONS if other != name)
    assert [r["policy"] for r in report["measurements"]] == ["full", "longflow"]
    assert said in md
    if importlib.import_module(f"kvroll.kernels.{name}").triton is not None:
        assert all(type(swap(layer)).__name__ == fused_class for layer in model.model.layers)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_sweep_without_the_switches_says_nothing_of_them(family, tmp_path, monkeypatch):
    """Off (the default), every switch is false in report.json, absent from report.md, and HF's modules stay."""
    rc, report, md, model = sweep(tmp_path, monkeypatch, family)
    hf_layer = tiny_model(family).model.layers[0]
    assert rc == 0
    for name, (_, swap, _, _, unsaid) in SWITCHES.items():
        assert report["environment"][name] is False and unsaid not in md
        assert type(swap(model.model.layers[0])) is type(swap(hf_layer))
