"""Shared fixtures. ``gpu`` tests are skipped without CUDA; the embedded model is loaded once per session."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct, fp32 on CPU, kvroll attention."""
    from kvroll.rollout.model import load_model

    return load_model("smollm2")


@pytest.fixture(scope="session")
def chat_prompts(smollm2):
    _, tok = smollm2
    texts = ["What is 2+3?", "Write a haiku about the sea.", "Name three colors.", "Explain gravity to a child."]
    return [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, return_dict=False)
            for t in texts]
