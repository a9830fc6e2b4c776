"""Config errors raised before any model loads, YAML/CLI parsing through TRL's parser, and the TRL version pin."""
from __future__ import annotations

import json
import re

import pytest
from trl import TrlParser

from kvroll.trainers import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer, check_trl_version

from .tiny_model import length_reward

BASE = dict(report_to="none", use_cpu=True, per_device_train_batch_size=4, num_generations=4)


@pytest.mark.parametrize("config_cls", [GRPOConfig, RLOOConfig])
def test_kvroll_with_vllm_is_rejected(tmp_path, config_cls):
    with pytest.raises(ValueError, match="use_kvroll=True and use_vllm=True are exclusive"):
        config_cls(output_dir=str(tmp_path), use_kvroll=True, use_vllm=True, **BASE)


@pytest.mark.parametrize("kwargs, message", [
    (dict(kvroll_policy="nope"), "not a known policy"),
    (dict(kvroll_policy="longflow", kvroll_budget=0), "kvroll_budget=0"),
    (dict(kvroll_policy="longflow", kvroll_budget=None), "kvroll_budget=None"),
    (dict(kvroll_policy_kwargs={"no_such_knob": 1}), "no_such_knob"),
    (dict(kvroll_policy_kwargs="{not json"), "not valid JSON"),
    (dict(kvroll_mode="elsewhere"), "kvroll_mode='elsewhere'"),
    (dict(kvroll_max_batch=0), "kvroll_max_batch=0"),
    (dict(kvroll_dtype="int8"), "kvroll_dtype='int8'"),
    (dict(generation_kwargs={"num_beams": 4}), "num_beams"),
    (dict(max_completion_length=0), r"max_completion_length=0 is invalid with use_kvroll=True: use an integer >= 1"),
    (dict(max_completion_length=None), r"max_completion_length=None is invalid with use_kvroll=True"),
    (dict(temperature=0.0), r"temperature=0\.0 is invalid with use_kvroll=True: use a finite sampling temperature"),
    (dict(temperature=1e-6), r"temperature=1e-06 is invalid with use_kvroll=True: .* >= 1e-05"),
    (dict(temperature=float("inf")), r"temperature=inf is invalid with use_kvroll=True"),
    (dict(top_p=2.0), r"top_p=2\.0 is invalid with use_kvroll=True: top_p must be in \(0, 1\]"),
    (dict(generation_kwargs={"temperature": 0}), r"generation_kwargs\['temperature'\]=0 is invalid with "
                                                 "use_kvroll=True: kvroll would sample greedily"),
    (dict(generation_kwargs={"do_sample": False}), r"generation_kwargs\['do_sample'\]=False is invalid"),
    (dict(generation_kwargs={"seed": "a"}), r"generation_kwargs\['seed'\]='a' is invalid with use_kvroll=True: it "
                                            "must be an integer"),
    (dict(generation_kwargs={"max_tokens": 0}), r"generation_kwargs\['max_tokens'\]=0 is invalid"),
    # values a conversion would have changed (session 42's audit: "false" read as True, 2.7 as 2, 1.5 as 1)
    (dict(generation_kwargs={"ignore_eos": "false"}), r"generation_kwargs\['ignore_eos'\]='false' is invalid with "
                                                      r"use_kvroll=True: it must be True or False"),
    (dict(generation_kwargs={"ignore_eos": 1}), r"generation_kwargs\['ignore_eos'\]=1 is invalid"),
    (dict(generation_kwargs={"do_sample": "false"}), r"generation_kwargs\['do_sample'\]='false' is invalid with "
                                                     r"use_kvroll=True: it must be True or False"),  # not sampling
    (dict(generation_kwargs={"top_k": 2.7}), r"generation_kwargs\['top_k'\]=2\.7 is invalid with use_kvroll=True: "
                                             "it must be an integer"),
    (dict(generation_kwargs={"top_k": True}), r"generation_kwargs\['top_k'\]=True is invalid"),
    (dict(generation_kwargs={"seed": 1.5}), r"generation_kwargs\['seed'\]=1\.5 is invalid"),
    (dict(generation_kwargs={"temperature": "0.7"}), r"generation_kwargs\['temperature'\]='0\.7' is invalid"),
    (dict(generation_kwargs={"max_tokens": 16.5}), r"generation_kwargs\['max_tokens'\]=16\.5 is invalid"),
    # a length past max_completion_length (the rollouts were capped to it without a word), or two lengths
    (dict(max_completion_length=8, generation_kwargs={"max_tokens": 32}),
     r"generation_kwargs\['max_tokens'\]=32 is invalid with use_kvroll=True: it is longer than "
     r"max_completion_length=8.*raise max_completion_length to 32"),
    (dict(max_completion_length=8, generation_kwargs={"max_new_tokens": 9}), r"max_new_tokens'\]=9 is invalid"),
    (dict(generation_kwargs={"max_tokens": 8, "max_new_tokens": 6}), r"max_tokens=8 and max_new_tokens=6"),
    # TRL's deprecated alias of use_transformers_continuous_batching, read before TRL's __post_init__ copies it
    (dict(use_transformers_paged=True), r"use_kvroll=True and use_transformers_paged=True are exclusive"),
    (dict(use_transformers_continuous_batching=True), r"use_transformers_continuous_batching=True are exclusive"),
    # a constrained decoding kvroll does not do: refused, not silently dropped
    (dict(vllm_structured_outputs_regex="[0-9]+"), r"vllm_structured_outputs_regex is not supported with "
                                                  "use_kvroll=True"),
])
def test_invalid_kvroll_settings(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        GRPOConfig(output_dir=str(tmp_path), use_kvroll=True, **BASE, **kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(kvroll_num_workers=0), "kvroll_num_workers=0"),
    (dict(kvroll_gpus_per_worker=-1), "kvroll_gpus_per_worker=-1"),
    (dict(kvroll_gpus_per_worker=float("inf")), r"kvroll_gpus_per_worker=inf is invalid: use a finite number"),
    (dict(kvroll_worker_timeout_s=0), "kvroll_worker_timeout_s=0"),
    (dict(kvroll_worker_timeout_s=float("inf")), r"kvroll_worker_timeout_s=inf is invalid: use a finite number"),
    (dict(kvroll_sync_bucket_mb=0), "kvroll_sync_bucket_mb=0"),
    (dict(kvroll_ray_address="12"), r"kvroll_ray_address='12' is invalid \(no port\): use HOST:PORT"),
    (dict(kvroll_ray_address=12), r"kvroll_ray_address=12 is invalid \(of type int, not a string\)"),
    (dict(kvroll_ray_address="http://10.0.0.1:8265"), r"kvroll_ray_address='http://10.0.0.1:8265' is invalid"),
    (dict(kvroll_ray_address="10.0.0.1:70000"), r"kvroll_ray_address='10.0.0.1:70000' is invalid \(its port"),
    (dict(kvroll_ray_address="10.0.0.1:0"), r"kvroll_ray_address='10.0.0.1:0' is invalid \(its port is not a number "
                                            r"in 1\.\.65535\)"),  # parsed as port 0, which no head listens on
])
def test_invalid_ray_settings(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        GRPOConfig(output_dir=str(tmp_path), use_kvroll=True, kvroll_mode="ray", **BASE, **kwargs)


@pytest.mark.parametrize("address", ["auto", "10.0.0.1:6379", "head-node:6379", "ray://10.0.0.1:10001", "[::1]:6379"])
def test_valid_ray_addresses(tmp_path, address):
    args = GRPOConfig(output_dir=str(tmp_path), use_kvroll=True, kvroll_mode="ray", kvroll_ray_address=address, **BASE)
    assert args.kvroll_ray_address == address


def test_ray_fields_in_colocate_mode_warn_once_naming_them(tmp_path):
    with pytest.warns(UserWarning) as caught:
        GRPOConfig(output_dir=str(tmp_path), use_kvroll=True, kvroll_num_workers=2, kvroll_ray_address="auto", **BASE)
    ours = [str(w.message) for w in caught if "kvroll_mode='ray'" in str(w.message)]
    assert ours == ["kvroll_num_workers=2, kvroll_ray_address='auto' are ignored: only kvroll_mode='ray' uses the "
                    "Ray fields, and kvroll_mode='colocate'. Set kvroll_mode: ray for Ray rollout workers, or drop "
                    "them."]
    with pytest.warns(UserWarning, match=r"kvroll_ray_address='12' is ignored"):  # colocate never reads it
        GRPOConfig(output_dir=str(tmp_path), use_kvroll=True, kvroll_ray_address="12", **BASE)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the defaults, or ray mode: no warning
        GRPOConfig(output_dir=str(tmp_path), use_kvroll=True, **BASE)
        GRPOConfig(output_dir=str(tmp_path), use_kvroll=True, kvroll_mode="ray", kvroll_num_workers=2, **BASE)


def test_ray_fields_through_trl_parser(tmp_path):
    (args,) = TrlParser((RLOOConfig,)).parse_args_and_config(
        ["--output_dir", str(tmp_path), "--report_to", "none", "--use_cpu", "true", "--use_kvroll", "true",
         "--kvroll_mode", "ray", "--kvroll_num_workers", "3", "--kvroll_gpus_per_worker", "0.5",
         "--kvroll_ray_address", "10.0.0.1:6379", "--kvroll_worker_timeout_s", "90", "--num_generations", "4",
         "--per_device_train_batch_size", "4"])
    assert (args.kvroll_mode, args.kvroll_num_workers, args.kvroll_gpus_per_worker) == ("ray", 3, 0.5)
    assert (args.kvroll_ray_address, args.kvroll_worker_timeout_s, args.kvroll_sync_bucket_mb) == (
        "10.0.0.1:6379", 90.0, 1024)


def test_switch_off_keeps_trl_behaviour(tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path), use_vllm=False, kvroll_policy="nope", **BASE)
    assert not args.use_kvroll  # kvroll settings are only checked when the switch is on
    assert GRPOConfig(output_dir=str(tmp_path), max_completion_length=0, **BASE).max_completion_length == 0  # as TRL


