"""RolloutWorker: one RolloutEngine on its own device, fed its weights by the sync; Ray-free (the pool wraps it).

    worker = RolloutWorker(model_config.to_dict(), CompressionConfig("rkv", 1024), max_batch=64)
    worker.set_plan(plan)                                   # names/shapes/dtypes, once
    worker.join_group(host, port, rank=1, world=2, backend="gloo", generation=1)
    sums = worker.receive(version=1, indices=[0, 1, 2])   # verified in-stream; the last bucket makes version 1
    completions = worker.generate(prompts, SamplingParams(...), n=8, min_version=1)

The model is built from its config on the meta device and given empty tensors on the worker's device, so a worker
on another node needs no copy of the model files: every parameter and buffer arrives through the sync (a
broadcast, or ``load_bucket`` from the object store for a worker restarted mid-rollout). A worker generates only
with verified weights at least as new as the caller's version (``StaleWeightsError`` otherwise), and records that
version on each completion. ``inject_fault`` is a test hook (crash mid-rollout, hang, corrupt a received bucket).
"""
from __future__ import annotations

import os
import time

import torch

from kvroll.config import CompressionConfig
from kvroll.kernels.fusions import SWITCHES
from kvroll.rollout.engine import Completion, RolloutEngine
from kvroll.rollout.model import DTYPES
from kvroll.rollout.sampling import SamplingParams
from kvroll.rollout.weight_sync import SyncGroup, receive_buckets, wait_device
from kvroll.rollout.weights import BucketPlan, bucket_checksum



class StaleWeightsError(RuntimeError):
    """A worker was asked to generate with weights older than the trainer's."""


