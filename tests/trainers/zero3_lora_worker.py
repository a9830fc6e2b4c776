"""A 2-step GRPO run with ``use_kvroll=True``, a LoRA ``peft_config`` and DeepSpeed ZeRO-3 (one process).

    python tests/trainers/zero3_lora_worker.py OUT_DIR [--device cuda|cpu]    # run by test_zero3.py

Every parameter, LoRA A and B included, is partitioned, so the engine's merge must gather them. Before each
generation and after a last sync, the engine's weights are compared with TRL's own way of reading merged weights
(gather everything, ``merge_adapter()``, strip ``base_model.model.`` / ``.base_layer``, ``unmerge_adapter()``):
equal on CPU (fp32). On a GPU (bf16) peft merges in bf16, rounding the delta B@A·scale and then the sum, so its
read-out can sit two roundings from the exact merge; there the engine is held to an fp32 merge computed here from
the gathered weights (W + scale·B@A, rounded once: within one bf16 rounding) and TRL's read-out to a looser bound.
Prints ``ZERO3 LORA OK`` when every check passed.
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zero3_common import build_trainer, grpo_config, run_worker  # noqa: E402  (sets the environment)


def trl_merged(model) -> dict:
    """The merged weights as TRL 1.16 sends vLLM under ZeRO-3 (vllm_generation.py, _iter_named_params)."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        model.merge_adapter()
        merged = {name.removeprefix("base_model.model.").replace(".base_layer", ""): param.detach().clone()
                  for name, param in model.named_parameters() if "lora_" not in name}
        model.unmerge_adapter()
    return merged


def fp32_merged(model) -> dict:
    """name -> (W + delta, delta) in fp32, delta the sum of scale·B@A over the LoRA layer's active adapters (the
    reference on a GPU; written from peft's layer attributes, not kvroll's sources.py)."""
    import deepspeed

    merged = {}
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        for name, module in model.named_modules():
            if not hasattr(module, "lora_A") or not hasattr(module, "base_layer"):
                continue
            delta = sum(module.scaling[adapter] * (module.lora_B[adapter].weight.float()
                                                   @ module.lora_A[adapter].weight.float())
                        for adapter in module.active_adapters)
            merged[name.removeprefix("base_model.model.") + ".weight"] = \
                (module.base_layer.weight.detach().float() + delta, delta)
    return merged


def main(out_dir: str, device: str) -> dict:
    import torch
    from peft import LoraConfig

    from kvroll.trainers import GRPOTrainer

    on_gpu = device == "cuda"
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False)
    trainer = build_trainer(GRPOTrainer, grpo_config(out_dir, device), peft_config=lora)
    generation, seen = trainer.kvroll_generation, []
    model = trainer.accelerator.unwrap_model(trainer.model)
    real_generate = generation.generate

    def check():
        engine = {n: p.detach() for n, p in generation.weights.engine_model.named_parameters()}
        reference = trl_merged(model)
        assert sorted(engine) == sorted(reference), (sorted(engine), sorted(reference))
        exact = fp32_merged(model)
        assert exact, "no LoRA layer found"
        for name, tensor in reference.items():
            if not on_gpu:
                assert torch.equal(engine[name], tensor), f"engine weight {name} is not the merged weight"
                if name in exact:  # fp32 throughout: this file's merge equals both up to the sum's order
                    torch.testing.assert_close(engine[name], exact[name][0], rtol=1e-6, atol=1e-7)
            elif name in exact:
                merged, delta = exact[name]
                got = engine[name].float()
                # kvroll's fp32 merge vs this one: the fp32 sum's order only, then one bf16 rounding (<= 1 ulp)
                torch.testing.assert_close(got, merged.to(engine[name].dtype).float(), rtol=2 ** -7, atol=1e-6)
                # peft's bf16 merge rounds scale·B@A (twice: product, scale) and the sum; with the engine's own
                # rounding that is within 2^-7 of |delta| + 2^-7 of the value
                limit = 2 ** -7 * (delta.abs() + merged.abs()) + 1e-6
                diff = (got - tensor.float()).abs()
                assert bool((diff <= limit).all()), \
                    f"{name}: {float(diff.max())} from peft's bf16 merge, over the rounding bound"
            else:  # not adapted: the same bf16 tensor
                assert torch.equal(engine[name], tensor), f"engine weight {name} is not the trainer's"
        seen.append({n: t.float().cpu() for n, t in reference.items()})

    def checked_generate(prompts, images=None, num_generations=1, profiler=None):
        check()
        return real_generate(prompts=prompts, images=images, num_generations=num_generations, profiler=profiler)

    generation.generate = checked_generate
    trainer.train()
    generation.sync_weights()  # what TRL runs before a third generation
    check()

    params = dict(model.named_parameters())
    assert generation.weights.zero3 and all(hasattr(p, "ds_id") for p in params.values()), "not ZeRO-3"
    lora_params = [p for n, p in params.items() if "lora_" in n]
    assert lora_params and all(p.numel() < p.ds_numel for p in lora_params), "the LoRA weights are not partitioned"
    assert len(seen) == 3
    adapted = {n for n in seen[0] if not torch.equal(seen[0][n], seen[1][n])}
    assert adapted and all(n.endswith(("q_proj.weight", "v_proj.weight", "up_proj.weight")) for n in adapted), adapted
    assert any(not torch.equal(seen[1][n], seen[2][n]) for n in adapted), "the second step did not change the adapter"
    assert not any(getattr(m, "merged", False) for m in model.modules()), "the trainer's model was left merged"
    report = {"device": device, "adapted_weights": len(adapted), "copied_tensors": generation.last_sync["copied"],
              "sync_seconds": generation.last_sync["seconds"]}
    print("ZERO3 LORA OK " + json.dumps(report), flush=True)
    return report


if __name__ == "__main__":
    run_worker(main, __doc__)
