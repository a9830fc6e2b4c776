"""The weight-sync transport: a process group of the trainer's rank 0 and the rollout workers, and bucket streams.

    store = open_store(host)                                         # on the trainer's rank 0, once
    group = SyncGroup(host, store.port, rank=0, world=1 + workers, backend="nccl", generation=1, store=store)
    sums = send_buckets(group, plan, range(len(plan)), fetch, device)        # rank 0
    sums = receive_buckets(group, plan, indices, targets, device)           # each worker (rank 1..W)

The group is torch's ``ProcessGroupNCCL`` / ``ProcessGroupGloo`` built directly on a ``TCPStore`` (as vLLM's
StatelessProcessGroup does), so ``torch.distributed``'s default group — DeepSpeed's, accelerate's — is never
touched. Each formation has a ``generation`` number that prefixes its keys: a restarted worker cannot rejoin a
communicator, so the pool forms a new generation with all parties. Buckets stream through two buffers: bucket k+1
is gathered and packed (sender) or posted (receiver) while bucket k is on the wire. Each bucket travels with its
checksum in its last 16 bytes (computed on the sender's device right after packing), so a receiver verifies every
bucket itself, with no round trip; checksums stay on the device until the end.

The sender enters bucket k+1's gather *before* it starts bucket k's broadcast. DeepSpeed's ZeRO-3 gather ends in
a host synchronisation (``torch.cuda.synchronize()`` over several ranks, the current stream on one); entered after
the broadcast, it would wait (several ranks) for bucket k to leave before bucket k+1 could be packed. Entered
first, it waits for an earlier bucket (k-1; k-2 on one rank, through the stream's wait before packing bucket k),
and bucket k's broadcast runs while bucket k+1 is packed and released and bucket k+2's gather starts.
``group.send_times`` adds up where the sender's host time went (``SendTimes``).

On NCCL a broadcast whose peer has died never completes: its kernel waits for the peer, and a host that
synchronises with it blocks until torch's watchdog ends the process at the group's timeout. So neither side
synchronises plainly. Each waits for its device by polling (``wait_device``): rank 0 asks ``watch`` between polls
(the pool raises there once Ray reports a receiver dead) and gives up at 90% of the group's timeout (a receiver
alive but silent); on giving up it flags the formation aborted in the store and aborts its communicator
(``SyncGroup.close``), which ends its own broadcasts; the receivers still waiting see the flag, abort theirs and
raise ``PeerLost``, so that they answer the pool's health check and are kept.
"""
from __future__ import annotations