class RolloutWorker:
    """One engine and its side of the weight sync (see module doc); ``ray.remote`` wraps it in the pool."""

    def __init__(self, model_config: dict, compression: CompressionConfig, max_batch: int = 16,
                 dtype: str = "bfloat16", device: str | None = None, generation_config: dict | None = None,
                 engine_options: dict | None = None, name: str = "worker"):
        from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

        self.name = name
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device.index or 0)
        if self.device.type == "cpu" and os.environ.get("OMP_NUM_THREADS"):
            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        config = dict(model_config)
        config = AutoConfig.for_model(config.pop("model_type"), **config)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype])
        model.to_empty(device=self.device)
        model.tie_weights()  # to_empty unties shared parameters
        if generation_config:
            model.generation_config = GenerationConfig.from_dict(generation_config)
        self.model = model.eval()
        self.engine = RolloutEngine(self.model, compression=compression, max_batch=max_batch,
                                    **(engine_options or {}))  # cuda_graphs, sync_every, the fusion switches
        self.targets = {**dict(self.model.named_parameters()), **dict(self.model.named_buffers())}
        self.plan: BucketPlan | None = None
        self.group: SyncGroup | None = None
        self._version = -1  # no verified weights yet
        self._receiving: int | None = None
        self._verified: set[int] = set()  # buckets of the version being received that arrived intact
        self._faults: dict[str, dict] = {}
        self.counters = {"generate_calls": 0, "generated_tokens": 0, "generate_seconds": 0.0, "syncs": 0,
                         "sync_seconds": 0.0, "received_bytes": 0}

    # ---- weight sync ---------------------------------------------------------------------------------------
    def set_plan(self, plan: BucketPlan) -> None:
        """Take the trainer's bucket plan (names, shapes, dtypes); refused unless it fills every tensor we hold."""
        missing = [n for n in plan.names() if n not in self.targets]
        if missing:
            raise ValueError(f"{self.name}: the trainer sends {missing[:3]} which this worker's model lacks; both "
                             "sides must build the same architecture.")
        # the model was built on empty memory: a tensor no bucket fills would generate from whatever it held
        unsent = sorted(set(self.targets) - set(plan.names()))
        if unsent:
            raise ValueError(f"{self.name}: this worker's model has {unsent[:3]}{' ...' if len(unsent) > 3 else ''} "
                             f"({len(unsent)} tensors) which the trainer does not send; both sides must build the "
                             "same architecture.")
        self.plan = plan

    def join_group(self, host: str, port: int, rank: int, world: int, backend: str, generation: int,
                   timeout_s: float = 600.0) -> int:
        """Join formation ``generation`` of the sync group (blocks until every party has joined)."""
        if self.group is not None:
            self.group.close()
        self.group = None
        self.group = SyncGroup(host, port, rank, world, backend, generation, timeout_s)
        return rank

    def begin_sync(self, version: int) -> None:
        """From here until every bucket of ``version`` verified the weights are in flux: no generation."""
        self._receiving, self._version, self._verified = version, -1, set()

    def receive(self, version: int, indices: list[int]) -> dict[int, tuple[int, int] | None]:
        """Receive buckets of ``version`` from the group's broadcast into the model; returns their checksums.

        Each bucket is checked against the checksum it carries; once every bucket of the plan has arrived intact
        (resends included) the worker holds ``version`` and may generate with it. A bucket that failed that check
        is returned as ``None`` (the pool resends it), even where its bytes match the sender's (a damaged trailer):
        the pool and this worker must agree on which buckets still need resending.
        """
        if self.group is None or self.plan is None:
            raise RuntimeError(f"{self.name}: receive() before set_plan/join_group.")
        resend = self._receiving != version and self._version == version
        if resend:  # buckets another worker got damaged, sent to all: this one holds ``version`` whole already
            self._receiving, self._version, self._verified = version, -1, set(range(len(self.plan)))
        elif self._receiving != version:
            self.begin_sync(version)
        start = time.perf_counter()
        sums = receive_buckets(self.group, self.plan, indices, self.targets, self.device, self._tamper)
        for index, (got, sent) in sums.items():
            (self._verified.add if got == sent else self._verified.discard)(index)
        if len(self._verified) == len(self.plan):
            self._version, self._receiving = version, None
            self.counters["syncs"] += not resend  # a version counted once
        self.counters["sync_seconds"] += time.perf_counter() - start
        self.counters["received_bytes"] += sum(self.plan.sizes[i] for i in indices)
        return {index: got if got == sent else None for index, (got, sent) in sums.items()}

    def load_bucket(self, index: int, data) -> tuple[int, int]:
        """Load one bucket given as bytes (a uint8 tensor or buffer, e.g. from Ray's object store)."""
        buffer = torch.as_tensor(data, dtype=torch.uint8).to(self.device)
        self._tamper(index, buffer)
        self.plan.unpack(index, buffer, self.targets)
        return bucket_checksum(buffer)

    def probe(self, nbytes: int, repeats: int) -> int:
        """Receive ``repeats`` raw broadcasts of ``nbytes`` (the pool's bandwidth probe of the sync group)."""
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device if self.group.backend == "nccl" else "cpu")
        self.group.connect(self.device)  # NCCL's set-up, given up when rank 0 aborts the formation (a peer died)
        for _ in range(repeats):
            self.group.broadcast(buffer).wait()
        if self.device.type == "cuda" and self.group.backend == "nccl":
            wait_device(self.group, self.device)  # gives up when rank 0 aborts the formation (a peer died)
        return repeats

    def finish_sync(self, version: int) -> int:
        """Mark ``version`` verified (the caller compared the checksums); the worker may generate with it now."""
        if self._receiving != version:
            raise RuntimeError(f"{self.name}: finish_sync({version}) without begin_sync({version}).")
        self._version, self._receiving = version, None
        self.counters["syncs"] += 1
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return version

    def version(self) -> int:
        """The weight version this worker holds (0: its initial weights)."""
        return self._version

    def checksum(self) -> list[tuple[int, int]]:
        """Per-bucket checksums of the weights this worker holds, packed as the sync packs them."""
        return self.plan.checksums(self.model, self.device)

    # ---- generation ----------------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], sampling: SamplingParams, n: int = 1,
                 min_version: int = 0) -> list[Completion]:
        """The engine's ``generate`` on this worker's shard, each completion tagged with the weight version; a
        ``StaleWeightsError`` when the worker holds an older version than ``min_version``."""
        if self._version < min_version:
            raise StaleWeightsError(f"{self.name} holds weight version {self._version}, the trainer's is "
                                    f"{min_version}; sync the weights before generating.")
        hang = self._faults.pop("hang", None)
        if hang:
            time.sleep(hang["seconds"])
        progress = _CrashAfter(self._faults.pop("crash", {}).get("tokens")) if "crash" in self._faults else None
        start = time.perf_counter()
        results = self.engine.generate(prompts, sampling, n=n, progress=progress)
        self.counters["generate_seconds"] += time.perf_counter() - start
        self.counters["generate_calls"] += 1
        self.counters["generated_tokens"] += sum(len(c.token_ids) for c in results)
        for completion in results:
            completion.weight_version = self._version
        return results

    def metrics(self) -> dict:
        """Counters since the worker started: generate calls, seconds, tokens, tokens/s, KV bytes, version."""
        counters = dict(self.counters)
        counters["tokens_per_second"] = counters["generated_tokens"] / max(counters["generate_seconds"], 1e-9)
        counters["kv_cache_bytes"] = self.engine.kv_cache_bytes()
        counters["version"] = self._version
        return counters

    def health(self) -> dict:
        """Name, pid, Ray node, weight version, device and the engine's resolved options (``RolloutPool.health``)."""
        node = None
        try:
            import ray

            node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        except ImportError:
            pass
        engine = self.engine
        options = {"sync_every": engine.sync_every, "cuda_graphs": engine.cuda_graphs,
                   **{name: getattr(engine, name) for name in SWITCHES}}
        return {"name": self.name, "pid": os.getpid(), "node": node, "version": self._version,
                "device": str(self.device), "engine": options}

    # ---- test hooks ------------------------------------------------------------------------------------------
    def inject_fault(self, kind: str, **kwargs) -> None:
        """Test hook: 'crash' (exit after ``tokens`` generated tokens), 'hang' (sleep ``seconds`` before the next
        generate), 'corrupt' (flip a byte of bucket ``index`` in the next ``times`` receptions)."""
        if kind not in ("crash", "hang", "corrupt"):
            raise ValueError(f"inject_fault: kind={kind!r} is not one of 'crash', 'hang', 'corrupt'.")
        self._faults[kind] = kwargs

    def _tamper(self, index: int, buffer: torch.Tensor) -> None:
        fault = self._faults.get("corrupt")
        if fault and fault.get("index") == index and fault.get("times", 1) > 0:
            buffer[len(buffer) // 2] ^= 0x5A
            fault["times"] = fault.get("times", 1) - 1


class _CrashAfter:
    """A progress object that ends the process (as a crash would) after ``tokens`` generated tokens."""

    def __init__(self, tokens: int | None):
        self.left = tokens or 1

    def update(self, count: int) -> None:
        self.left -= count
        if self.left <= 0:
            os._exit(17)
