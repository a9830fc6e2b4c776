"""The rollout backend TRL's GRPO/RLOO trainers call, duck-typing TRL 1.16's ``VLLMGeneration``.

    generation = KVRollGeneration(trainer, compression)
    generation.sync_weights()                                   # TRL calls it when global_step changed
    prompt_ids, completion_ids, logprobs, _ = generation.generate(prompts=rows, images=None, num_generations=G)

``rows`` are this rank's prompt token ids, each prompt repeated G times in a row (a group may straddle ranks).
``generate`` gathers the rows of all ranks, cuts them into groups of identical consecutive prompts, generates each
group once (``engine.generate(n=G)``) and returns this rank exactly its own rows, in order, with the per-token
rollout logprobs (``[rows][tokens][1]``). In colocate mode the groups are shared out across the ranks' engines;
in ray mode (``kvroll_mode="ray"``) rank 0 hands them all to the Ray rollout pool (``ray_rollouts.py``) and
broadcasts the completions.
"""
from __future__ import annotations

import dataclasses
import time
import warnings
from contextlib import nullcontext

from kvroll.config import CompressionConfig
from kvroll.rollout.cache import prefill_limit
from kvroll.rollout.engine import RolloutEngine
from kvroll.rollout.model import DTYPES
from kvroll.rollout.sampling import SamplingParams
from kvroll.rollout.sources import check_mergeable
from kvroll.rollout.weight_sync import SYNC_PHASES
from kvroll.trainers.args import sampling_settings
from kvroll.trainers.colocate import ColocatedWeights
from kvroll.trainers.metrics import StepTimer, kv_bytes_per_token, rollout_metrics



