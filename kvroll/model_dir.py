"""What makes a local directory a model kvroll can load, checked without torch (the CLI's checks run before it).

A Hugging Face model directory holds a ``config.json`` (a JSON object) and its weights: ``model.safetensors`` or
``pytorch_model.bin``, the ``.index.json`` of their shards, a variant of them (``model.fp16.safetensors``), a GGUF
file, or the file the config's ``transformers_weights`` names. A folder without any (a tokenizer-only download, the
folder above a snapshot) or with a damaged ``config.json`` fails inside transformers with a traceback; this names it.
The weights are recognised by their file names only, generously: which of them loads is transformers' business.
Where a tokenizer is read from the folder too, it needs a tokenizer's vocabulary file (``tokenizer.json``,
``tokenizer.model``, ``vocab.json``, ...): without one transformers fails after the weights load, with an error
about sentencepiece.
"""
from __future__ import annotations

import json
from pathlib import Path

WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "*.bin.index.json", "*.gguf")
# a tokenizer's vocabulary, in any of the forms transformers reads (tokenizer_config.json alone holds none)
# (sentencepiece's *.model: tokenizer.model, spiece.model, sentencepiece.bpe.model; Mistral's tekken.json)
TOKENIZER_PATTERNS = ("tokenizer.json", "*.model", "*.tiktoken", "vocab.json", "vocab.txt", "tekken.json")


def _has_weights(path: Path, config: dict) -> bool:
    named = config.get("transformers_weights")
    if isinstance(named, str) and (path / named).is_file():
        return True
    return _has_any(path, WEIGHT_PATTERNS)


def _has_any(path: Path, patterns) -> bool:
    return any(next(path.glob(pattern), None) is not None for pattern in patterns)


def model_dir_problem(path: str | Path, weights: bool = True, tokenizer: bool = False) -> str | None:
    """Why ``path`` is not a loadable HF model directory, as the end of a sentence ("... {problem}"), or None.

    ``weights=False`` checks the config alone (enough for reading it, as ``load_config`` does); ``tokenizer=True``
    checks for a tokenizer's vocabulary file too (for a caller that reads the tokenizer from the folder)."""
    path = Path(path)
    if not path.exists():
        return "does not exist"
    config = path / "config.json"
    if not config.is_file():
        return "is not a Hugging Face model directory (it has no config.json)"
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        return f"has a config.json that cannot be read as JSON ({err})"
    if not isinstance(data, dict):
        return f"has a config.json that is not a JSON object (it holds a {type(data).__name__})"
    if weights and not _has_weights(path, data):
        return ("has a config.json but no weights (no *.safetensors, pytorch_model*.bin or *.gguf file, nor their "
                "shards' index); pass the folder that holds them")
    if not tokenizer or _has_any(path, ["*.gguf"]):  # a GGUF file carries its tokenizer
        return None
    if not _has_any(path, TOKENIZER_PATTERNS):
        return ("has no tokenizer files (no tokenizer.json, tokenizer.model or vocab.json); copy them from the "
                "model's source folder")
    return None
