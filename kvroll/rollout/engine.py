"""RolloutEngine: continuous-batching generation on a static compressed KV cache.

    from kvroll import RolloutEngine, SamplingParams, CompressionConfig
    engine = RolloutEngine("smollm2", compression=CompressionConfig(policy="longflow", budget=256), max_batch=16)
    results = engine.generate(prompt_token_ids, SamplingParams(max_new_tokens=512, temperature=0.7, seed=0), n=4)
    engine.kv_cache_bytes()             # fixed at construction for a compressing policy
    engine.load_weights(model.named_parameters())  # in-place update
    engine.close()                      # frees the cache now (also: ``with RolloutEngine(...) as engine:``)

Each prompt is prefilled once (and compressed if over budget); its cache is copied into ``n`` slots (equal prompts
at two indices are two prompts: deduplicating them is the caller's, e.g. the trainers' adapter's). The
prompts the free slots take are prefilled together, in forwards of right-padded rows (``_prefill_ahead``).
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
from dataclasses import dataclass, field

import numpy as np
import torch

from kvroll.config import CompressionConfig
from kvroll.hf_compat import CACHE_KW
from kvroll.kernels.fusions import SAMPLING, check_fusions, install_fusions, resolve_fusions
from kvroll.kernels.sample import check_sampler_device, reseed
from kvroll.kernels.rmsnorm import install_fused_rmsnorm
from kvroll.rollout import attention
from kvroll.rollout.cache import CompressedKVCache, PromptKV
from kvroll.policies.baselines import sliding_window_ring
from kvroll.rollout.graphs import DecodeRunner, forward_decode, graph_key
from kvroll.rollout.model import (check_budget_fits, check_causal_lm, check_cuda_graphs, check_device, check_dtype,
                                  check_family, check_generation_length, check_sync_every, load_config, load_model,
                                  sliding_window)
from kvroll.rollout.requests import validate_request
from kvroll.rollout.schedule import EventClock, HostSchedule
from kvroll.rollout.sampling import SamplingParams, sample, token_id


@dataclass
class Completion:
    """One sample of one prompt."""

    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" (a stop token, included in token_ids) or "length"
    weight_version: int | None = None  # the synced weight version a Ray worker generated it with


# padded tokens of one batched prefill (rows x the longest prompt): bounds its activations and the K/V it holds until
# take_prompts copies them (~0.9 GB for Qwen3-1.7B in bf16)
PREFILL_TOKENS = 8192


@dataclass
class _Group:
    """A prefilled prompt waiting for free slots for its remaining samples."""

    prompt_index: int
    prompt: PromptKV
    logits: torch.Tensor  # [vocab] the prompt's last-position logits
    next_sample: int = 0


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
        if not (token_id(max_batch) is not None and max_batch >= 1):  # a Python or numpy integer, not a bool
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

        Metadata (positions, counts, policy state) is reported apart by ``kv_metadata_bytes``. For ``full`` the
        cache is sized per ``generate`` call (prompt + max_new_tokens), so this is 0 before the first call.
        """
        return self.cache.kv_bytes() if self.cache is not None else 0

    def kv_metadata_bytes(self) -> int:
        """Bytes of the cache's bookkeeping beside K and V (positions, policy statistics); 0 once closed."""
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
        return _Run(self, prompts, sampling, n, generator, stop, progress).run()

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


