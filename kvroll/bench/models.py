"""The model a benchmark runs: the embedded model, a local HF directory, or an architecture with random weights.

    model = build_model(model=None, architecture="qwen3-1.7b", dtype=torch.bfloat16, device="cuda", seed=0)

Throughput does not depend on the weights when EOS is ignored, so an architecture's config is enough to measure a
model that is not on the machine. Importing this module loads no torch (the config checks read ``ARCHITECTURES``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the annotations only: the functions import torch when they run
    import torch

# config.json fields of the published checkpoints (what the random-weight model is built from)
ARCHITECTURES = {
    "qwen3-1.7b": dict(model_type="qwen3", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=True),
    # other sizes and a Llama, for the shapes the benchmark's default does not name (session 25)
    "qwen3-0.6b": dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=True),
    "qwen3-4b": dict(model_type="qwen3", vocab_size=151936, hidden_size=2560, intermediate_size=9728,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                     tie_word_embeddings=True),
    "qwen3-8b": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                     tie_word_embeddings=False),
    # Llama-3.2-1B's shapes (head_dim 64, 4 query heads per KV head); its llama3 RoPE scaling is left out, which
    # changes no shape and no cost
    "llama-3.2-1b": dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=True),
}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    import torch

    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def build_model(model: str | None, architecture: str | dict | None, dtype: torch.dtype, device: torch.device,
                seed: int):
    """An eval-mode HF causal LM on ``device`` with no EOS (the sweep's runs generate their full length).

    ``architecture``: a name of ``ARCHITECTURES``, or a spec of the same form (``model_type`` + config fields)."""
    if architecture is not None:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        spec = dict(ARCHITECTURES[architecture] if isinstance(architecture, str) else architecture)
        config = AutoConfig.for_model(spec.pop("model_type"), **spec, bos_token_id=None, eos_token_id=None)
        torch.manual_seed(seed)
        with torch.device(device):
            net = AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        from kvroll.rollout.model import load_model

        net, _ = load_model(model, dtype=dtype, device=device, tokenizer=False)
    net.generation_config.eos_token_id = None
    return net.eval()


def weight_bytes(model) -> int:
    """Bytes a decode step reads for the weights: every parameter once (tied embeddings counted once, as the output
    head reads them whole), but not an untied input embedding table, of which a step reads only its rows' entries
    (Qwen3-8B's is 1.24 GB of 16.4; it was counted until session 42, which put its floors ~7.6% high)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    weight = getattr(embed, "weight", None)
    if weight is not None and weight is not getattr(head, "weight", None):
        total -= weight.numel() * weight.element_size()
    return total


def kv_bytes_per_token(model) -> int:
    """K and V bytes of one token over every layer and KV head."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    element = next(model.parameters()).element_size()
    return cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * element
