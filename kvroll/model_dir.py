"""What makes a local directory a model kvroll can load, checked without torch (the CLI's checks run before it).

A Hugging Face model directory holds a ``config.json`` (a JSON object) and its weights: ``model.safetensors`` or
``pytorch_model.bin``, their shards (with a shard that their ``.index.json`` names), a variant of them
(``model.fp16.safetensors``), a GGUF file (for a caller that passes ``gguf_file=``, as a trainer's
``model_init_kwargs`` may; ``kvroll.rollout.model.load_model`` does not), or the file the config's
``transformers_weights`` names. A folder without any (a tokenizer-only or ``*.json``-only download, the folder above a
snapshot, a snapshot copied without its blobs: links to nothing) or with a damaged ``config.json`` fails inside
transformers with a traceback; this names it. The weights are recognised by their file names only, generously: which
of them loads is transformers' business.
Where a tokenizer is read from the folder too, it needs a tokenizer's vocabulary file (``tokenizer.json``,
``tokenizer.model``, ``vocab.json``, ...): without one transformers fails after the weights load, with an error
about sentencepiece.
"""
from __future__ import annotations

import json
from pathlib import Path

WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "*.gguf")
INDEX_PATTERNS = ("*.safetensors.index.json", "*.bin.index.json")  # weights only with a shard they name beside them
# a tokenizer's vocabulary, in any of the forms transformers reads (tokenizer_config.json alone holds none)
# (sentencepiece's *.model: tokenizer.model, spiece.model, sentencepiece.bpe.model; Mistral's tekken.json)
TOKENIZER_PATTERNS = ("tokenizer.json", "*.model", "*.tiktoken", "vocab.json", "vocab.txt", "tekken.json")


def _has_weights(path: Path, config: dict, gguf: bool = True) -> bool:
    named = config.get("transformers_weights")
    if isinstance(named, str) and (path / named).is_file():
        return True
    return _has_any(path, [p for p in WEIGHT_PATTERNS if gguf or p != "*.gguf"]) or _has_indexed_shard(path)


def _has_any(path: Path, patterns) -> bool:
    # is_file: a link to nothing (an HF-cache snapshot copied without its blobs) or a folder is not a file
    return any(match.is_file() for pattern in patterns for match in path.glob(pattern))


def _has_indexed_shard(path: Path) -> bool:
    """Some shard that a shards' index (``*.index.json``) names is there (a name no pattern above matches)."""
    for index in (match for pattern in INDEX_PATTERNS for match in path.glob(pattern)):
        try:
            names = json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
            continue
        if any(isinstance(name, str) and (path / name).is_file() for name in names):
            return True
    return False


def model_dir_problem(path: str | Path, weights: bool = True, tokenizer: bool = False,
                      gguf: bool = True) -> str | None:
    """Why ``path`` is not a loadable HF model directory, as the end of a sentence ("... {problem}"), or None.

    ``weights=False`` checks the config alone (enough for reading it, as ``load_config`` does); ``tokenizer=True``
    checks for a tokenizer's vocabulary file too (for a caller that reads the tokenizer from the folder);
    ``gguf=False`` counts a GGUF file neither as weights nor as a tokenizer (for a caller that loads the folder
    without ``gguf_file=``, as ``load_model`` does)."""
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
    if weights and not _has_weights(path, data, gguf):
        if _has_any(path, ["*.gguf"]):  # only where gguf=False
            return ("has its weights only as a GGUF file, which kvroll's engine does not read; convert it once with "
                    "AutoModelForCausalLM.from_pretrained(folder, gguf_file=...).save_pretrained(folder) (and the "
                    "tokenizer likewise)")
        return ("has a config.json but no weights (no *.safetensors, pytorch_model*.bin or *.gguf file, nor a shard "
                "that an *.index.json names; a link to a missing file does not count); pass the folder that holds "
                "them")
    if not tokenizer or (gguf and _has_any(path, ["*.gguf"])):  # a GGUF file carries its tokenizer
        return None
    if not _has_any(path, TOKENIZER_PATTERNS):
        return ("has no tokenizer files (no tokenizer.json, tokenizer.model or vocab.json); copy them from the "
                "model's source folder")
    return None
