"""The trainer's side of ``kvroll_mode="ray"``: the rollout pool on rank 0 and the weight sync every rank joins.

    rollouts = RayRollouts(trainer, compression)
    stats = rollouts.sync()                      # every rank (ZeRO-3 gathers are collectives); rank 0 sends
    rows = rollouts.run(all_rows, chunks, sampling_for)   # rank 0: {global row: (token ids, logprobs)}

Rank 0 owns the ``RolloutPool`` (built on first use from the training model's config; the workers get every weight
through the sync). Under DeepSpeed ZeRO-3 each bucket's parameters are gathered on every rank — rank 0 tells the
others which buckets each attempt sends, resends included — and only rank 0 packs and broadcasts them. The list
reaches the other ranks with the attempt's first gather, so an attempt that fails before gathering (a worker found
dead) leaves them waiting for the next list; one that fails mid-way still runs its remaining gathers
(``send_buckets``). Either way every rank passes through the same gathers in the same order, and the repeated
attempt starts in step.
"""
from __future__ import annotations

import torch

from kvroll.config import CompressionConfig
from kvroll.rollout.model import DTYPES



class RayRollouts:
    """Rollouts in Ray workers for one trainer (see module doc)."""

    def __init__(self, trainer, compression: CompressionConfig):
        self.trainer, self.args, self.compression = trainer, trainer.args, compression
        self.accelerator = trainer.accelerator
        self.rank, self.world = self.accelerator.process_index, self.accelerator.num_processes
        self.pool = None
        self.model = self.accelerator.unwrap_model(trainer.model)
        # rank 0, per sync: the attempt's list not yet told, the told gathers still to come, the fetcher, released
        self._pending, self._order, self._fetcher, self._released = None, [], None, False

    @property
    def zero3(self) -> bool:
        """Whether the parameters are ZeRO-3 partitioned now (DeepSpeed partitions them when training starts)."""
        return any(hasattr(p, "ds_id") for p in self.model.parameters())

    def sync(self) -> dict:
        """Send the training weights to every worker as a new version; all ranks call it (TRL does)."""
        if self.rank == 0 and self.pool is None:
            self.pool = self._make_pool()
        if self.rank != 0:
            self._follow_gathers()
            return {}
        lockstep = self.zero3 and self.world > 1
        self._pending, self._order, self._fetcher, self._released = None, [], None, False
        try:
            if lockstep:
                stats = self.pool.update_weights(self.model, agree=self._agree, fetch=self._fetch)
            else:
                stats = self.pool.update_weights(self.model)
        except Exception:
            if lockstep:
                self._release()  # the other ranks leave their gather loop before the error propagates
            raise
        if lockstep:
            self.pool.source = None  # a gather on rank 0 alone would hang: no object-store refresh mid-rollout
        return {**stats, **self.pool.take_send_times()}  # where rank 0's send time went

    def run(self, all_rows: list[list[int]], chunks: list[tuple[int, int]], sampling_for) -> dict:
        """Generate every chunk (rank 0); ``sampling_for(size, length)`` gives the SamplingParams of a chunk of that
        size whose prompt has ``length`` tokens (chunks of one size and one sampling go in one request)."""
        groups: dict[tuple[int, int], tuple] = {}
        for start, size in chunks:
            sampling = sampling_for(size, len(all_rows[start]))
            groups.setdefault((size, sampling.max_new_tokens), (sampling, []))[1].append(start)
        requests = [(size, starts, self.pool.submit([all_rows[s] for s in starts], sampling, n=size))
                    for (size, _), (sampling, starts) in sorted(groups.items(), key=lambda item: item[0])]
        out = {}
        for size, starts, request in requests:
            for index, completion in enumerate(request.result()):
                out[starts[index // size] + index % size] = (completion.token_ids, completion.logprobs)
        return out

    def kv_cache_bytes(self) -> int:
        if self.pool is None:
            return 0
        return sum(m["kv_cache_bytes"] for m in self.pool.metrics())

    def restarts(self) -> int:
        return sum(slot.restarts for slot in self.pool.slots) if self.pool is not None else 0

    # ---- internals -------------------------------------------------------------------------------------------
    def _make_pool(self):
        from kvroll.rollout.pool import RolloutPool

        args = self.args
        dtype = self._dtype()
        rows = args.per_device_train_batch_size * (getattr(args, "steps_per_generation", None) or 1) * self.world
        max_batch = args.kvroll_max_batch or max(1, -(-rows // args.kvroll_num_workers))
        return RolloutPool(self.model, self.compression, num_workers=args.kvroll_num_workers,
                           gpus_per_worker=args.kvroll_gpus_per_worker, max_batch=max_batch, dtype=dtype,
                           ray_address=args.kvroll_ray_address, worker_timeout_s=args.kvroll_worker_timeout_s,
                           bucket_bytes=args.kvroll_sync_bucket_mb << 20, initial_sync=False)

    def _dtype(self) -> torch.dtype:
        return DTYPES.get(self.args.kvroll_dtype) or _train_dtype(self.model)

    def _agree(self, indices: list[int]) -> None:
        """The pool's hook: each attempt's bucket list, then ``[]`` once the sync is over (see module doc)."""
        self._pending = list(indices) or None
        if not indices:
            self._release()

    def _fetch(self, index: int):
        """The pool's fetch on rank 0: tells the attempt's list at its first gather; the gathers keep its order."""
        if self._pending is not None:
            self._broadcast_indices(self._pending)
            self._order, self._pending = list(self._pending), None
        if not self._order or self._order.pop(0) != index:
            raise RuntimeError(f"weight sync: rank 0 asked for bucket {index} out of the order told to the other "
                               "ZeRO-3 ranks; their gathers would no longer match (a kvroll bug).")
        if self._fetcher is None:
            self._fetcher = self.pool.plan.fetcher(self.model)  # walks the model once per sync
        return self._fetcher(index)

    def _release(self) -> None:
        if not self._released:
            self._released = True
            self._broadcast_indices([])

    def _broadcast_indices(self, indices: list[int]) -> None:
        from accelerate.utils import broadcast_object_list

        broadcast_object_list([list(indices)], from_process=0)  # rank 0 gathers them next, in the pool's fetch

    def _follow_gathers(self) -> None:
        """Non-zero ranks under ZeRO-3: take part in each bucket's gather, attempt after attempt, until told []."""
        if not (self.zero3 and self.world > 1):
            return
        from accelerate.utils import broadcast_object_list

        from kvroll.rollout.weights import BucketPlan

        plan = BucketPlan.for_model(self.model, self._dtype(), self.args.kvroll_sync_bucket_mb << 20)  # rank 0's
        while True:
            message = [None]
            broadcast_object_list(message, from_process=0)
            if not message[0]:
                return
            fetch = plan.fetcher(self.model)
            for index in message[0]:
                with fetch(index):
                    pass


def _train_dtype(model) -> torch.dtype:
    param = next(model.parameters())
    return param.ds_tensor.dtype if hasattr(param, "ds_tensor") else param.dtype
