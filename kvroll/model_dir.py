"""What makes a local directory a model kvroll can load, checked without torch (the CLI's checks run before it).

A Hugging Face model directory holds a ``config.json`` (a JSON object) and its weights: ``model.safetensors`` or
``pytorch_model.bin``, or the ``.index.json`` of their shards. A folder without them (a tokenizer-only download, the
folder above a snapshot) or with a damaged ``config.json`` fails inside transformers with a traceback; this names it.
"""
from __future__ import annotations

import json
from pathlib import Path

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def model_dir_problem(path: str | Path, weights: bool = True) -> str | None:
    """Why ``path`` is not a loadable HF model directory, as the end of a sentence ("... {problem}"), or None.

    ``weights=False`` checks the config alone (enough for reading it, as ``load_config`` does)."""
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
    if weights and not any((path / name).is_file() for name in WEIGHT_FILES):
        return (f"has a config.json but no weights (none of {', '.join(WEIGHT_FILES)}); pass the folder that holds "
                "them")
    return None
