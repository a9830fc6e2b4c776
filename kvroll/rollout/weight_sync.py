"""The weight-sync transport: a process group of the trainer's rank 0 and the rollout workers, and bucket streams.

    store = open_store(host)                                         # on the trainer's rank 0, once
    group = SyncGroup(host, store.port, rank=0, world=1 + workers, backend="nccl", generation=1, store=store)
    sums = send_buckets(group, plan, range(len(plan)), fetch, device)        # rank 0
    sums = receive_buckets(group, plan, indices, targets, device)           # each worker (rank 1..W)

The group is torch's ``ProcessGroupNCCL`` / ``ProcessGroupGloo`` built directly on a ``TCPStore`` (as vLLM's
StatelessProcessGroup does), so ``torch.distributed``'s default group — DeepSpeed's, accelerate's — is never
touched. Each formation has a ``generation`` number that prefixes its keys: a restarted worker cannot rejoin a
communicator, so the pool forms a new generation with all parties. Buckets stream through two buffers: bucket k+1
is packed (sender) or posted (receiver) while bucket k is on the wire. Each bucket travels with its checksum in its
last 16 bytes (computed on the sender's device right after packing), so a receiver verifies every bucket itself,
with no round trip; checksums stay on the device until the end.
"""
from __future__ import annotations

import datetime
from typing import Callable

import torch
import torch.distributed as dist

from kvroll.rollout.weights import BucketPlan, checksum_tensor


def open_store(host: str, port: int = 0, timeout_s: float = 60.0) -> dist.TCPStore:
    """The rendezvous store, served by the trainer's rank 0 (port 0: a free port, read back as ``store.port``)."""
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


class SyncGroup:
    """One formation of the sync group (rank 0 sends); see module doc. ``store`` is given on rank 0 only."""

    def __init__(self, host: str, port: int, rank: int, world: int, backend: str, generation: int,
                 timeout_s: float = 600.0, store: dist.TCPStore | None = None):
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"sync backend={backend!r} is invalid: use 'nccl' (GPU) or 'gloo' (CPU).")
        timeout = datetime.timedelta(seconds=timeout_s)
        if store is None:
            store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
        self.store, self.rank, self.world, self.backend = store, rank, world, backend
        prefixed = dist.PrefixStore(f"kvroll-sync/{generation}", store)
        if backend == "gloo":
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=host if rank == 0 else _own_ip(host))]
            self.pg = dist.ProcessGroupGloo(prefixed, rank, world, options)
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, world, options)

    def broadcast(self, tensor: torch.Tensor):
        """Start a broadcast of ``tensor`` from rank 0 (in place on the others); returns the work handle."""
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = 0, 0
        return self.pg.broadcast([tensor], options)

    def close(self) -> None:
        abort = getattr(self.pg, "abort", None)
        if self.backend == "nccl" and abort is not None:
            abort()
        self.pg = None


def send_buckets(group: SyncGroup, plan: BucketPlan, indices, fetch: Callable[[int], object],
                 device: torch.device | str) -> dict[int, tuple[int, int]]:
    """Pack and broadcast the buckets ``indices`` (``fetch(index)`` gives a context with their tensors by name).

    Returns each bucket's checksum as the receivers should see it.
    """
    indices = list(indices)
    buffers = _double_buffer(plan, indices, device)
    works: list = [None, None]
    sums = {}
    for i, index in enumerate(indices):
        slot = i % 2
        if works[slot] is not None:
            works[slot].wait()  # the buffer's previous bucket has left
        size = plan.sizes[index]
        message = buffers[slot][: size + _TRAILER]
        payload = message[:size]
        with fetch(index) as tensors:  # under ZeRO-3 every rank gathers here; only rank 0 calls send_buckets
            plan.pack(index, tensors, payload)
        sums[index] = checksum_tensor(payload)
        message[size:].view(torch.int64).copy_(sums[index])
        works[slot] = group.broadcast(message)
    for work in works:
        if work is not None:
            work.wait()
    return {index: tuple(int(x) for x in value.tolist()) for index, value in sums.items()}


def receive_buckets(group: SyncGroup, plan: BucketPlan, indices, targets: dict[str, torch.Tensor],
                    device: torch.device | str, tamper: Callable[[int, torch.Tensor], None] | None = None
                    ) -> dict[int, tuple[tuple[int, int], tuple[int, int]]]:
    """Receive the buckets ``indices`` into ``targets`` (in place).

    Returns, per bucket, (the checksum of the bytes as received, the checksum the sender computed). A bucket whose
    two differ was damaged on the way (and has been loaded: the caller must resend it before using the weights).
    ``tamper(index, payload)`` is a test hook that may alter a received bucket before it is checked and loaded.
    """
    indices = list(indices)
    buffers = _double_buffer(plan, indices, device)
    pending = []  # (index, message, work), at most two in flight
    sums = {}

    def finish(index, message, work):
        work.wait()
        size = plan.sizes[index]
        payload = message[:size]
        if tamper is not None:
            tamper(index, payload)
        sums[index] = torch.stack([checksum_tensor(payload), message[size:].view(torch.int64)])  # [2, 2]
        plan.unpack(index, payload, targets)

    for i, index in enumerate(indices):
        if len(pending) == 2:
            finish(*pending.pop(0))  # frees the buffer this bucket reuses
        message = buffers[i % 2][: plan.sizes[index] + _TRAILER]
        pending.append((index, message, group.broadcast(message)))
    for item in pending:
        finish(*item)
    return {index: tuple(tuple(int(x) for x in row) for row in value.tolist()) for index, value in sums.items()}


_TRAILER = 16  # bytes after each bucket: its checksum, two int64


def _double_buffer(plan: BucketPlan, indices: list[int], device) -> list[torch.Tensor]:
    size = max((plan.sizes[i] for i in indices), default=0) + _TRAILER
    count = min(2, len(indices))
    return [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(count)]


def _own_ip(peer: str) -> str:
    """This host's address as seen on the route to ``peer`` (what gloo must bind for a multi-node group)."""
    import socket

    if peer in ("127.0.0.1", "localhost"):
        return peer
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((peer, 1))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"