@pytest.mark.parametrize("config_cls", [GRPOConfig, RLOOConfig])
@pytest.mark.parametrize("value", ["yes", "false", 1, None])
def test_use_kvroll_must_be_a_bool(tmp_path, config_cls, value):
    # TRL's parser turns "true"/"false" from YAML or the command line into bools; a Python caller's string is refused
    with pytest.raises(ValueError, match=rf"use_kvroll={value!r} is invalid: use True or False"):
        config_cls(output_dir=str(tmp_path), use_kvroll=value, **BASE)


def test_a_dataset_without_prompts_is_refused_before_the_model_loads(tmp_path):
    from datasets import Dataset

    from .tiny_model import tiny_llama, tokenizer

    model_dir = tmp_path / "config_only"
    tiny_llama(tokenizer()).config.save_pretrained(model_dir)
    (model_dir / "model.safetensors").write_bytes(b"")  # an empty weights file: loading it would fail
    args = GRPOConfig(output_dir=str(tmp_path / "out"), use_kvroll=True, kvroll_budget=16, **BASE)
    dataset = Dataset.from_dict({"question": ["1 + 1?"], "answer": ["2"]})
    message = r"train_dataset has no 'prompt' column \(its columns: \['question', 'answer'\]\)"
    with pytest.raises(ValueError, match=message):
        GRPOTrainer(model=str(model_dir), reward_funcs=length_reward, args=args, train_dataset=dataset)
    with pytest.raises(ValueError, match=message):  # positional, as TRL's signature allows
        GRPOTrainer(str(model_dir), length_reward, args, dataset)


