"""Shared fixtures. ``gpu`` tests are skipped without CUDA; the embedded model is loaded once per session."""
import gc
import importlib.util
import os
import weakref

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

# Oversubscribed threads make small decode steps ~10x slower on a busy 2-core box; CI leaves the default.
if os.environ.get("KVROLL_TEST_THREADS"):
    torch.set_num_threads(int(os.environ["KVROLL_TEST_THREADS"]))


# A test that hands CPU tensors to a Triton kernel runs under the interpreter only: on a GPU machine without it the
# compiled kernel would get CPU pointers (session 28 ran the suite plainly on an H100). Its ``gpu`` twin runs the
# kernel on CUDA.
needs_interpreter = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") != "1",
    reason="the kernel on CPU tensors needs Triton's interpreter (TRITON_INTERPRET=1)")


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


def tiny_model(family: str = "llama", seed: int = 0, vocab_size: int = 256, layers: int = 2):
    """A small random-weight causal LM of a supported family (fp32, eval mode)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=8192,
                  eos_token_id=None, bos_token_id=None, pad_token_id=0)
    if family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    model.generation_config.eos_token_id = None
    return model.eval()


@pytest.fixture
def tiny_llama():
    return tiny_model("llama")


def lora_model(config, family: str = "llama", seed: int = 0):
    """``tiny_model`` wrapped by peft with ``config`` (a peft ``LoraConfig``), every LoRA B drawn non-zero."""
    from peft import get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(tiny_model(family, seed=seed), config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name or "lora_embedding_B" in name:  # peft starts B at zero: the merge would be a no-op
                param.normal_(0.0, 0.5)
    return model


def merged_reference(model) -> dict:
    """peft's merge_and_unload of a copy: the base model's names and merged weights, independently of kvroll."""
    import copy

    return dict(copy.deepcopy(model).merge_and_unload().named_parameters())


def freed_without_gc(build) -> bool:
    """``build()`` -> (owner, [objects]): True if dropping ``owner`` (its last reference) frees every object at once
    with the garbage collector off, i.e. no reference cycle keeps them (and their device memory) alive."""
    owner, objects = build()
    refs = [weakref.ref(o) for o in objects]
    del objects
    gc.collect()
    gc.disable()
    try:
        del owner
        return all(r() is None for r in refs)
    finally:
        gc.enable()
