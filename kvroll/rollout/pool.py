"""RolloutPool: rollout workers in Ray actors on their own GPUs and nodes, fed versioned, verified weights.

    pool = RolloutPool("smollm2", compression=CompressionConfig(policy="rkv", budget=1024), num_workers=2)
    results = pool.generate(prompt_ids, SamplingParams(max_new_tokens=512, seed=0), n=8)  # as RolloutEngine.generate
    request = pool.submit(prompt_ids, sampling, n=8); ...; results = request.result()      # non-blocking underneath
    pool.update_weights(model)                                      # version + 1, every bucket checksum-verified
    pool.metrics(); pool.last_sync                                  # per worker; seconds, bytes, GB/s, version
    pool.health()                                                   # per worker: node, device, engine options
    pool.close()

``model`` is ``"smollm2"``, a local HF directory or an ``nn.Module`` (its weights are pushed at start; workers
build the architecture from the config and need no model files), or a ``PretrainedConfig`` (no weights until the
first ``update_weights``; ``initial_sync=False`` defers a module's first push the same way, as the trainers do).
Prompts are sharded by whole groups, balanced by rows, one shard per worker; shard k's
seed is derived from ``sampling.seed`` and k, so the same seed and worker count give the same completions.

Faults: a worker that dies mid-rollout, or outlives ``worker_timeout_s`` (it is killed), is replaced in its
placement-group bundle, given the current weights through the object store and verified, and its shard runs again:
every row comes back once, in order. A sync whose bucket does not verify resends that bucket (``sync_retries``);
a sync that fails outright re-forms the group and starts over; both end in ``WeightSyncError``, never a skip.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from kvroll.checks import as_int, plain
from kvroll.config import CompressionConfig
from kvroll.kernels.fusions import SWITCHES, check_fusions
from kvroll.kernels.sample import check_sampler_device
from kvroll.rollout import cluster
from kvroll.rollout.engine import Completion
from kvroll.rollout.model import DTYPES, check_budget_fits, check_cuda_graphs, check_sync_every
from kvroll.rollout.requests import validate_request
from kvroll.rollout.sampling import SamplingParams
from kvroll.rollout.shards import RefreshError, RolloutRequest, Shard, shard_seed, split_prompts
from kvroll.rollout.weight_sync import SyncGroup, open_store, send_buckets, wait_device
from kvroll.rollout.weights import BucketPlan, bucket_checksum
from kvroll.rollout.worker import RolloutWorker

_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class WeightSyncError(RuntimeError):
    """A weight sync that could not be completed and verified within its retries."""


@dataclass
class _Slot:
    """One placement-group bundle and the actor living in it now."""

    actor: object
    version: int = -1  # the verified weight version it holds (-1: none, or in flux)
    restarts: int = 0
    queued: dict = field(default_factory=dict)  # generate calls sent to the actor: ref -> deadline


class RolloutPool:
    """Rollout workers in a Ray placement group (see module doc)."""

    def __init__(self, model="smollm2", compression: CompressionConfig | None = None, num_workers: int = 1,
                 gpus_per_worker: float | None = None, max_batch: int = 16, dtype: torch.dtype | str | None = None,
                 ray_address: str | None = None, worker_timeout_s: float = 600.0, bucket_bytes: int = 1 << 30,
                 placement_strategy: str = "PACK", backend: str | None = None, connect_timeout_s: float = 30.0,
                 sync_retries: int = 3, max_task_retries: int = 3, cuda_graphs: bool | None = None,
                 initial_sync: bool = True, sync_every: int | None = None, fused_mlp: bool | None = None,
                 fused_qkv_rotary: bool | None = None, fused_add_norm: bool | None = None,
                 fused_sampling: bool | None = None):
        _check_args(num_workers, gpus_per_worker, max_batch, worker_timeout_s, bucket_bytes, placement_strategy,
                    backend, sync_retries, max_task_retries, connect_timeout_s)
        # numpy integers are taken, as Python ints: they go to the Ray workers
        num_workers, max_batch, bucket_bytes, sync_retries, max_task_retries = (
            as_int(v) for v in (num_workers, max_batch, bucket_bytes, sync_retries, max_task_retries))
        worker_timeout_s, connect_timeout_s = plain(worker_timeout_s), plain(connect_timeout_s)
        sync_every = check_sync_every(sync_every, "RolloutPool")  # the workers' engines would say the same, later
        engine_options = dict(cuda_graphs=cuda_graphs, sync_every=sync_every, fused_mlp=fused_mlp,
                              fused_qkv_rotary=fused_qkv_rotary, fused_add_norm=fused_add_norm,
                              fused_sampling=fused_sampling)
        check_cuda_graphs(cuda_graphs, "RolloutPool")
        if cuda_graphs and gpus_per_worker is not None and gpus_per_worker == 0:
            raise ValueError("RolloutPool.cuda_graphs=True needs workers on GPUs (gpus_per_worker=0 runs them on CPU); "
                             "leave cuda_graphs=None.")
        check_fusions({name: engine_options[name] for name in SWITCHES}, "RolloutPool")
        _dtype(dtype, None, 0.0)  # a bad dtype is refused before the cluster is reached or reserved
        if gpus_per_worker is not None:  # the workers' device is known: the fused sampler's too (else after joining)
            check_sampler_device(fused_sampling, "cuda" if gpus_per_worker > 0 else "cpu", "RolloutPool")
        compression = compression or CompressionConfig("full")
        if not isinstance(compression, CompressionConfig):
            raise ValueError(f"RolloutPool.compression={compression!r} must be a kvroll.CompressionConfig.")
        config, source = _model_config(model)
        check_budget_fits(config, compression)  # the workers' engines would refuse it, after Ray and a restart
        generation_config = getattr(source, "generation_config", None)
        # the workers' engines check prompts against these too; the pool checks first, before any worker runs
        self.vocab_size = config.vocab_size
        self.max_positions = getattr(config, "max_position_embeddings", None) or (1 << 62)
        import ray

        cluster.connect(ray_address, timeout_s=connect_timeout_s)
        if gpus_per_worker is None:
            gpus_per_worker = 1.0 if ray.cluster_resources().get("GPU", 0) >= num_workers else 0.0
        self.num_workers, self.gpus_per_worker, self.timeout_s = num_workers, float(gpus_per_worker), worker_timeout_s
        self.start_timeout_s = max(worker_timeout_s, 180.0)  # a fresh actor imports torch and builds its model
        self.sync_retries, self.max_task_retries, self.bucket_bytes = sync_retries, max_task_retries, bucket_bytes
        dtype = _dtype(dtype, config, self.gpus_per_worker)
        self.dtype = dtype
        self.backend = backend or ("nccl" if self.gpus_per_worker > 0 and torch.cuda.is_available() else "gloo")
        device = "cuda" if self.gpus_per_worker > 0 else "cpu"
        check_sampler_device(fused_sampling, device, "RolloutPool")  # before any GPU is reserved or worker started
        self.placement = cluster.reserve(num_workers, self.gpus_per_worker, placement_strategy, connect_timeout_s)
        self._worker_args = (config.to_dict(), compression, max_batch, _DTYPE_NAMES[dtype], device,
                             generation_config.to_dict() if generation_config is not None else None, engine_options)
        self._remote = ray.remote(RolloutWorker)
        self.slots = []
        self._closed = False
        self.version, self.plan, self.source = 0, None, None
        self._store = self._group = None
        self._attempt_refs: list = []  # the workers' receive calls of the last sync attempt
        self.verified_sums: dict[int, tuple[int, int]] = {}  # per bucket: the checksums of version self.version
        self._generation = 0
        self.last_sync: dict = {}
        self._sync_failure: str | None = None  # the last update_weights' failure, until one succeeds
        try:
            self.slots = [_Slot(self._spawn(i)) for i in range(num_workers)]
            self.source = source
            if source is not None and initial_sync:
                self.update_weights(source)
        except BaseException:
            try:
                self.close()  # the actors and the placement group would otherwise hold the cluster's resources
            except Exception:  # noqa: BLE001 (Ray itself gone, say): the original error is the one to see
                pass
            raise

    # ---- generation ------------------------------------------------------------------------------------------
    def generate(self, prompt_token_ids, sampling: SamplingParams | None = None, n: int = 1) -> list[Completion]:
        """``len(prompts) * n`` Completions in input order, as ``RolloutEngine.generate`` returns them."""
        return self.submit(prompt_token_ids, sampling, n).result()

    def submit(self, prompt_token_ids, sampling: SamplingParams | None = None, n: int = 1) -> RolloutRequest:
        """Start generating; returns a request whose ``result()`` waits (Ray object refs underneath)."""
        sampling = sampling if sampling is not None else SamplingParams()
        prompts = validate_request(prompt_token_ids, sampling, n, self.vocab_size, self.max_positions)
        n = int(n)  # a numpy integer is taken, as a Python int (it travels to the workers)
        self._check_open("submit")
        if self.version < 1:
            raise RuntimeError("RolloutPool has no weights yet: call update_weights(model) first (a pool built "
                               "from a config receives every weight through the sync).")
        if self._sync_failure:  # refresh() would load the *new* weights under the old version
            raise WeightSyncError(f"RolloutPool: the last {self._sync_failure}; the workers hold no verified weights. "
                                  "Call update_weights(model) again before generating.")
        current = [i for i, s in enumerate(self.slots) if s.version == self.version] or [0]
        shards = [Shard(start, prompts[start:end], shard_seed(sampling.seed, k))
                  for k, (start, end) in enumerate(split_prompts(len(prompts), len(self.slots)))]
        request = RolloutRequest(self, shards, sampling, n, len(prompts))
        for k, shard in enumerate(shards):
            request.launch(shard, current[k % len(current)] if self.slots[k].version != self.version else k)
        return request

    # ---- weights ---------------------------------------------------------------------------------------------
    def update_weights(self, model=None, agree=None, fetch=None) -> dict:
        """Send ``model``'s weights to every worker as version ``self.version + 1`` and verify them.

        ``fetch(index)`` overrides how bucket tensors are obtained and ``agree(indices)`` is called with each
        attempt's bucket list (then ``[]``) so that other trainer ranks can take part in ZeRO-3 gathers.
        """
        self._check_open("update_weights")
        model = model if model is not None else self.source
        if model is None:
            raise ValueError("update_weights: pass the model whose weights the workers should get.")
        self.source = model
        if self.plan is None:
            self.plan = BucketPlan.for_model(model, self.dtype, self.bucket_bytes)
            try:
                self._set_plan_everywhere()
            except BaseException:  # refused (another architecture): the next call plans its own model again
                self.plan = None
                raise
        fetch = fetch or self.plan.fetcher(model)
        device = _param_device(model) if self.backend == "nccl" else torch.device("cpu")
        version = self.version + 1
        start = time.perf_counter()
        try:
            stats = self._sync(version, fetch, device, agree or (lambda indices: None))
        except Exception as err:
            for slot in self.slots:  # their weights are in flux: no rollout until a sync succeeds
                slot.version = -1
            self._sync_failure = f"weight sync to version {version} failed ({type(err).__name__})"
            raise
        self._sync_failure = None
        seconds = time.perf_counter() - start
        self.version = version
        self.last_sync = {"version": version, "seconds": seconds, "bytes": stats["bytes"],
                          "gb_per_s": stats["bytes"] / max(seconds, 1e-9) / 1e9, "attempts": stats["attempts"],
                          "resent_buckets": stats["resent"], "regroups": stats["regroups"]}
        return self.last_sync

    def probe_bandwidth(self, nbytes: int = 1 << 30, repeats: int = 5) -> dict:
        """Time raw broadcasts of ``nbytes`` over the sync group (no packing, no checksum): the wire's GB/s."""
        self._check_open("probe_bandwidth")
        if not (as_int(repeats) is not None and repeats >= 1) or not (as_int(nbytes) is not None and nbytes >= 1):
            raise ValueError(f"probe_bandwidth(nbytes={nbytes!r}, repeats={repeats!r}): use integers >= 1.")
        nbytes, repeats = as_int(nbytes), as_int(repeats)
        if self._group is None:
            self._form_group()
        device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else "cpu"
        buffer = torch.ones(nbytes, dtype=torch.uint8, device=device)
        # read by _sync after a failure (the survivors' PeerLost), as a sync attempt's receives are
        refs = self._attempt_refs = [slot.actor.probe.remote(nbytes, repeats + 1) for slot in self.slots]

        def watch():  # NCCL: a broadcast to a dead worker never completes; Ray tells first
            _raise_known_failures(refs)

        try:
            self._group.connect(device, watch)  # NCCL: the communicator's set-up, watched (a worker may die in it)
            self._group.broadcast(buffer).wait()  # warm-up
            wait_device(self._group, device, watch)
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                self._group.broadcast(buffer).wait()
                wait_device(self._group, device, watch)
                times.append(time.perf_counter() - start)
        except Exception:
            self._drop_group()  # its broadcasts are aborted (NCCL) and its receivers told; the next sync re-forms it
            raise
        self._get(refs)
        best, median = min(times), sorted(times)[len(times) // 2]
        return {"bytes": nbytes, "repeats": repeats, "median_s": median, "best_s": best,
                "gb_per_s_median": nbytes / median / 1e9, "gb_per_s_best": nbytes / best / 1e9}

    def checksums(self) -> list[list[tuple[int, int]]]:
        """Each worker's per-bucket checksums of the weights it holds (compare with ``plan.checksums(model)``)."""
        return self._get([slot.actor.checksum.remote() for slot in self.slots])

    def metrics(self) -> list[dict]:
        """Per worker: its counters (``RolloutWorker.metrics``) and how often its slot was restarted."""
        out = self._get([slot.actor.metrics.remote() for slot in self.slots])
        for slot, row in zip(self.slots, out):
            row["restarts"] = slot.restarts
        return out

    def take_send_times(self) -> dict[str, float]:
        """Rank 0's phase seconds (``weight_sync.SendTimes``) summed since the last call, then reset; after a
        regroup, those of the attempts on the dropped group are not counted. Empty before the first sync."""
        return self._group.take_send_times() if self._group is not None else {}

    def health(self) -> list[dict]:
        """Per worker: name, pid, Ray node, weight version, device, and its engine's options (``sync_every``, CUDA
        graphs, the fusion switches as resolved on its device)."""
        return self._get([slot.actor.health.remote() for slot in self.slots])

    def versions(self) -> list[int]:
        """Per worker, the weight version it holds."""
        return self._get([slot.actor.version.remote() for slot in self.slots])

    def close(self) -> None:
        """Kill the workers and free their placement group (the Ray cluster itself is left running)."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if self._closed:
            return
        self._closed = True
        try:
            for slot in self.slots:
                try:
                    ray.kill(slot.actor, no_restart=True)
                except Exception:  # noqa: BLE001 - one gone actor must not keep the others and the reservation
                    pass
            self.slots = []
            if self._group is not None:
                self._group.close()
        finally:
            self._group = self._store = None
            remove_placement_group(self.placement)

    def _check_open(self, what: str) -> None:
        if getattr(self, "_closed", False):
            raise RuntimeError(f"RolloutPool.{what}: the pool is closed (close() killed its workers and freed their "
                               "placement group); make a new RolloutPool.")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- internals -------------------------------------------------------------------------------------------
    def _spawn(self, index: int):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(self.placement, placement_group_bundle_index=index)
        options = dict(num_cpus=1, num_gpus=self.gpus_per_worker, max_restarts=0, scheduling_strategy=strategy)
        return self._remote.options(**options).remote(*self._worker_args, name=f"worker-{index}")

    def _sync(self, version: int, fetch, device, agree) -> dict:
        stats = {"bytes": 0, "attempts": 0, "resent": 0, "regroups": 0}
        last = None
        for _ in range(self.sync_retries + 1):
            try:
                if self._group is None:  # forming the group fails like a send when a worker is dead or hung
                    self._form_group()
                    stats["regroups"] += 1
                self._send_verified(version, fetch, device, agree, stats)
                return stats
            except WeightSyncError:
                raise
            except Exception as err:  # a worker died or the wire broke: replace the broken, re-form, start over
                last = err
                self._drop_group()  # first: on gloo, closing rank 0's side ends the survivors' receives at once, so
                try:  # their health calls answer in time
                    self._replace_unhealthy(reason=f"weight sync failed: {err}")
                except Exception as replace_err:  # noqa: BLE001 - a replacement that did not start (died, or no
                    last = replace_err  # answer to set_plan): the next attempt's health check replaces it again
                _consume(self._attempt_refs)  # the survivors' receives failed too: read, not reported as unhandled
        raise WeightSyncError(f"weight sync to version {version} failed {self.sync_retries + 1} times (last: "
                              f"{type(last).__name__}: {str(last)[:300]}); see the workers' logs.")

    def _set_plan_everywhere(self) -> None:
        """Give every worker the plan; a worker dead or silent by ``start_timeout_s`` is replaced (``replace`` gives
        the new one the plan). A refusal (another architecture) is the user's error and propagates."""
        import ray
        from ray.exceptions import RayActorError

        refs = [slot.actor.set_plan.remote(self.plan) for slot in self.slots]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.start_timeout_s)
        for index, ref in enumerate(refs):
            if ref not in ready:
                self.replace(index, f"no answer to set_plan within {self.start_timeout_s:g}s")
                continue
            try:
                ray.get(ref)
            except RayActorError as err:
                self.replace(index, f"died before its first sync ({type(err).__name__})")

    def _send_verified(self, version: int, fetch, device, agree, stats) -> None:
        indices = list(range(len(self.plan)))
        all_sent: dict = {}
        for attempt in range(self.sync_retries + 1):
            agree(indices)
            refs = self._attempt_refs = [slot.actor.receive.remote(version, indices) for slot in self.slots]
            _raise_known_failures(refs)  # a worker already known dead: re-form before a broadcast that would hang
            sent = send_buckets(self._group, self.plan, indices, fetch, device,  # NCCL: polls, asking Ray between
                                watch=lambda: _raise_known_failures(refs))  # polls whether a receiver died
            got = self._get(refs)  # one round trip: each worker verified its buckets against the in-stream sums
            all_sent.update(sent)
            stats["attempts"] += 1
            stats["bytes"] += sum(self.plan.sizes[i] for i in indices)
            # None: the worker's own in-stream check failed (it does not hold the version until a resend)
            bad = sorted({i for received in got for i in indices
                          if received[i] is None or tuple(received[i]) != sent[i]})
            if not bad:
                agree([])
                for slot in self.slots:
                    slot.version = version
                self.verified_sums = all_sent
                return
            stats["resent"] += len(bad)
            indices = bad
        agree([])
        raise WeightSyncError(f"weight sync to version {version}: buckets {indices} still differ from the trainer's "
                              f"checksums after {self.sync_retries} resends; the pool stays at version "
                              f"{self.version} and refuses rollouts until update_weights succeeds.")

    def _form_group(self) -> None:
        import ray

        host = ray.util.get_node_ip_address()
        if self._store is None:
            self._store = open_store(host, timeout_s=self.timeout_s)
        self._generation += 1
        world = 1 + len(self.slots)
        self._get([slot.actor.health.remote() for slot in self.slots], self.start_timeout_s)  # actors are up
        refs = [slot.actor.join_group.remote(host, self._store.port, rank, world, self.backend, self._generation,
                                             self.timeout_s) for rank, slot in enumerate(self.slots, 1)]
        self._group = SyncGroup(host, self._store.port, 0, world, self.backend, self._generation, self.timeout_s,
                                store=self._store)
        self._get(refs)
        self.probe_bandwidth(nbytes=1 << 10, repeats=1)  # set the communicator up now, not in the first sync

    def _drop_group(self) -> None:
        if self._group is not None:
            self._group.close()
        self._group = None

    def _replace_unhealthy(self, reason: str) -> None:
        """Replace every worker that does not answer a health call within the timeout."""
        import ray

        refs = [slot.actor.health.remote() for slot in self.slots]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=min(self.timeout_s, 30.0))
        for index, ref in enumerate(refs):
            try:
                ok = ref in ready and ray.get(ref) is not None
            except Exception:
                ok = False
            if not ok:
                self.replace(index, reason)

    def replace(self, index: int, reason: str) -> None:
        """Kill worker ``index`` (if alive) and start a fresh one in its bundle; it needs weights before work."""
        import ray

        slot = self.slots[index]
        ray.kill(slot.actor, no_restart=True)
        print(f"kvroll: replacing rollout worker {index} ({reason})", flush=True)
        slot.actor, slot.version, slot.restarts = self._spawn(index), -1, slot.restarts + 1
        slot.queued = {}  # calls queued on the old actor fail and are launched again
        self._drop_group()  # a new process cannot join the old communicator
        if self.plan is not None:
            self._get([slot.actor.set_plan.remote(self.plan)], self.start_timeout_s)

    def refresh(self, index: int) -> None:
        """Bring worker ``index`` the current weights through Ray's object store, verified by checksum."""
        import ray

        if self.source is None or self.plan is None:
            raise RefreshError("a rollout worker needs the weights again but the pool has no local copy of them "
                               "(RolloutPool.source is None); run update_weights on the trainer again.")
        slot = self.slots[index]
        self._call(slot.actor.begin_sync, self.version)
        fetch = self.plan.fetcher(self.source)
        for bucket in range(len(self.plan)):
            with fetch(bucket) as tensors:
                buffer = self.plan.pack(bucket, tensors, self.plan.new_buffer(bucket, _param_device(self.source)))
            expected = bucket_checksum(buffer)
            if expected != self.verified_sums.get(bucket):  # the model moved on since version self.version
                raise RefreshError(f"worker {index} needs weight version {self.version} again, but the pool's source "
                                   f"model no longer holds it (bucket {bucket} differs from the verified sync: the "
                                   "model was changed after update_weights, or the last update_weights failed); "
                                   "call update_weights(model) before rolling out.")
            for _ in range(self.sync_retries + 1):
                if tuple(self._call(slot.actor.load_bucket, bucket, ray.put(buffer.cpu()))) == expected:
                    break
            else:
                raise WeightSyncError(f"worker {index}: bucket {bucket} did not verify after "
                                      f"{self.sync_retries} resends through the object store.")
        self._call(slot.actor.finish_sync, self.version)
        slot.version = self.version

    def _call(self, method, *args):
        return self._get([method.remote(*args)])[0]

    def _get(self, refs: list, timeout_s: float | None = None) -> list:
        """``ray.get`` with a timeout (the worker timeout by default): a call that does not return is an error, and
        so is the first call that fails, at once, without waiting for the others (on NCCL a worker still receiving
        from a dead one waits until the pool aborts the sync group: only then does it answer)."""
        import ray

        timeout_s = timeout_s or self.timeout_s
        deadline, pending = time.monotonic() + timeout_s, list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError(f"{len(pending)} rollout-worker call(s) did not return within {timeout_s:g}s "
                                   "(worker_timeout_s).")
            ray.get(ready)  # raises if that call failed
        return ray.get(refs)