def test_unsupported_architecture_fails_from_the_model_config(tmp_path):
    # A directory holding only a GPT-2 config: the error must come from the config, before any weights load.
    model_dir = tmp_path / "gpt2"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1}))
    args = GRPOConfig(output_dir=str(tmp_path / "out"), use_kvroll=True, **BASE)
    with pytest.raises(ValueError, match=r"'gpt2' is not supported; kvroll supports the families \['llama'"):
        GRPOTrainer(model=str(model_dir), reward_funcs=length_reward, args=args)


@pytest.mark.parametrize("config, message", [
    ("{not json", "has a config.json that cannot be read as JSON"),
    ('{"model_type": "llama", "hidden_size": 64}', "has a config.json but no weights (no *.safetensors, "),
])
def test_a_model_folder_that_cannot_load_is_one_error_before_trl_loads_it(tmp_path, config, message):
    """GRPOTrainer(model=PATH) with the switch on: transformers' OSError traceback before, from TRL's load."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(config)
    args = GRPOConfig(output_dir=str(tmp_path / "out"), use_kvroll=True, **BASE)
    with pytest.raises(ValueError, match=re.escape(f"model='{model_dir}' {message}")):
        GRPOTrainer(model=str(model_dir), reward_funcs=length_reward, args=args)


def test_yaml_and_cli_through_trl_parser(tmp_path):
    config = tmp_path / "grpo.yaml"
    config.write_text("\n".join([
        f"output_dir: {tmp_path / 'out'}", "report_to: none", "use_cpu: true", "per_device_train_batch_size: 4",
        "num_generations: 4", "use_kvroll: true", "kvroll_policy: longflow", "kvroll_budget: 64",
        "kvroll_policy_kwargs: {granularity: layer}", "kvroll_max_batch: 8"]))
    (args,) = TrlParser((GRPOConfig,)).parse_args_and_config(
        ["--config", str(config), "--kvroll_budget", "96", "--kvroll_dtype", "bfloat16"])
    assert (args.use_kvroll, args.kvroll_policy, args.kvroll_budget, args.kvroll_max_batch) == (True, "longflow", 96, 8)
    assert args.kvroll_policy_kwargs == {"granularity": "layer"} and args.kvroll_dtype == "bfloat16"
    (args,) = TrlParser((GRPOConfig,)).parse_args_and_config(
        ["--config", str(config), "--kvroll_policy_kwargs", '{"granularity": "head"}'])
    assert args.kvroll_policy_kwargs == {"granularity": "head"}  # a JSON string from the command line


def test_trl_version_pin():
    assert check_trl_version("1.16.0") == "1.16.0"
    assert check_trl_version("1.16.3.dev0") == "1.16.3.dev0"
    for other in ("1.15.2", "1.17.0", "2.16.0"):
        with pytest.raises(ImportError, match=r"supports TRL >=1.16,<1.17, but TRL " + other.replace(".", r"\.")):
            check_trl_version(other)


def test_full_with_the_default_budget_does_not_warn_about_a_budget_never_set(tmp_path):
    """kvroll_budget's default (1024) is not the user's: with policy 'full' it becomes None, with no warning that
    'full' ignores it; a budget the user set is still warned about."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        config = GRPOConfig(output_dir=str(tmp_path), use_kvroll=True, kvroll_policy="full", **BASE)
    assert config.kvroll_budget is None
    with pytest.warns(UserWarning, match="budget=64 is ignored by policy 'full'"):
        GRPOConfig(output_dir=str(tmp_path), use_kvroll=True, kvroll_policy="full", kvroll_budget=64, **BASE)