import contextlib
import datetime
import threading
import time
import weakref
from dataclasses import asdict, dataclass, fields
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
        self.timeout_s = timeout_s
        prefixed = self.prefixed = dist.PrefixStore(f"kvroll-sync/{generation}", store)
        if backend == "gloo":
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=host if rank == 0 else _own_ip(host))]
            self.pg = dist.ProcessGroupGloo(prefixed, rank, world, options)
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, world, options)
        self.send_times = SendTimes()
        self._works: weakref.WeakSet = weakref.WeakSet()  # the handles given out, emptied by close()
        self._connected = backend != "nccl"  # NCCL sets its communicator up in the first collective (``connect``)
        self._connecting: threading.Thread | None = None

    def connect(self, device, watch: Callable[[], None] | None = None, deadline_s: float | None = None) -> None:
        """NCCL: set the communicator up now, with a one-byte broadcast, on every rank at the same point (once per
        formation; nothing to do on gloo, whose constructor connects, bounded by its timeout). The set-up blocks its
        thread until every rank has joined, with no timeout of its own: a peer that died or hung after answering
        ``join_group`` would hold this host forever. So it runs on a helper thread while this one polls as
        ``wait_device`` does (``watch`` on rank 0, the abort flag on a receiver, ``deadline_s``: default 90% of the
        group's timeout). On giving up, the helper is left behind in the set-up with the communicator it holds
        (``close`` then does not abort it), and the group is re-formed as after a failed broadcast."""
        if self._connected:
            return
        if self._connecting is not None:
            raise RuntimeError(f"rank {self.rank}: the sync group's set-up was given up; re-form the group.")
        device, failed = torch.device(device), []
        stream = torch.cuda.current_stream(device) if device.type == "cuda" else None  # the caller's

        def run():
            try:
                with contextlib.ExitStack() as stack:
                    if stream is not None:  # the helper orders its broadcast after the caller's stream
                        stack.enter_context(torch.cuda.device(device))
                        stack.enter_context(torch.cuda.stream(stream))
                    self.broadcast(torch.zeros(1, dtype=torch.uint8, device=device)).wait()
            except BaseException as err:  # noqa: BLE001 - raised on the caller's thread
                failed.append(err)

        thread = self._connecting = threading.Thread(target=run, name=f"kvroll-sync-setup-{self.rank}", daemon=True)
        thread.start()
        _poll(lambda: not thread.is_alive(), self, watch, 0.9 * self.timeout_s if deadline_s is None else deadline_s)
        if failed:
            raise failed[0]
        self._connected = True

    def broadcast(self, tensor: torch.Tensor) -> "_Work":
        """Start a broadcast of ``tensor`` from rank 0 (in place on the others); returns the work handle."""
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = 0, 0
        work = _Work(self.pg.broadcast([tensor], options))
        self._works.add(work)
        return work

    def take_send_times(self) -> dict[str, float]:
        """The sender's phase seconds summed since the last call (``SendTimes`` as a dict), then reset."""
        times, self.send_times = self.send_times, SendTimes()
        return asdict(times)

    def aborted(self) -> bool:
        """Whether rank 0 has flagged this formation aborted (``close`` on rank 0; NCCL): a receiver stops waiting."""
        try:
            return bool(self.prefixed.check([_ABORT_KEY]))
        except Exception:  # the store is gone with rank 0's process: nothing will come either
            return True

    def close(self) -> None:
        """Abort (NCCL) and drop the communicator; idempotent. A closed group is re-formed, never reused. On rank 0
        (NCCL) it first flags the formation aborted in the store, so that the receivers still waiting in one of its
        broadcasts give up too (``wait_device``): NCCL's abort does not reach the peers.

        Gloo has no abort that reaches the peers: its connections close only when the last reference to the
        communicator goes, and every work handle holds one (a failed send's handles live on in the traceback). So
        the handles given out are emptied here too, and the peers still blocked in a broadcast of this group get a
        connection error at once instead of waiting out the group's timeout."""
        if self.pg is not None and self.rank == 0 and self.backend == "nccl":
            try:
                self.prefixed.set(_ABORT_KEY, "1")
            except Exception:  # noqa: S110 - the flag is a courtesy to the receivers: the abort below still runs
                pass
        abort = getattr(self.pg, "abort", None)
        if self._connecting is not None and self._connecting.is_alive():
            abort = None  # a set-up given up (``connect``): its thread is inside it, which an abort may not reach
        if self.backend == "nccl" and abort is not None:
            abort()
        for work in list(self._works):
            work.work = None
        self._works = weakref.WeakSet()
        self.pg = None


_ABORT_KEY = "abort"
POLL_S = 0.05  # how often a device wait asks ``watch`` and the abort flag


class PeerLost(RuntimeError):
    """A receiver gave up a broadcast: rank 0 flagged the sync group's formation aborted (a peer died or hung)."""