class _Run:
    """The host-side scheduler of one ``generate`` call (slots, waiting prompts, results).

    Decode runs in windows of up to ``sync_every`` steps with no host synchronisation inside: the step's sampled
    tokens stay on the device and are read once per window, while the next window runs (``run``). A window never
    runs a live sequence past its ``max_new_tokens``; tokens sampled after a stop token are dropped. Periodic
    compression runs inside the window, between two steps, where the host knows the fill of every slot
    (``schedule.py``: R-KV, SnapKV, LagKV, Hard-KV); a periodic policy without a host schedule would end a window at
    the next slot's compression (a device read: the path ``HostSchedule.for_cache`` returning None takes, with no
    window overlap). Between windows: refill free slots, compact live slots to the front (so a smaller captured
    batch replays), run the due periodic work of the read-the-device path.
    """

    def __init__(self, engine: RolloutEngine, prompts, sampling, n, generator, stop, progress):
        self.e, self.prompts, self.sp, self.n = engine, prompts, sampling, n
        self.generator, self.stop, self.progress = generator, stop, progress
        # the stop ids a sampled token can equal, as an array for ``_consume`` (an id past the vocabulary never stops)
        self.stop_ids = np.fromiter((t for t in stop if t < engine.vocab_size), dtype=np.int64)
        self.results: list[Completion | None] = [None] * (len(prompts) * n)
        self.waiting = deque(range(len(prompts)))
        self.groups: deque[_Group] = deque()
        self.owner: list[Completion | None] = [None] * engine.max_batch
        self.runner = engine._decode_runner(sampling)  # captures before any slot is placed (see graphs.py)
        self.tokens, self.seen = self.runner.tokens, self.runner.seen
        if self.runner.rng is not None:  # the fused sampler's noise: a new seed from this call's generator
            reseed(self.runner.rng, generator)
        self.schedule = HostSchedule.for_cache(engine.cache, engine.max_batch)
        self.clock = EventClock(engine.device)

    def run(self) -> list[Completion]:
        """Decode windows until every sequence is done. With ``overlap``, window k + 1 is launched before window k
        is read: the host reads and records window k and compacts while the device runs k + 1, so that between
        windows without refills the device does not wait on the host. A refill does wait: its prefill and first
        token are read on the host, behind the window in flight. The price: a sequence that stops in window k
        runs on through window k + 1 (those tokens are dropped; a host-scheduled policy may compress it there),
        and its slot is refilled one window later. The steps of window k + 1 count window k's as taken, so no
        sequence runs past its ``max_new_tokens``; a slot that reaches them in window k rides along in window
        k + 1 unread. The read-the-device periodic path (no host schedule) reads each window before the next. On a
        CPU, where work is synchronous, the same order runs without the gain."""
        overlap = not (self.e.policy.periodic and self.schedule is None)
        buffers = [_Buffers(self.e.sync_every, self.e.max_batch, self.e.device) for _ in range(1 + overlap)]
        pending, launched = None, 0
        while True:
            self._fill_slots()
            window = self._launch(buffers[launched % len(buffers)], pending)
            launched += window is not None
            if pending is not None:
                self._finish(pending)
            elif window is None:
                break
            pending = window
            if not overlap and pending is not None:
                self._finish(pending)
                pending = None
        assert all(r is not None for r in self.results)
        return self.results  # type: ignore[return-value]

    def _launch(self, buffers: "_Buffers", pending: "_Window | None") -> "_Window | None":
        """Queue the next decode window on the device (no host sync), or return None when no live sequence has a
        step left beyond ``pending``'s (those that do not end their length in ``pending`` do)."""
        active = [s for s, c in enumerate(self.owner) if c is not None]
        ahead = {id(c) for c in pending.comps} if pending is not None else set()
        ahead_steps = pending.steps if pending is not None else 0
        room = [self.sp.max_new_tokens - len(self.owner[s].token_ids) - (ahead_steps if id(self.owner[s]) in ahead
                                                                          else 0) for s in active]
        room = [r for r in room if r > 0]  # the others end by length in ``pending``: they ride along, unread
        if not room:
            return None
        active = self._compact(active)
        batch = self.runner.bucket(len(active))
        steps = min([self.e.sync_every] + room)
        if self.e.policy.periodic and self.schedule is None:
            steps = min(steps, self._periodic_work(active))
        hist = buffers.device
        after_step = getattr(self.progress, "after_step", None)  # a measurement's per-step device sample (bench)
        for i in range(steps):
            if self.schedule is not None:
                self._scheduled_work(active, i)
            self.runner.step(batch)
            hist[i, 0, :batch] = self.runner.tokens[:batch]
            hist[i, 1, :batch] = self.runner.logprobs[:batch]
            hist[i, 2, :batch] = self.runner.finite[:batch]
            if after_step is not None:
                after_step()
        self.e.stats["decode_steps"] += steps
        self.e.stats["decode_windows"] += 1
        window = _Window(active, [self.owner[s] for s in active], steps, buffers.read(steps), self.clock.recorded)
        queued = getattr(self.progress, "kvroll_window_queued", None)  # (kvroll.bench.measure.Timeline's; on a CPU
        if callable(queued):  # the window has run by now)
            queued()
        return window

    def _finish(self, window: "_Window") -> None:
        """Wait for ``window`` (its one host sync), record its tokens and events, free its finished slots."""
        read = window.wait()  # [steps, 3, max_batch]
        if hasattr(self.progress, "synced"):  # (kvroll.bench.measure.Timeline marks the window here)
            self.progress.synced()
        live = [j for j, c in enumerate(window.comps) if c.finish_reason is None]  # (not done in an earlier one)
        cols = [window.slots[j] for j in live]  # the steps wrote each slot's column (slots need not be 0..n-1)
        self._consume(read.transpose(1, 0, 2)[:, :, cols], [window.comps[j] for j in live])
        self._free_finished()
        self._record_events(self.clock.settle(window.events))

    def _free_finished(self) -> None:
        for slot, comp in enumerate(self.owner):
            if comp is not None and comp.finish_reason is not None:
                self.owner[slot] = None

    def _scheduled_work(self, active: list[int], step: int) -> None:
        """Before step ``step`` of a window: compress the slots the host schedule says are full (no device read)."""
        due = self.schedule.due(active)
        if due:
            due, sizes = self.schedule.order(due)
            events, cache = self.runner.events, self.e.cache  # CUDA graphs of the events (they never read back)

            def work():
                cache.event_counts = sizes  # LagKV's / Hard-KV's per-slot sizes, from the host (else None)
                try:
                    events.run(due, sizes) if events is not None else cache.compress_slots(due)
                finally:
                    cache.event_counts = None

            self.clock.time(self.e.stats["decode_steps"] + step, work)
            self.schedule.compressed(due)
        self.schedule.step(active)

    def _periodic_work(self, active: list[int]) -> int:
        """Compress the due live slots; return how many steps every live slot may take before the next."""
        start = time.perf_counter()
        cache = self.e.cache
        due = cache.due_for_compression()
        due[[s for s in range(len(self.owner)) if self.owner[s] is None]] = False
        compressed = bool(due.any())
        if compressed:
            cache.compress_slots(due.nonzero()[:, 0])
        room = cache.steps_until_due()[active]
        steps = max(1, int(room.min()))  # a host sync: the compression's GPU work is done
        if compressed:
            self._record_events([(self.e.stats["decode_steps"], time.perf_counter() - start)])
        return steps

    def _record_events(self, events: list[tuple[int, float]]) -> None:
        for step, seconds in events:
            self.e.stats["policy_seconds"] += seconds
            self.e.stats["policy_events"].append((step, seconds))

    def _compact(self, active: list[int]) -> list[int]:
        """Move live slots at or past the smallest batch that holds them into the free slots below it."""
        batch = self.runner.bucket(len(active))
        movers = [s for s in active if s >= batch]
        if not movers:
            return active
        holes = [s for s in range(batch) if self.owner[s] is None]
        for src, dst in zip(movers, holes):
            self.e.cache.move_slot(src, dst)
            self.runner.move_slots(src, dst)
            if self.schedule is not None:
                self.schedule.move(src, dst)
            self.owner[dst], self.owner[src] = self.owner[src], None
        return [s for s, c in enumerate(self.owner) if c is not None]

    def _fill_slots(self) -> None:
        for slot in range(len(self.owner)):
            while self.owner[slot] is None:  # (a sequence may finish on its first token: the slot takes the next)
                group = self._next_group()
                if group is None:
                    return
                self._start_sample(slot, group)

    def _prefill_ahead(self) -> None:
        """Prefill, in forwards of several rows (``_prefill_many``), the waiting prompts whose samples the free slots
        take now, in their order, while they are short enough to go whole (no prefill compression); a forward's
        padded tokens stay within ``PREFILL_TOKENS``. Called by ``_next_group`` when no prefilled prompt is left, so a
        prompt over the limit goes alone in its turn (the random policy's prefill draws keep their order) and the
        prompts behind it are batched at the next call."""
        free = sum(owner is None for owner in self.owner)
        queued = sum(self.n - group.next_sample for group in self.groups)
        want = -(-(free - queued) // self.n)  # prompts needed to fill the free slots
        limit = self.e.cache.prefill_limit()
        while want >= 2:
            batch, width = [], 0
            while len(batch) < want and self.waiting:
                length = len(self.prompts[self.waiting[0]])
                if length > limit or (len(batch) + 1) * max(width, length) > PREFILL_TOKENS:
                    break
                batch.append(self.waiting.popleft())
                width = max(width, length)
            if len(batch) < 2:  # nothing to batch: the one-by-one path takes it
                self.waiting.extendleft(reversed(batch))
                return
            for index, (prompt, logits) in zip(batch, self.e._prefill_many([self.prompts[i] for i in batch])):
                self._add_group(index, prompt, logits)
            want -= len(batch)

    def _add_group(self, index: int, prompt: PromptKV, logits: torch.Tensor) -> None:
        """Queue prompt ``index``'s prefill for its samples; non-finite logits are refused, naming the prompt."""
        if not torch.isfinite(logits).all():
            raise FloatingPointError(f"non-finite logits at prefill of prompt {index}; refusing to sample.")
        self.groups.append(_Group(index, prompt, logits))

    def _next_group(self) -> _Group | None:
        while self.groups and self.groups[0].next_sample >= self.n:
            self.groups.popleft()
        if not self.groups:
            if not self.waiting:
                return None
            self._prefill_ahead()  # the next prompts together, up to one over the prefill limit (it goes alone)
            if self.groups:
                return self.groups[0]
            index = self.waiting.popleft()
            self._add_group(index, *self.e._prefill(self.prompts[index]))
        return self.groups[0]

    def _start_sample(self, slot: int, group: _Group) -> None:
        sample_index = group.next_sample
        group.next_sample += 1
        ids = self.prompts[group.prompt_index]
        comp = Completion(group.prompt_index, sample_index, list(ids))
        self.results[group.prompt_index * self.n + sample_index] = comp
        self.e.cache.place(slot, group.prompt)
        if self.schedule is not None:
            self.schedule.place(slot, group.prompt.k.shape[2], group.prompt.length)
        seen = None
        if self.seen is not None:
            self.seen[slot] = False
            self.seen[slot, torch.tensor(ids, device=self.seen.device)] = True
            seen = self.seen[slot : slot + 1]
        token, logprob = sample(group.logits[None], self.sp, self.generator, seen)
        self.owner[slot] = comp
        if self._append(slot, comp, int(token[0]), float(logprob[0])):
            self.tokens[slot] = token[0]  # later tokens are written by the decode step itself
            if self.seen is not None:
                self.seen[slot, token[0]] = True

    def _append(self, slot: int, comp: Completion, token: int, logprob: float) -> bool:
        """Record one token; free the slot and return False if the sequence just finished."""
        comp.token_ids.append(token)
        comp.logprobs.append(logprob)
        self.e.stats["generated_tokens"] += 1
        if self.progress is not None:
            self.progress.update(1)
        if token in self.stop:
            comp.finish_reason = "stop"
        elif len(comp.token_ids) >= self.sp.max_new_tokens:
            comp.finish_reason = "length"
        if comp.finish_reason is not None:
            self.owner[slot] = None
            return False
        return True

    def _consume(self, hist: np.ndarray, comps: list[Completion]) -> None:
        """hist [3, steps, len(comps)] float64 (tokens, logprobs, finite): one window's columns of the live
        sequences ``comps``, read from the device in one transfer.

        Array work per window, Python work per sequence (not per token: at batch 256 a per-token loop took ~0.3 ms
        of a 13 ms step, with the device idle). Each sequence takes its tokens up to the first stop token or its
        ``max_new_tokens``, and is marked finished there (the caller frees its slot); a non-finite step among those
        raises, the earliest step first, then the first sequence (before any of the window's tokens is
        recorded)."""
        steps = hist.shape[1]
        if not comps or not steps:
            return
        tokens = hist[0].astype(np.int64)  # [steps, sequences]
        left = np.asarray([self.sp.max_new_tokens - len(c.token_ids) for c in comps])
        assert (left >= steps).all(), (left, steps)  # a window never runs past a live sequence's max_new_tokens
        stops = np.isin(tokens, self.stop_ids)  # all False for no stop ids
        first_stop = np.where(stops.any(axis=0), stops.argmax(axis=0), steps)
        end = np.minimum(first_stop + 1, steps)  # tokens each sequence takes from this window (left >= steps)
        bad = (hist[2] == 0) & (np.arange(steps)[:, None] < end[None, :])
        if bad.any():
            step, j = np.argwhere(bad)[0]  # row-major: the earliest step, then the first sequence
            comp = comps[j]
            raise FloatingPointError(
                f"non-finite logits at decode step {len(comp.token_ids) + int(step)} of prompt {comp.prompt_index} "
                f"sample {comp.sample_index}; refusing to sample from NaN/inf.")
        token_rows, logprob_rows = tokens.T.tolist(), hist[1].T.tolist()  # [sequences][steps] Python lists
        for comp, n, stop, room, toks, lps in zip(comps, end.tolist(), first_stop.tolist(), left.tolist(),
                                                  token_rows, logprob_rows):
            comp.token_ids.extend(toks[:n])
            comp.logprobs.extend(lps[:n])
            if stop < n:
                comp.finish_reason = "stop"
            elif n >= room:
                comp.finish_reason = "length"
        taken = int(end.sum())
        self.e.stats["generated_tokens"] += taken
        if self.progress is not None:
            self.progress.update(taken)


class _Buffers:
    """One decode window's step history on the device [window, 3, max_batch] float64 (token, logprob, finite of
    each step, written by the steps; a window's rows are one contiguous block) and, on a GPU, a pinned host copy
    that ``read`` fills asynchronously."""

    def __init__(self, window: int, max_batch: int, device: torch.device):
        self.device = torch.empty(window, 3, max_batch, dtype=torch.float64, device=device)
        self.host = torch.empty(self.device.shape, dtype=torch.float64, pin_memory=True) \
            if device.type == "cuda" else None

    def read(self, steps: int):
        """Queue the copy of the first ``steps`` rows; returns what ``_Window.wait`` needs."""
        if self.host is None:  # CPU: the work is done (the buffer is written again only after this window is read)
            return self.device[:steps].numpy(), None
        self.host[:steps].copy_(self.device[:steps], non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return self.host[:steps].numpy(), done


@dataclass
class _Window:
    """A queued decode window: its live slots at launch (the history's columns), their sequences, its steps, its
    host read (the array and the CUDA event after which it holds the window), and the number of compression events
    recorded up to its end."""
    slots: list[int]
    comps: list[Completion]
    steps: int
    read: tuple
    events: int

    def wait(self) -> np.ndarray:
        array, done = self.read
        if done is not None:
            done.synchronize()
        return array


def _eos_ids(model, tokenizer) -> tuple[int, ...]:
    ids = []
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for source in (gen_eos, getattr(model.config, "eos_token_id", None),
                   getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None):
        if source is None:
            continue
        ids.extend(source if isinstance(source, (list, tuple)) else [source])
    return tuple(dict.fromkeys(int(i) for i in ids))