def _consume(refs: list) -> None:
    """Read the calls of a failed attempt that have ended (their errors included), so that Ray does not print them
    as unhandled errors when the references go: the pool has handled them."""
    import ray

    done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
    for ref in done:
        try:
            ray.get(ref)
        except Exception:  # noqa: S110 - the failure was handled by replacing the worker or re-forming the group
            pass


def _raise_known_failures(refs: list) -> None:
    """Raise now if a call already failed (its actor is known dead); costs nothing when none has."""
    import ray

    done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
    if done:
        ray.get(done)  # a receive cannot finish before the broadcast: a ready ref is an error


def _check_args(num_workers, gpus_per_worker, max_batch, timeout_s, bucket_bytes, strategy, backend, sync_retries,
                task_retries, connect_timeout_s=30.0) -> None:
    def bad(name, value, rule):
        return ValueError(f"RolloutPool.{name}={value!r} is invalid: {rule}.")

    def integer(value, low):  # not a bool: True would be taken as 1 here and refused by the workers' engines
        return as_int(value) is not None and value >= low

    def number(value):  # an integer as above, or a float
        return (as_int(value) is not None or isinstance(value, float)) and math.isfinite(value)

    if not integer(num_workers, 1):
        raise bad("num_workers", num_workers, "use an integer >= 1")
    if gpus_per_worker is not None and not (number(gpus_per_worker) and gpus_per_worker >= 0):
        raise bad("gpus_per_worker", gpus_per_worker,
                  "use a finite number >= 0 (fractions share a GPU; 0 runs on CPU)")
    if not integer(max_batch, 1):
        raise bad("max_batch", max_batch, "use an integer >= 1")
    for name, value in (("worker_timeout_s", timeout_s), ("connect_timeout_s", connect_timeout_s)):
        if not (number(value) and value > 0):
            raise bad(name, value, "use a finite number of seconds > 0 (Ray's waits take no infinite timeout)")
    if not integer(bucket_bytes, 1 << 16):
        raise bad("bucket_bytes", bucket_bytes, "use an integer >= 65536 (about 1 GB is the default)")
    if strategy not in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"):
        raise bad("placement_strategy", strategy, "use PACK, SPREAD, STRICT_PACK or STRICT_SPREAD")
    if backend not in (None, "nccl", "gloo"):
        raise bad("backend", backend, "use 'nccl', 'gloo' or None (nccl when the workers have GPUs)")
    for name, value in (("sync_retries", sync_retries), ("max_task_retries", task_retries)):
        if not integer(value, 0):
            raise bad(name, value, "use an integer >= 0")