def wait_device(group: SyncGroup, device, watch: Callable[[], None] | None = None,
                deadline_s: float | None = None) -> None:
    """Wait until the current CUDA stream of ``device`` has run what was enqueued on it (nothing to wait for on
    another device: gloo's waits are the host's own), without a plain synchronisation that a broadcast to a dead peer
    would never release. Between polls, at most every ``POLL_S``: ``watch()`` (raise to give up), and on a receiver
    the formation's abort flag (then the group is closed and ``PeerLost`` raised). ``deadline_s`` (default: 90% of
    the group's timeout, before torch's watchdog) gives up with a ``TimeoutError``."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    _poll(event.query, group, watch, 0.9 * group.timeout_s if deadline_s is None else deadline_s)


def _poll(done: Callable[[], bool], group: SyncGroup, watch, deadline_s: float) -> None:
    """``wait_device``'s loop: until ``done()``, sleeping at most 0.1 ms at first (a sync's last bucket leaves within
    milliseconds, and the pool's bandwidth probe times its broadcasts by it), 1 ms after 0.1 s, ``POLL_S`` after 1 s."""
    start = time.monotonic()
    checked, nap = start, 2e-5
    while not done():
        now = time.monotonic()
        if now - checked >= POLL_S:
            checked = now
            if watch is not None:
                watch()
            if group.rank != 0 and group.aborted():
                group.close()
                raise PeerLost(f"rank {group.rank}: the sync group was aborted by rank 0 during a broadcast "
                               "(a peer died or hung); it will be re-formed.")
            if now - start >= deadline_s:
                if group.rank != 0:  # rank 0's caller closes its side (send_buckets)
                    group.close()
                raise TimeoutError(f"rank {group.rank}: a broadcast of the sync group did not complete in "
                                   f"{deadline_s:g}s (a peer hung?); worker_timeout_s sets the limit.")
        time.sleep(nap)
        elapsed = now - start
        nap = min(2 * nap, 1e-4 if elapsed < 0.1 else 1e-3 if elapsed < 1.0 else POLL_S)


class _Work:
    """A broadcast's work handle that ``SyncGroup.close`` can empty (see there); ``wait()`` as torch's."""

    __slots__ = ("work", "__weakref__")

    def __init__(self, work):
        self.work = work

    def wait(self):
        if self.work is None:  # no local keeps torch's handle: a traceback of a failed wait would hold it
            raise RuntimeError("the sync group was closed while this broadcast was in flight.")
        return self.work.wait()


@dataclass
class SendTimes:
    """Host seconds of the sender (rank 0) in ``send_buckets``, summed over calls; on a GPU, device work is async,
    so a phase that waits on the device shows that wait (see docs/ray.md, "Reading the sync phases")."""

    gather_seconds: float = 0.0  # entering fetch(k): ZeRO-3's gather, with DeepSpeed's host synchronisation
    release_seconds: float = 0.0  # leaving fetch(k): ZeRO-3 re-partitions (per-parameter host work)
    pack_seconds: float = 0.0  # packing (reading merged LoRA weights included) and the checksum
    reuse_wait_seconds: float = 0.0  # waiting for a buffer's previous bucket to leave (host-blocking on gloo)
    drain_seconds: float = 0.0  # after the last launch: the last broadcasts leave, the checksums are read back
    send_seconds: float = 0.0  # all of send_buckets
    buckets: int = 0


SYNC_PHASES = tuple(field.name for field in fields(SendTimes))  # the keys of ``take_send_times()``


def send_buckets(group: SyncGroup, plan: BucketPlan, indices, fetch: Callable[[int], object],
                 device: torch.device | str, watch: Callable[[], None] | None = None) -> dict[int, tuple[int, int]]:
    """Gather, pack and broadcast the buckets ``indices`` (``fetch(index)``: a context giving their tensors by name).

    Returns each bucket's checksum as the receivers should see it. Bucket k+1's gather is entered before bucket
    k's broadcast starts (module doc); every ``fetch`` is entered once, in ``indices`` order, never nested, so the
    ZeRO-3 ranks that only gather follow the same sequence. If anything fails, the group is closed (the caller
    re-forms it) and the buckets not yet gathered are still gathered, unpacked and unsent, so that the other ranks
    finish the attempt with rank 0 and the sync can be repeated; then the error propagates. A failing gather is the
    exception: the default group is broken, and no further gather is tried. On a GPU the host waits for the last
    broadcasts by polling, asking ``watch()`` between polls (``wait_device``).
    """
    indices, times, start = list(indices), group.send_times, time.perf_counter()
    buffers = _double_buffer(plan, indices, device)
    works: list = [None, None]  # per buffer: the broadcast of the bucket it holds
    sums, packed, gathered, gather = {}, None, 0, None  # packed: (slot, message) of a bucket not yet on the wire
    try:
        for i, index in enumerate(indices):
            context = fetch(index)
            if i and getattr(context, "synchronises", False):  # a ZeRO-3 gather synchronises the device (DeepSpeed)
                _drain(works, group, device, watch)  # so wait for the broadcasts in flight first, by polling
            gathered, gather = i + 1, _TimedGather(context, times)
            with gather as tensors:  # under ZeRO-3 every rank gathers here; only rank 0 calls send_buckets
                if packed is not None:
                    works[packed[0]] = group.broadcast(packed[1])  # bucket i-1 leaves while bucket i is packed
                packed = (i % 2, _pack(plan, index, tensors, buffers[i % 2], works[i % 2], times))
            sums[index] = _seal(plan, index, packed[1], times)
        mark = time.perf_counter()
        if packed is not None:
            works[packed[0]] = group.broadcast(packed[1])
        for work in works:
            if work is not None:
                work.wait()
        wait_device(group, device, watch)
        out = {index: tuple(int(x) for x in value.tolist()) for index, value in sums.items()}
        times.drain_seconds += time.perf_counter() - mark
        times.buckets += len(indices)
        return out
    except Exception:
        group.close()
        if gather is None or not gather.failed:  # after a failed gather the default group is broken: stop
            _gather_rest(fetch, indices[gathered:])
        raise
    finally:
        times.send_seconds += time.perf_counter() - start