def test_lossless_generation_kwargs_are_taken(tmp_path):
    """Values whose conversion keeps them (an int temperature, a whole float length, numpy scalars, equal lengths
    under both names, a length up to max_completion_length) are taken as they are."""
    import numpy as np
    from kvroll.trainers.args import sampling_settings

    kwargs = {"temperature": 1, "max_tokens": 8.0, "max_new_tokens": 8, "top_k": np.int64(5), "ignore_eos": np.bool_(True),
              "seed": np.int32(3)}
    args = GRPOConfig(output_dir=str(tmp_path), use_kvroll=True, max_completion_length=8, generation_kwargs=kwargs,
                      **BASE)
    got = {name: value for name, (value, _) in sampling_settings(args).items()}
    assert (got["temperature"], got["max_new_tokens"], got["top_k"], got["ignore_eos"], got["seed"]) == (1.0, 8, 5, True, 3)
    assert type(got["max_new_tokens"]) is int and type(got["top_k"]) is int and got["ignore_eos"] is True


def test_any_integer_seed_in_generation_kwargs_is_accepted(tmp_path):
    """The adapter mixes the seed with the call and the rank into the engine's range: a seed outside that range is
    not refused at config time (it worked before the sampling checks)."""
    config = GRPOConfig(output_dir=str(tmp_path), use_kvroll=True, generation_kwargs={"seed": 2 ** 64}, **BASE)
    assert config.generation_kwargs["seed"] == 2 ** 64


