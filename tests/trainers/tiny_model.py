"""A tiny random-weight Llama with the embedded model's tokenizer, and a small chat dataset, for CPU tests."""
from __future__ import annotations

import torch


def tokenizer():
    from transformers import AutoTokenizer

    from kvroll.rollout.model import smollm2_checkpoint

    return AutoTokenizer.from_pretrained(smollm2_checkpoint())


def tiny_llama(tok, seed: int = 0, layers: int = 2, eos_logit: float = 9.0):
    """A 2-layer GQA Llama (hidden 32, 4 query / 2 KV heads) over the SmolLM2 vocabulary, tied embeddings.

    A random model over a 49k vocabulary would almost never sample EOS, leaving the "ends with EOS when finished"
    contract untested; ``eos_logit`` raises EOS's logit to about that value (about 0.14 per step at 9) through a
    constant residual offset (the last o_proj bias) that the EOS embedding row reads.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    hidden = 32
    config = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                         pad_token_id=tok.pad_token_id, tie_word_embeddings=True, attention_bias=True)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.layers[-1].self_attn.o_proj.bias[0] = 100.0  # residual dim 0 dominates the final RMSNorm
        model.model.embed_tokens.weight[:, 0].normal_(0.0, 0.02)
        model.model.embed_tokens.weight[tok.eos_token_id, 0] = eos_logit / hidden ** 0.5
    return model


def chat_dataset(size: int = 8):
    from datasets import Dataset

    return Dataset.from_list([{"prompt": [{"role": "user", "content": f"What is {i} + {2 * i + 1}?"}]}
                              for i in range(size)])


def length_reward(completions, **kwargs):
    """A reward with spread inside each group, so advantages (and gradients) are non-zero."""
    return [float(len(c[0]["content"]) % 5) for c in completions]