def _drain(works: list, group: SyncGroup, device, watch) -> None:
    """Before a gather that synchronises the device (``fetch(index).synchronises``: DeepSpeed's ZeRO-3 gather ends in
    ``torch.cuda.synchronize()`` over several ranks): wait, polling, for what that synchronisation would wait for,
    the broadcasts in flight and the current stream. A plain synchronisation with a broadcast to a dead or hung peer
    would never return, and ``watch`` would never be asked."""
    if torch.device(device).type != "cuda":
        return  # gloo: the host's own waits end at the group's timeout
    for work in works:
        if work is not None:
            work.wait()  # NCCL: the current stream waits (the synchronisation would wait for it anyway)
    wait_device(group, device, watch)


def _pack(plan: BucketPlan, index: int, tensors, buffer: torch.Tensor, previous, times: SendTimes) -> torch.Tensor:
    """Bucket ``index`` packed into ``buffer`` once ``previous`` (the broadcast of the bucket it held) has left."""
    mark = time.perf_counter()
    if previous is not None:
        previous.wait()  # NCCL: the current stream waits; gloo: the host waits
    now = time.perf_counter()
    times.reuse_wait_seconds += now - mark
    message = buffer[: plan.sizes[index] + _TRAILER]
    plan.pack(index, tensors, message[: plan.sizes[index]])
    times.pack_seconds += time.perf_counter() - now
    return message


def _seal(plan: BucketPlan, index: int, message: torch.Tensor, times: SendTimes) -> torch.Tensor:
    """Write the packed bucket's checksum into its trailer; returns the checksum (on the device)."""
    mark = time.perf_counter()
    size = plan.sizes[index]
    checksum = checksum_tensor(message[:size])
    message[size:].view(torch.int64).copy_(checksum)
    times.pack_seconds += time.perf_counter() - mark
    return checksum


def _gather_rest(fetch: Callable[[int], object], indices: list[int]) -> None:
    """Enter and leave the gathers the other ZeRO-3 ranks still expect (nothing is read: no LoRA merge runs)."""
    for index in indices:
        with fetch(index):
            pass


class _TimedGather:
    """``fetch(index)``'s context, timed into ``SendTimes``; ``failed`` when its own enter or exit raised."""

    def __init__(self, context, times: SendTimes):
        self.context, self.times, self.failed = context, times, False

    def __enter__(self):
        mark = time.perf_counter()
        try:
            return self.context.__enter__()
        except BaseException:
            self.failed = True
            raise
        finally:
            self.times.gather_seconds += time.perf_counter() - mark

    def __exit__(self, *exc):
        mark = time.perf_counter()
        try:
            return self.context.__exit__(*exc)
        except BaseException:
            self.failed = True
            raise
        finally:
            self.times.release_seconds += time.perf_counter() - mark


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
    wait_device(group, device)  # gives up (``PeerLost``) when rank 0 aborts the formation
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