def test_tools_or_an_environment_on_several_processes_in_ray_mode_are_refused():
    """TRL's tool loop calls the backend on the ranks with tool calls only, while ray mode's generate() is a
    collective (rank 0's pool serves every rank): refused there on several processes before the model loads; in
    colocate mode each rank generates its own rows (test_two_ranks.py runs it), and one process is fine."""
    from types import SimpleNamespace

    from kvroll.trainers.switch import check_tools

    def add(a: int, b: int) -> int:
        return a + b

    for kwargs, named in (({"tools": [add]}, "tools"), ({"environment_factory": object}, "environment_factory")):
        with pytest.raises(ValueError, match=rf"use_kvroll=True with {named} in kvroll_mode='ray' runs on one "
                                             r"process only; this run has 2 processes"):
            check_tools(SimpleNamespace(world_size=2, kvroll_mode="ray"), kwargs)
        check_tools(SimpleNamespace(world_size=2, kvroll_mode="colocate"), kwargs)
        check_tools(SimpleNamespace(world_size=1, kvroll_mode="ray"), kwargs)
    check_tools(SimpleNamespace(world_size=4, kvroll_mode="ray"), {"tools": []})  # none given


def test_an_environment_may_own_the_prompts_and_the_rewards(tmp_path):
    """TRL 1.16: with an environment_factory the dataset needs no 'prompt' column (reset() supplies each prompt) and
    reward_funcs may be omitted (get_reward scores); the switch keeps both, and asks the engine for the processed
    logprobs TRL asks vLLM for."""
    import os

    import trl
    from datasets import Dataset

    from .tiny_model import tiny_llama, tokenizer

    class Env:
        def reset(self, **kwargs):
            return "What is 1 + 2?"

        def get_reward(self, **kwargs):
            return 0.0

        def add(self, a: int, b: int) -> int:
            """Add two integers.

            Args:
                a: the first
                b: the second
            """
            return a + b

    tok = tokenizer()
    tok.chat_template = open(os.path.join(os.path.dirname(trl.__file__), "chat_templates", "qwen3.jinja")).read()
    data = Dataset.from_list([{"seed": i} for i in range(8)])
    args = GRPOConfig(output_dir=str(tmp_path), use_kvroll=True, kvroll_policy="longflow", kvroll_budget=16,
                      max_completion_length=8, max_steps=1, top_k=5, top_p=0.9, bf16=False, save_strategy="no",
                      **BASE)
    trainer = GRPOTrainer(model=tiny_llama(tok), args=args, train_dataset=data, processing_class=tok,
                          environment_factory=Env)
    sampling = trainer.kvroll_generation._sampling(0)
    assert (sampling.logprobs_mode, sampling.top_k, sampling.top_p) == ("processed", 5, 0.9)


