"""What PPO does with a batch of prompts before any loss: tokenize, generate, pad, score with the reward functions.

    prompt_ids = tokenize_prompts(tokenizer, prompts)
    batch = pad_rollout(prompt_ids, completion_ids, rollout_logps, pad_token_id, device)
    per_func = reward_scores(reward_funcs, tokenizers, inputs, prompts, completions, completion_ids, device)

Reward functions are TRL GRPO's: callables ``f(prompts, completions, completion_ids, **columns) -> list[float|None]``
or sequence-classification models (the logit of the last token of prompt + completion).
"""
from __future__ import annotations

import torch
from torch import nn
from trl.data_utils import apply_chat_template, is_conversational


def tokenize_prompts(tokenizer, prompts: list, chat_template_kwargs: dict | None = None) -> list[list[int]]:
    """Token ids of each prompt: chat prompts through the chat template (with the generation prompt), as GRPO."""
    if is_conversational({"prompt": prompts[0]}):
        out = tokenizer.apply_chat_template(conversation=prompts, add_generation_prompt=True, tokenize=True,
                                            return_dict=True, **(chat_template_kwargs or {}))
        return [list(ids) for ids in out["input_ids"]]
    return [list(ids) for ids in tokenizer(text=prompts)["input_ids"]]


def cut_at_eos(ids: list[int], eos_ids: set[int]) -> list[int]:
    """``ids`` up to and including the first EOS (generate pads finished rows with more tokens)."""
    for i, token in enumerate(ids):
        if token in eos_ids:
            return ids[: i + 1]
    return ids


def left_pad(rows: list[list[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [B, L], mask [B, L]) with each row right-aligned."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            ids[i, width - len(row):] = torch.tensor(row)
            mask[i, width - len(row):] = 1
    return ids.to(device), mask.to(device)


def pad_rollout(prompt_ids, completion_ids, rollout_logps, pad: int, device) -> dict:
    """The rollout as tensors: prompts left-padded to P, completions right-padded to T.

    Keys: input_ids / attention_mask [B, P+T], completion_mask [B, T] (float), prompt_length (P), and
    rollout_logps [B, T] when the backend returned them.
    """
    prompts, prompt_mask = left_pad(prompt_ids, pad, device)
    width = max(len(c) for c in completion_ids)
    completions = torch.full((len(completion_ids), width), pad, dtype=torch.long)
    completion_mask = torch.zeros((len(completion_ids), width))
    logps = torch.zeros((len(completion_ids), width)) if rollout_logps is not None else None
    for i, row in enumerate(completion_ids):
        completions[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        completion_mask[i, : len(row)] = 1.0
        if logps is not None:
            logps[i, : len(row)] = torch.tensor(rollout_logps[i], dtype=torch.float32)
    completions, completion_mask = completions.to(device), completion_mask.to(device)
    batch = {"input_ids": torch.cat([prompts, completions], dim=1),
             "attention_mask": torch.cat([prompt_mask, completion_mask.long()], dim=1),
             "completion_mask": completion_mask, "prompt_length": prompts.shape[1]}
    if logps is not None:
        batch["rollout_logps"] = logps.to(device)
    return batch


def completion_texts(tokenizer, prompts: list, completion_ids: list[list[int]]) -> list:
    """Decoded completions, as assistant messages when the prompts are chats (what GRPO's reward functions get)."""
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    if is_conversational({"prompt": prompts[0]}):
        return [[{"role": "assistant", "content": text}] for text in texts]
    return texts


def reward_scores(reward_funcs, tokenizers, inputs: list[dict], prompts: list, completions: list,
                  completion_ids: list[list[int]], device, **extra) -> torch.Tensor:
    """Rewards [B, num_funcs] (NaN where a function returned None), as TRL GRPO computes them."""
    columns = {key: [row[key] for row in inputs] for key in inputs[0] if key not in ("prompt", "completion")}
    out = torch.zeros(len(prompts), len(reward_funcs), device=device)
    for i, (func, tokenizer) in enumerate(zip(reward_funcs, tokenizers)):
        if isinstance(func, nn.Module):
            out[:, i] = _model_scores(func, tokenizer, prompts, completions, device)
            continue
        values = func(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns, **extra)
        if len(values) != len(prompts):
            raise ValueError(f"reward function {reward_name(func)!r} returned {len(values)} rewards for "
                             f"{len(prompts)} completions; return exactly one per completion.")
        out[:, i] = torch.tensor([torch.nan if v is None else float(v) for v in values], device=device)
    return out


@torch.no_grad()
def _model_scores(model, tokenizer, prompts, completions, device) -> torch.Tensor:
    if is_conversational({"prompt": prompts[0]}):
        texts = [apply_chat_template({"messages": p + c}, tokenizer)["text"] for p, c in zip(prompts, completions)]
    else:
        texts = [p + c for p, c in zip(prompts, completions)]
    batch = tokenizer(text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
    return model(**batch.to(device)).logits[:, 0].float()


def reward_name(func) -> str:
    """The name GRPO logs a reward function under (``rewards/<name>/mean``)."""
    if isinstance(func, nn.Module):
        path = str(getattr(func.config, "_name_or_path", "") or "").rstrip("/")
        return path.split("/")[-1] or type(func).__name__
    return getattr(func, "__name__", type(func).__name__)
