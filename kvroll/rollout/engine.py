"""RolloutEngine: continuous-batching generation on a static compressed KV cache.

    from kvroll import RolloutEngine, SamplingParams, CompressionConfig
    engine = RolloutEngine("smollm2", compression=CompressionConfig(policy="longflow", budget=256), max_batch=16)
    results = engine.generate(prompt_token_ids, SamplingParams(max_new_tokens=512, temperature=0.7, seed=0), n=4)
    engine.kv_cache_bytes()             # fixed at construction for a compressing policy
    engine.load_weights(model.named_parameters())  # in-place update
    engine.close()                      # frees the cache now (also: ``with RolloutEngine(...) as engine:``)

Each prompt is prefilled once (and compressed if over budget); its cache is copied into ``n`` slots (equal prompts
at two indices are two prompts: deduplicating them is the caller's, e.g. the trainers' adapter's). The
prompts the free slots take are prefilled together, in forwards of right-padded rows (the host side of a call,
``scheduler.GenerateRun``, decides which and when).
A finished slot is refilled from the waiting prompts. Results come back one per (prompt, sample), in order.

The model's limits are checked before any work (``kvroll.rollout.model``): a compressing policy's budget must
not exceed ``max_position_embeddings``; prompt + max_new_tokens past it is an error for ``full`` and a warning
for a compressing policy (its cache stays bounded). A model whose config sets a sliding window W (Mistral,
Qwen2/Qwen3 with ``use_sliding_window``) is generated exactly: up to W positions every policy is full attention
within the window; past W, ``full`` keeps the last W positions in a ring when every layer slides, and anything
else is refused with a ``ValueError``.
"""
from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Mapping

import torch

from kvroll.checks import as_int
from kvroll.config import CompressionConfig
from kvroll.hf_compat import CACHE_KW
from kvroll.kernels.fusions import SAMPLING, check_fusions, install_fusions, resolve_fusions
from kvroll.kernels.sample import check_sampler_device
from kvroll.kernels.rmsnorm import install_fused_rmsnorm
from kvroll.rollout import attention
from kvroll.rollout.cache import CompressedKVCache, PromptKV
from kvroll.policies.baselines import sliding_window_ring
from kvroll.rollout.graphs import DecodeRunner, forward_decode, graph_key
from kvroll.rollout.model import (check_budget_fits, check_causal_lm, check_cuda_graphs, check_device, check_dtype,
                                  check_family, check_generation_length, check_sync_every, load_config, load_model,
                                  sliding_window)
from kvroll.rollout.requests import Completion, validate_request
from kvroll.rollout.sampling import SamplingParams
from kvroll.rollout.scheduler import GenerateRun