@pytest.mark.parametrize("field, value, key", [
    ("temperature", 0.7, "temperature"), ("top_p", 0.8, "top_p"), ("top_k", 7, "top_k"), ("min_p", 0.05, "min_p"),
    ("repetition_penalty", 1.3, "repetition_penalty"), ("max_completion_length", 12, "max_new_tokens"),
    ("seed", 5, "seed"),
])
def test_each_sampling_field_reaches_the_rollout_settings(tmp_path, field, value, key):
    from kvroll.trainers.args import sampling_settings

    args = GRPOConfig(output_dir=str(tmp_path), use_kvroll=True, **BASE, **{field: value})
    assert sampling_settings(args)[key] == (value, field)


@pytest.mark.parametrize("kwargs, message", [
    (dict(repetition_penalty=0.0), r"repetition_penalty=0\.0 is invalid with use_kvroll=True"),
    (dict(min_p=1.5), r"min_p=1\.5 is invalid with use_kvroll=True"),
])
def test_invalid_sampling_fields_are_named(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        GRPOConfig(output_dir=str(tmp_path), use_kvroll=True, **BASE, **kwargs)


def test_the_adapter_samples_with_every_setting(tmp_path):
    """The SamplingParams of a rollout: the fields, generation_kwargs' stop ids after TRL's EOS ids, a shorter
    max_tokens, a seed that changes with each generation call, and one engine slot per row of a generation call."""
    from .tiny_model import chat_dataset, tiny_llama, tokenizer

    tok = tokenizer()
    args = GRPOConfig(output_dir=str(tmp_path), use_kvroll=True, kvroll_policy="longflow", kvroll_budget=16,
                      max_completion_length=8, repetition_penalty=1.3, min_p=0.05, seed=3, bf16=False,
                      gradient_accumulation_steps=2, generation_kwargs={"stop_token_ids": [7], "max_tokens": 6},
                      save_strategy="no", **BASE)
    trainer = GRPOTrainer(model=tiny_llama(tok), reward_funcs=length_reward, args=args,
                          train_dataset=chat_dataset(), processing_class=tok)
    generation = trainer.kvroll_generation
    sampling = generation._sampling(4)
    assert (sampling.repetition_penalty, sampling.min_p, sampling.max_new_tokens) == (1.3, 0.05, 6)
    assert sampling.stop_token_ids == (*trainer.eos_token_ids, 7)
    generation.calls += 1
    assert generation._sampling(4).seed != sampling.seed
    generation._build()
    assert generation.engine.max_batch == 4 * 2  # per_device_train_batch_size * steps_per_generation


def test_the_trainer_checks_tools_before_the_model_loads(tmp_path, monkeypatch):
    """The ray-mode tools refusal (check_tools, above) is wired into the trainer's set-up: raised from the config
    and the trainer's arguments alone, before the model (here a path that does not exist) is read."""
    from kvroll.trainers import switch

    def add(a: int, b: int) -> int:
        return a + b

    args = GRPOConfig(output_dir=str(tmp_path), use_kvroll=True, kvroll_mode="ray", **BASE)
    monkeypatch.setattr(GRPOConfig, "world_size", property(lambda self: 2))
    with pytest.raises(ValueError, match=r"use_kvroll=True with tools in kvroll_mode='ray' runs on one process"):
        switch.prepare(str(tmp_path / "no_model"), args, {"tools": [add]})


@pytest.mark.parametrize("config_cls, trainer_cls", [(GRPOConfig, GRPOTrainer), (RLOOConfig, RLOOTrainer)])
def test_full_past_the_model_s_positions_is_refused_before_the_model_loads(tmp_path, config_cls, trainer_cls):
    """smollm2 has 8,192 positions; 'full' keeps every token at its true position, so 9,000 new tokens cannot fit
    whatever the prompt. The engine refused it at the first rollout, after the model had loaded."""
    args = config_cls(output_dir=str(tmp_path), use_kvroll=True, kvroll_policy="full", kvroll_budget=None,
                      max_completion_length=9000, **BASE)
    with pytest.raises(ValueError, match=r"max_completion_length=9000\): .*max_position_embeddings=8192.*lower "
                                         r"max_completion_length to <= 8191"):
        trainer_cls(model="smollm2", reward_funcs=length_reward, args=args)