class KVRollGeneration:
    """What TRL's trainers see as ``trainer.vllm_generation`` when ``use_kvroll=True`` (colocate mode)."""

    def __init__(self, trainer, compression: CompressionConfig):
        self.trainer, self.args, self.compression = trainer, trainer.args, compression
        self.accelerator = trainer.accelerator
        # an adapter the engine cannot merge (DoRA, lora_bias, ...) is refused now, not at the first rollout
        check_mergeable(self.accelerator.unwrap_model(trainer.model))
        self.rank, self.world = self.accelerator.process_index, self.accelerator.num_processes
        self.weights: ColocatedWeights | None = None
        self.engine: RolloutEngine | None = None
        self.calls = 0
        self.capped_at_positions = False  # the warning below, once
        config = getattr(self.accelerator.unwrap_model(trainer.model), "config", None)
        self.max_positions = getattr(config, "max_position_embeddings", None)  # where 'full' stops (_sampling_for)
        self.last_sync: dict[str, float] = {}
        self.sync_version = 0  # colocated weight versions (Ray workers keep their own)
        self.step_rollout_seconds = 0.0  # rollout time in the current optimizer step (StepTimer reads it)
        self.last_logprobs: list[list[list[float]]] | None = None  # this rank's rows of the last generate call
        self.capacity = self.prompt_keep = None  # full: unbounded, prompts kept whole
        if compression.policy != "full":
            policy = compression.build()
            self.capacity = policy.capacity(compression.budget, 0)
            self.prompt_keep = prefill_limit(policy, compression.budget, self.capacity)
        self.ray = None
        if self.args.kvroll_mode == "ray":
            from kvroll.trainers.ray_rollouts import RayRollouts

            self.ray = RayRollouts(trainer, compression)
        # GRPO's tools / environments on several processes (colocate): TRL's tool loop calls generate() again only on
        # the ranks with tool calls, so a collective generate() would leave the others' gathers unmatched; each rank
        # then generates its own rows with its own engine (a group straddling two ranks is prefilled on both)
        self.local = self.ray is None and self.world > 1 and bool(
            getattr(trainer, "tools", None) or getattr(trainer, "environment_factories", None))
        if hasattr(trainer, "add_callback"):
            trainer.add_callback(StepTimer(self))  # kvroll/rollout_share

    # ---- the TRL surface ---------------------------------------------------------------------------------------
    def sync_weights(self) -> None:
        """Bring the engine's weights to the trainer's (every rank must call it; TRL does, once per step)."""
        if self.ray is not None:
            self.last_sync = self.ray.sync()
            if self.rank == 0:
                for key in ("seconds", "bytes", "gb_per_s", "version", "resent_buckets"):
                    self._log(f"kvroll/sync_{key}", self.last_sync[key])
                for key in SYNC_PHASES:  # where rank 0's send time went (weight_sync.SendTimes)
                    if key in self.last_sync:
                        self._log(f"kvroll/sync_{key}", self.last_sync[key])
            return
        if self.weights is None:
            self._build()  # building syncs
        else:
            self.last_sync = self.weights.sync()
        self.sync_version += 1
        seconds, nbytes = self.last_sync["seconds"], self.last_sync["bytes"]
        self._log("kvroll/sync_seconds", seconds)
        self._log("kvroll/sync_copied_tensors", self.last_sync["copied"])
        self._log("kvroll/sync_bytes", nbytes)  # 0 when the engine shares the trainer's storage
        self._log("kvroll/sync_gb_per_s", nbytes / max(seconds, 1e-9) / 1e9)
        self._log("kvroll/sync_version", self.sync_version)

    def generate(self, prompts, images=None, num_generations: int = 1, profiler=None):
        """Returns (prompt_ids, completion_ids, logprobs [rows][tokens][1], None) for this rank's rows."""
        if images is not None and any(image is not None for image in images):
            raise ValueError("use_kvroll=True does not support multimodal (image) prompts yet; set use_kvroll=False.")
        if self.engine is None and self.ray is None:
            self._build()
        prompts = [list(map(int, p)) for p in prompts]
        counts = [len(prompts)] if self.local else self._gather([len(prompts)])
        all_rows = prompts if self.local else self._gather(prompts)
        chunks = _group_chunks(all_rows, num_generations)
        start = time.perf_counter()
        with profiler or nullcontext():
            if self.ray is not None:
                everything = self._run_ray(all_rows, chunks)
            elif self.local:  # no collective: this rank's rows on this rank's engine
                everything = self._run(all_rows, chunks, list(range(len(chunks))))
            else:
                results = self._run(all_rows, chunks, _share(chunks, self.world)[self.rank])
                everything = self._gather(results)  # [(row, token_ids, logprobs)] of all ranks
        elapsed = time.perf_counter() - start
        by_row = {row: (ids, lps) for row, ids, lps in everything}
        first = 0 if self.local else sum(counts[: self.rank])
        rows = range(first, first + len(prompts))
        completion_ids = [by_row[r][0] for r in rows]
        logprobs = [[[lp] for lp in by_row[r][1]] for r in rows]
        self._log_rollout(everything, elapsed, [len(all_rows[row]) for row, _, _ in everything])
        self.last_logprobs = logprobs  # RLOO's kvroll_correction reads them (TRL's RLOO drops what it is returned)
        return prompts, completion_ids, logprobs, None

    # ---- internals ---------------------------------------------------------------------------------------------
    def _build(self) -> None:
        train_model = self.accelerator.unwrap_model(self.trainer.model)
        dtype = DTYPES.get(self.args.kvroll_dtype)
        self.weights = ColocatedWeights(train_model, dtype=dtype, device=self.accelerator.device)
        self.last_sync = self.weights.first_sync
        max_batch = self.args.kvroll_max_batch or self._rows_per_call()
        self.engine = RolloutEngine(self.weights.engine_model, compression=self.compression, max_batch=max_batch,
                                    tokenizer=getattr(self.trainer, "_tokenizer", None))

    def _rows_per_call(self) -> int:
        steps = getattr(self.args, "steps_per_generation", None) or 1
        return max(1, self.args.per_device_train_batch_size * steps)

    def _run(self, all_rows, chunks, mine) -> list[tuple[int, list[int], list[float]]]:
        """Generate this rank's chunks; returns (global row, token ids, logprobs) per row."""
        out = []
        groups: dict[tuple[int, int], tuple[SamplingParams, list[tuple[int, int]]]] = {}
        for start, size in (chunks[i] for i in mine):
            sampling = self._sampling_for(size, len(all_rows[start]))
            groups.setdefault((size, sampling.max_new_tokens), (sampling, []))[1].append((start, size))
        for (size, _), (sampling, group) in sorted(groups.items(), key=lambda item: item[0]):
            completions = self.engine.generate([all_rows[start] for start, _ in group], sampling, n=size)
            for index, completion in enumerate(completions):
                start = group[index // size][0]
                out.append((start + index % size, completion.token_ids, completion.logprobs))
        self.calls += 1
        return out

    def _sampling_for(self, size: int, length: int) -> SamplingParams:
        """The sampling of a chunk of ``size`` rows whose prompt has ``length`` tokens. Under 'full' its new tokens
        stop at the model's last position, as vLLM stops a request at max_model_len: TRL's tool loop re-sends the
        conversation so far (prompt + completion + tool result, under max_position_embeddings) and keeps at most
        max_completion_length tokens over all turns, so the cap cuts nothing it keeps (the engine refused prompt +
        max_new_tokens past the positions, and training stopped). Compressing policies run past the positions (the
        engine warns); a prompt at or past them is the engine's error."""
        sampling = self._sampling(seed_offset=size)
        limit = self.max_positions
        if self.compression.policy != "full" or limit is None or length >= limit \
                or limit - length >= sampling.max_new_tokens:
            return sampling
        if not self.capped_at_positions:  # said once: a tool turn's conversation, or a prompt this long
            self.capped_at_positions = True
            warnings.warn(f"kvroll: under 'full' rows of {length} tokens get at most {limit - length} new tokens "
                          f"(not max_completion_length={sampling.max_new_tokens}): the model's "
                          f"max_position_embeddings={limit} ends them.", stacklevel=3)
        room = limit - length  # a request of its own, so a seed of its own (the same one would repeat the draws)
        return dataclasses.replace(self._sampling(seed_offset=size + (room + 1) * 1_000_037), max_new_tokens=room)

    def _run_ray(self, all_rows, chunks) -> list[tuple[int, list[int], list[float]]]:
        """Rank 0 generates every chunk in the Ray pool; every rank gets all rows back."""
        results = None
        if self.rank == 0:
            rows = self.ray.run(all_rows, chunks, self._sampling_for)
            results = [(row, ids, lps) for row, (ids, lps) in sorted(rows.items())]
        self.calls += 1
        if self.world == 1:
            return results
        from accelerate.utils import broadcast_object_list

        message = [results]
        broadcast_object_list(message, from_process=0)
        return message[0]

    def _sampling(self, seed_offset: int) -> SamplingParams:
        s = {name: value for name, (value, _) in sampling_settings(self.args).items()}  # checked at config time
        stop = s["stop_token_ids"] if s["ignore_eos"] else tuple(self.trainer.eos_token_ids) + s["stop_token_ids"]
        return SamplingParams(  # TRL's EOS ids, not the engine's
            max_new_tokens=min(s["max_new_tokens"], self.args.max_completion_length), temperature=s["temperature"],
            top_p=s["top_p"], top_k=s["top_k"], min_p=s["min_p"], repetition_penalty=s["repetition_penalty"],
            stop_token_ids=stop, ignore_eos=s["ignore_eos"],
            seed=_mix_seed(s["seed"], self.calls, self.rank, seed_offset),
            logprobs_mode="processed")  # TRL's vLLM backend's processed logprobs: what its IS correction expects

    def _gather(self, items: list) -> list:
        if self.world == 1:
            return list(items)
        from accelerate.utils import gather_object

        return gather_object(list(items))

    def _log(self, name: str, value: float) -> None:
        metrics = getattr(self.trainer, "_metrics", None)
        if metrics is not None:
            mode = "train" if self.trainer.model.training else "eval"
            metrics[mode][name].append(float(value))

    def _log_rollout(self, everything, seconds: float, prompt_lengths: list[int]) -> None:
        """Time, tokens/s, lengths and the KV accounting of every rank's rows (``metrics.py``), the caches."""
        tokens = sum(len(ids) for _, ids, _ in everything)
        self.step_rollout_seconds += seconds
        self._log("kvroll/rollout_seconds", seconds)
        self._log("kvroll/rollout_tokens_per_second", tokens / max(seconds, 1e-9))
        if self.compression.budget is not None:  # None for full
            self._log("kvroll/budget", self.compression.budget)
        sampling = self._sampling(seed_offset=0)
        dtype = self.weights.dtype if self.weights is not None else self.ray._dtype()
        per_token = kv_bytes_per_token(self.accelerator.unwrap_model(self.trainer.model).config, dtype)
        stats = rollout_metrics(prompt_lengths, [ids for _, ids, _ in everything], sampling.max_new_tokens,
                                sampling.stop_token_ids, self.capacity, per_token, self.prompt_keep)
        for name, value in stats.items():
            self._log(name, value)
        if self.ray is not None:
            if self.rank == 0:
                self._log("kvroll/kv_cache_mib", self.ray.kv_cache_bytes() / 2**20)
                self._log("kvroll/worker_restarts", self.ray.restarts())
            return
        self._log("kvroll/kv_cache_mib", self.engine.kv_cache_bytes() / 2**20)


def _group_chunks(rows: list[list[int]], size: int) -> list[tuple[int, int]]:
    """Cut rows into (start, length) chunks of identical consecutive prompts, at most ``size`` long each."""
    chunks, start = [], 0
    while start < len(rows):
        end = start + 1
        while end < len(rows) and end - start < size and rows[end] == rows[start]:
            end += 1
        chunks.append((start, end - start))
        start = end
    return chunks


def _share(chunks: list[tuple[int, int]], world: int) -> list[list[int]]:
    """Chunk indices per rank: contiguous, balanced by row count, whole chunks only."""
    total = sum(size for _, size in chunks)
    shares: list[list[int]] = [[] for _ in range(world)]
    done = 0
    for index, (_, size) in enumerate(chunks):
        rank = min(world - 1, done * world // max(total, 1))
        shares[rank].append(index)
        done += size
    return shares


def _mix_seed(seed: int, call: int, rank: int, salt: int) -> int:
    """A distinct, reproducible seed per (config seed, generation call, rank, chunk size)."""
    value = (seed * 1_000_003 + call) * 1_000_033 + rank * 7_919 + salt
    return value % (1 << 62)