class RolloutEngine:
    """Generation over a fixed number of slots with a compressed, pre-allocated KV cache (see module doc).

    ``model`` is ``"smollm2"``, a local HF directory, or an already-built HF causal LM (its module tree and
    parameters are used as they are, in their own dtype (a ``dtype`` of another is refused); pass its tokenizer's
    ids as prompts). ``tokenizer``, where given, is kept as ``engine.tokenizer`` (a named model's own otherwise) and
    its EOS id joins the stop ids. On CUDA the decode step is replayed
    from CUDA graphs (``cuda_graphs``, default on), so are R-KV's and SnapKV's compression events, and the host
    reads the sampled tokens every ``sync_every`` steps (default 16 on CUDA, 1 on CPU).

    ``close()`` (or leaving a ``with`` block) frees the cache and the captured graphs at once; so does dropping
    the last reference to the engine (no reference cycle holds them).

    Decode-step fusions (``kvroll/kernels/fusions.py``), each None by default: on for a model on CUDA (measured
    faster, none slower), off elsewhere; True / False force them (on CPU, in prefill and under autograd the model
    runs HF's forwards whatever the switch): ``fused_mlp`` (one gate+up matmul against a joined
    weight whose halves are the parameters, so ``load_weights`` still reaches it, then one SiLU·mul kernel),
    ``fused_qkv_rotary`` (one QKV matmul, then one kernel for Qwen3's q/k norms and rotary), ``fused_add_norm``
    (the mid-layer residual add and the post-attention RMSNorm in one kernel). ``fused_sampling``: the draw, its
    logprob and the finite check in two Triton kernels (``kvroll/kernels/sample.py``; the randomness drawn inside
    them by Philox from a seed this call's generator draws: where the head runs in the kernel Gumbel noise on its
    64-wide vocabulary tiles or a draw per tile on 128-wide ones, else the inverse CDF at one uniform per row:
    torch's sampler's distribution, not its draws) when no
    top-k / top-p / min-p / repetition penalty is set; on CPU only under ``TRITON_INTERPRET=1``.
    """

    def __init__(self, model="smollm2", compression: CompressionConfig | None = None, max_batch: int = 16,
                 dtype: torch.dtype | None = None, device: str | torch.device | None = None, tokenizer=None,
                 cuda_graphs: bool | None = None, sync_every: int | None = None, fused_mlp: bool | None = None,
                 fused_qkv_rotary: bool | None = None, fused_add_norm: bool | None = None,
                 fused_sampling: bool | None = None):
        if not (as_int(max_batch) is not None and max_batch >= 1):  # a Python or numpy integer, not a bool
            raise ValueError(f"RolloutEngine.max_batch={max_batch!r} is invalid: it must be an integer >= 1.")
        max_batch = int(max_batch)
        named = isinstance(model, (str, bytes)) or hasattr(model, "__fspath__")
        if not named and not (hasattr(model, "config") and hasattr(model, "parameters")):
            raise TypeError(f"RolloutEngine.model={model!r} ({type(model).__name__}) is not a model: pass 'smollm2', "
                            "a local Hugging Face model directory, or an already-built HF causal LM.")
        if isinstance(tokenizer, (str, bytes)) or hasattr(tokenizer, "__fspath__"):  # kept as it was, never loaded
            raise TypeError(f"RolloutEngine.tokenizer={tokenizer!r} is a name, not a tokenizer: pass a tokenizer "
                            "object (AutoTokenizer.from_pretrained(path)), or leave it out for a named model's own.")
        check_sync_every(sync_every)
        check_cuda_graphs(cuda_graphs)
        fusions = dict(fused_mlp=fused_mlp, fused_qkv_rotary=fused_qkv_rotary, fused_add_norm=fused_add_norm,
                       fused_sampling=fused_sampling)
        check_fusions(fusions)
        if compression is None:
            compression = CompressionConfig("full")
        if not isinstance(compression, CompressionConfig):
            raise ValueError(f"RolloutEngine.compression={compression!r} must be a kvroll.CompressionConfig.")
        self.compression, self.policy, self.max_batch = compression, compression.build(), max_batch
        check_device(device)
        dtype = check_dtype(dtype)  # a dtype's name is taken as the dtype
        if named:
            model = os.fsdecode(model)  # a str, bytes or os.PathLike path
            check_budget_fits(load_config(model), compression)  # before the weights are read
            device = device or ("cuda" if torch.cuda.is_available() else "cpu")
            # a given tokenizer is kept, and the directory need not have one
            self.model, loaded = load_model(model, dtype=dtype, device=device, tokenizer=tokenizer is None)
            self.tokenizer = tokenizer if tokenizer is not None else loaded  # a given tokenizer is kept
        else:
            check_family(model.config)
            check_causal_lm(model)
            check_budget_fits(model.config, compression)
            check_device(device, model)
            if dtype not in (None, "auto") and next(model.parameters()).dtype != dtype:  # before the model is touched
                raise ValueError(f"RolloutEngine.dtype={dtype} but the model's parameters are "
                                 f"{next(model.parameters()).dtype}; the engine does not cast a model it is given: "
                                 f"call model.to({dtype}) first, or leave dtype=None.")
            attention.register()
            model.set_attn_implementation(attention.ATTN_IMPLEMENTATION)
            self.model, self.tokenizer = model, tokenizer
        self.device = next(self.model.parameters()).device
        if self.device.type == "cuda":  # HF's RMSNorm is ~8 kernels a call; decode runs no-grad
            install_fused_rmsnorm(self.model)
        fusions = resolve_fusions(fusions, self.device)
        check_sampler_device(fusions[SAMPLING], self.device)
        for name, on in fusions.items():  # self.fused_mlp, .fused_qkv_rotary, .fused_add_norm, .fused_sampling
            setattr(self, name, on)
        install_fusions(self.model, fusions)  # taken only for CUDA no-grad (decode) forwards (kvroll/kernels/fusions.py)
        cfg = self.model.config
        self.vocab_size = cfg.vocab_size
        self.max_positions = getattr(cfg, "max_position_embeddings", None) or (1 << 62)
        self.sliding_window = sliding_window(cfg)  # (W, sliding layers) or None
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.policy.num_q_heads = cfg.num_attention_heads  # query-ring policies (R-KV, SnapKV) size their state
        self.eos_ids = _eos_ids(self.model, self.tokenizer)
        on_cuda = self.device.type == "cuda"
        if cuda_graphs and not on_cuda:
            raise ValueError(f"RolloutEngine.cuda_graphs=True needs the model on a CUDA device (it is on "
                             f"{self.device}); leave cuda_graphs=None.")
        self.cuda_graphs = on_cuda if cuda_graphs is None else bool(cuda_graphs)
        self.sync_every = int(sync_every) if sync_every is not None else (16 if on_cuda else 1)
        self.generator = torch.Generator(device=self.device)  # one object: captured graphs hold its state
        self._runner: DecodeRunner | None = None
        self.cache: CompressedKVCache | None = None
        self.closed = False
        self.stats = {"prefill_tokens": 0, "prefills": 0, "decode_steps": 0, "generated_tokens": 0,
                      "decode_windows": 0,  # host reads of the sampled tokens (one per window)
                      "policy_seconds": 0.0,  # time of periodic policy work (its GPU time on CUDA)
                      "policy_events": deque(maxlen=4096)}  # (decode steps so far, seconds) per compression
        if self.policy.name != "full":
            self._allocate(self.policy.capacity(compression.budget, 0))

    # ---- public API ----------------------------------------------------------------------------------------
    def kv_cache_bytes(self) -> int:
        """Bytes of the K/V buffers (slots x layers x 2 x kv_heads x capacity x head_dim x dtype bytes).

        Metadata (positions, counts, write indices, ``vnorm``, policy state) is reported apart by
        ``kv_metadata_bytes``. For ``full`` the
        cache is sized per ``generate`` call (prompt + max_new_tokens), so this is 0 before the first call.
        """
        return self.cache.kv_bytes() if self.cache is not None else 0

    def kv_metadata_bytes(self) -> int:
        """Bytes of the cache's bookkeeping beside K and V (``CompressedKVCache.metadata_bytes``: positions, counts,
        write indices, decode positions, ``vnorm``, policy state); 0 once closed."""
        return self.cache.metadata_bytes() if self.cache is not None else 0

    def close(self) -> None:
        """Free the KV cache and the captured decode graphs now; the model is left as it is. Idempotent.

        ``generate`` then raises; ``load_weights`` still works. ``with RolloutEngine(...) as engine:`` closes on exit.
        """
        self._runner = None
        self.cache = None
        self.closed = True

    def __enter__(self) -> "RolloutEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @torch.no_grad()
    def load_weights(self, named_tensors) -> int:
        """Copy (name, tensor) pairs named as the HF model's parameters into the model, in place.

        In-place copies keep captured CUDA graphs valid. Returns the number of tensors loaded. A mapping of names to
        tensors (``model.state_dict()``) is read as its items.
        """
        if isinstance(named_tensors, Mapping):
            named_tensors = list(named_tensors.items())
        params = dict(self.model.named_parameters(remove_duplicate=False))
        # A list, tuple or mapping is checked whole before the first copy (a refused call leaves the weights as they
        # were). Any other iterable is read one pair at a time, each copied before the next is asked for: its
        # tensors may be valid only until then (a ZeRO-3 gather per parameter, a conversion made on the fly), and
        # holding them all would cost a second copy of the model.
        whole = isinstance(named_tensors, (list, tuple))

        def check(name, tensor):
            done = " Nothing was loaded." if whole else ""
            if name not in params:
                raise ValueError(f"load_weights: unknown parameter name {name!r}; names must match the HF model's "
                                 f"named_parameters() (e.g. 'model.layers.0.self_attn.q_proj.weight').{done}")
            target = params[name]
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"load_weights: {name!r} is a {type(tensor).__name__}, not a torch.Tensor (convert it "
                                 f"with torch.as_tensor).{done}")
            if tensor.is_meta:
                raise ValueError(f"load_weights: {name!r} is a meta tensor (it holds no data).{done}")
            if tensor.is_floating_point() != target.is_floating_point():
                raise ValueError(f"load_weights: {name!r} has dtype {tensor.dtype}, the model's parameter is "
                                 f"{target.dtype}.{done}")
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"load_weights: {name!r} has shape {tuple(tensor.shape)}, the model expects "
                                 f"{tuple(target.shape)}.{done}")
            return target

        pairs = ((check(name, tensor), tensor) for name, tensor in named_tensors)
        if whole:
            pairs = list(pairs)  # every pair checked, once, before the first copy
        loaded = 0
        for target, tensor in pairs:
            if target.data_ptr() != tensor.data_ptr():
                target.copy_(tensor)
            loaded += 1
        return loaded

    @torch.no_grad()
    def generate(self, prompt_token_ids, sampling: SamplingParams | None = None, n: int = 1,
                 progress=None) -> list[Completion]:
        """Generate ``n`` samples for each prompt; returns len(prompts) * n Completions in input order."""
        if self.closed:
            raise RuntimeError("RolloutEngine.generate: this engine was closed (close() freed its cache); make a "
                               "new RolloutEngine.")
        sampling = sampling if sampling is not None else SamplingParams()
        prompts = validate_request(prompt_token_ids, sampling, n, self.vocab_size, self.max_positions)
        n = int(n)  # a numpy integer is taken, as a Python int
        longest = max(len(p) for p in prompts)
        check_generation_length(self.model.config, self.policy.name, longest, sampling.max_new_tokens)
        if self.policy.name == "full":
            self._size_full_cache(longest + sampling.max_new_tokens)
        generator = self.generator
        self.cache.generator = generator  # the captured steps sample from this generator (``random`` evicts by a hash)
        self._decode_runner(sampling)  # capture (its warm-up draws random numbers) before seeding
        generator.manual_seed(sampling.seed if sampling.seed is not None else int(time.time_ns() % (1 << 62)))
        stop = set(sampling.stop_token_ids if sampling.stop_token_ids is not None else self.eos_ids)
        if sampling.ignore_eos:
            stop = set(sampling.stop_token_ids or ())
        return GenerateRun(self, prompts, sampling, n, generator, stop, progress).run()

    # ---- internals -------------------------------------------------------------------------------------------
    def _decode_runner(self, sampling: SamplingParams) -> DecodeRunner:
        """The decode step's static buffers and CUDA graphs for these sampling settings (captured once)."""
        runner = self._runner
        if runner is None or runner.key != (graph_key(sampling), id(self.cache)):
            self._runner = None  # free the old graphs' memory before capturing new ones
            runner = self._runner = DecodeRunner(self, sampling, self.generator, self.cuda_graphs)
        runner.sampling = sampling  # same graph key: only free fields (seed, lengths, stop ids) differ
        return runner

    def _size_full_cache(self, max_len: int) -> None:
        """``full`` holds prompt + max_new_tokens; past a sliding window W (every layer slides, else ``generate``
        refused) the model never attends further back than W, so a ring of W slots holds what it attends."""
        ring = self.sliding_window is not None and max_len > self.sliding_window[0]
        needed = self.sliding_window[0] if ring else max_len
        if self.cache is None or self.cache.capacity < needed or (ring and self.cache.policy is self.policy):
            self._allocate(max_len)

    def _allocate(self, capacity: int) -> None:
        cfg = self.model.config
        dtype = next(self.model.parameters()).dtype
        policy, budget = self.policy, self.compression.budget
        if policy.name == "full" and self.sliding_window and capacity > self.sliding_window[0]:
            policy, capacity = sliding_window_ring(), self.sliding_window[0]  # exact: see sliding_window_ring
            budget = capacity
        self._runner = None
        self.cache = None  # free the old buffers first
        self.cache = CompressedKVCache(cfg.num_hidden_layers, self.max_batch, self.num_kv_heads, capacity,
                                       self.head_dim, dtype, self.device, policy, budget, scale=self.head_dim ** -0.5)

    def _prefill(self, ids: list[int]) -> tuple[PromptKV, torch.Tensor]:
        cache = self.cache
        cache.mode = "prefill"
        try:
            input_ids = torch.tensor([ids], device=self.device)
            positions = torch.arange(len(ids), device=self.device)[None]
            out = self.model(input_ids=input_ids, position_ids=positions, **{CACHE_KW: cache},
                             kvroll_cache=cache, attention_mask=attention.dummy_mask(1, self.device),
                             use_cache=True, logits_to_keep=1)
        finally:
            cache.mode = "decode"
        self.stats["prefill_tokens"] += len(ids)
        self.stats["prefills"] += 1
        return cache.take_prompt(len(ids)), out.logits[0, -1].float()

    def _prefill_many(self, prompts: list[list[int]]) -> list[tuple[PromptKV, torch.Tensor]]:
        """``_prefill`` of several prompts in one forward (each no longer than ``cache.prefill_limit()``, so none is
        compressed at prefill): the rows right-padded to the longest, so under the causal mask a prompt's positions
        attend only to its own earlier ones (the pads' keys and values zeroed); each row's logits at its last position
        (the output head applied to those rows alone). One forward instead of one per prompt: a prefill is
        host-bound (~1,400 launches, 34 ms for Qwen3-1.7B on an H200 whatever the prompt's length, session 43)."""
        cache, lengths = self.cache, [len(ids) for ids in prompts]
        width = max(lengths)
        input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
        for row, ids in enumerate(prompts):
            input_ids[row, :len(ids)] = torch.tensor(ids)
        input_ids = input_ids.to(self.device)
        positions = torch.arange(width, device=self.device)[None].expand(len(prompts), -1)
        last = torch.tensor(lengths, device=self.device) - 1
        rows = torch.arange(len(prompts), device=self.device)

        def last_positions(module, args):  # hidden [B, P, H] -> each row's last prompt position [B, 1, H]
            return (args[0][rows, last][:, None],) + tuple(args[1:])

        hook = self.model.get_output_embeddings().register_forward_pre_hook(last_positions)
        cache.mode, cache.prompt_lengths = "prefill", lengths
        # the padding's keys and values are zeroed in every layer (attention.py): a pad position's non-finite
        # value would reach the prompt's positions through the 0 weight its masked score gets (0 x inf = NaN)
        cache.prompt_pad = (positions > last[:, None])[:, None, :, None] if min(lengths) < width else None
        try:
            out = self.model(input_ids=input_ids, position_ids=positions, **{CACHE_KW: cache},
                             kvroll_cache=cache, attention_mask=attention.dummy_mask(len(prompts), self.device),
                             use_cache=True, logits_to_keep=0)
        except BaseException:
            cache._prompt = [None] * cache.num_layers  # the layers' padded K/V (views) are not held past a failure
            raise
        finally:
            hook.remove()
            cache.mode, cache.prompt_lengths, cache.prompt_pad = "decode", None, None
        self.stats["prefill_tokens"] += sum(lengths)
        self.stats["prefills"] += len(prompts)
        logits = out.logits[:, -1].float()
        return list(zip(cache.take_prompts(lengths), logits.unbind(0)))

    def _forward_decode(self, tokens: torch.Tensor, cache: CompressedKVCache | None = None) -> torch.Tensor:
        """One decode step for the cache's slots: tokens [slots] -> fp32 logits [slots, vocab]. No host sync."""
        return forward_decode(self.model, tokens, cache if cache is not None else self.cache)


def _eos_ids(model, tokenizer) -> tuple[int, ...]:
    ids = []
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for source in (gen_eos, getattr(model.config, "eos_token_id", None),
                   getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None):
        if source is None:
            continue
        ids.extend(source if isinstance(source, (list, tuple)) else [source])
    return tuple(dict.fromkeys(int(i) for i in ids))