def _model_config(model):
    """(config, weight source or None) for a name/path, a module or a config."""
    from transformers import PretrainedConfig

    from kvroll.rollout.model import check_family

    if isinstance(model, PretrainedConfig):
        check_family(model)
        return model, None
    if isinstance(model, torch.nn.Module):
        from kvroll.rollout.sources import check_mergeable

        check_family(model.config)
        check_mergeable(model)  # an unmergeable PEFT adapter: refused before Ray is reached and workers start
        return model.config, model
    if isinstance(model, str):
        from kvroll.rollout.model import load_model

        loaded, _ = load_model(model, tokenizer=False)  # the driver's copy on CPU: the source of the first sync
        return loaded.config, loaded
    raise ValueError(f"RolloutPool.model={model!r} must be 'smollm2', a local HF directory, an nn.Module or a "
                     "transformers PretrainedConfig.")


def _dtype(dtype, config, gpus: float) -> torch.dtype:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"RolloutPool.dtype={dtype!r} is invalid: use one of {sorted(DTYPES)}.")
        return DTYPES[dtype]
    if dtype is not None:
        if dtype not in _DTYPE_NAMES:
            raise ValueError(f"RolloutPool.dtype={dtype!r} is invalid: use one of {sorted(_DTYPE_NAMES.values())} "
                             "(a torch.dtype or its name), or None (bfloat16 on GPUs, float32 on CPUs).")
        return dtype
    return torch.bfloat16 if gpus > 0 else torch.float32


def _param_device(model) -> torch.device:
    param = next(model.parameters())
    return torch.device("cuda", torch.cuda.current_device()) if hasattr(param, "ds_id") and torch.cuda.is_available() \
        else param.device
