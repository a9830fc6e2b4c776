"""The sender's pipeline in ``send_buckets``: bucket k+1's gather is entered before bucket k's broadcast starts, no
buffer is rewritten before its broadcast has left, every gather is entered once and in order even when the send
fails; and a real gloo sync group (two threads) delivers every bucket, detects a damaged one and resends it."""
from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch

from kvroll.rollout.weight_sync import SYNC_PHASES, SyncGroup, open_store, receive_buckets, send_buckets
from kvroll.rollout.weights import BucketPlan, checksum_tensor

from ..conftest import tiny_model

BUCKET_BYTES = 40_000  # the tiny model's ~0.4 MB of fp32 weights in 13 buckets


@pytest.fixture
def model():
    return tiny_model("llama", seed=1)


class LazyWire:
    """A sync group whose broadcast reads its buffer only when waited on (or at the end), as NCCL may: a buffer
    rewritten before its work is waited on delivers the wrong bytes."""

    def __init__(self, log, fail_wait_of=None, fail_launch_of=None):
        from kvroll.rollout.weight_sync import SendTimes

        self.log, self.delivered, self.send_times, self.closed = log, [], SendTimes(), False
        self.fail_wait_of, self.fail_launch_of = fail_wait_of, fail_launch_of

    def broadcast(self, message):
        number = sum(1 for event in self.log if event[0] == "send")
        if number == self.fail_launch_of:
            raise RuntimeError("broadcast failed to start")
        self.log.append(("send", number))
        return LazyWork(self, number, message)

    def close(self):
        self.closed = True


class LazyWork:
    def __init__(self, wire, number, message):
        self.wire, self.number, self.message, self.done = wire, number, message, False

    def wait(self):
        if self.number == self.wire.fail_wait_of:
            raise RuntimeError("connection closed by peer")
        if not self.done:
            self.wire.delivered.append((self.number, self.message.clone()))
            self.done = True


def logged_fetch(plan, model, log, fail_enter_of=None):
    fetch = plan.fetcher(model)

    @contextlib.contextmanager
    def logged(index):
        if index == fail_enter_of:
            raise RuntimeError("gather failed")
        log.append(("enter", index))
        try:
            with fetch(index) as tensors:
                yield tensors
        finally:
            log.append(("exit", index))

    return logged


def gathers_in_order_never_nested(log, indices):
    gathers = [event for event in log if event[0] in ("enter", "exit")]
    assert gathers == [(kind, i) for i in indices for kind in ("enter", "exit")], gathers


def test_next_gather_is_entered_before_each_broadcast_and_buffers_wait_for_their_send(model):
    plan = BucketPlan.for_model(model, bucket_bytes=BUCKET_BYTES)
    assert len(plan) >= 5
    log = []
    wire = LazyWire(log)
    sums = send_buckets(wire, plan, range(len(plan)), logged_fetch(plan, model, log), "cpu")
    gathers_in_order_never_nested(log, range(len(plan)))
    for k in range(1, len(plan)):  # bucket k-1 is on the wire while bucket k is gathered and packed
        assert log.index(("enter", k)) < log.index(("send", k - 1)) < log.index(("exit", k))
    assert log.index(("exit", len(plan) - 1)) < log.index(("send", len(plan) - 1))
    # Each bucket arrived as packed, with its checksum in the trailer: no buffer was rewritten before its send left.
    assert sorted(number for number, _ in wire.delivered) == list(range(len(plan)))
    for number, message in wire.delivered:
        size = plan.sizes[number]
        trailer = tuple(message[size: size + 16].view(torch.int64).tolist())
        assert tuple(checksum_tensor(message[:size]).tolist()) == trailer == sums[number]
    assert sums == dict(enumerate(plan.checksums(model)))
    times = wire.send_times
    assert times.buckets == len(plan) and times.send_seconds >= times.gather_seconds + times.pack_seconds > 0
    assert not wire.closed


@pytest.mark.parametrize("fault", [dict(fail_wait_of=0), dict(fail_launch_of=3)], ids=["wait", "launch"])
def test_a_failed_send_closes_the_group_and_still_runs_every_gather_in_order(model, fault):
    plan = BucketPlan.for_model(model, bucket_bytes=BUCKET_BYTES)
    log = []
    wire = LazyWire(log, **fault)
    indices = [4, 1, 2, 6, 0]  # a resend's list need not be sorted; the gathers follow it
    with pytest.raises(RuntimeError, match="connection closed|failed to start"):
        send_buckets(wire, plan, indices, logged_fetch(plan, model, log), "cpu")
    gathers_in_order_never_nested(log, indices)  # the other ZeRO-3 ranks finish the attempt with rank 0
    assert wire.closed


def test_a_failed_gather_stops_the_gathers(model):
    plan = BucketPlan.for_model(model, bucket_bytes=BUCKET_BYTES)
    log = []
    wire = LazyWire(log)
    with pytest.raises(RuntimeError, match="gather failed"):
        send_buckets(wire, plan, range(len(plan)), logged_fetch(plan, model, log, fail_enter_of=2), "cpu")
    gathers_in_order_never_nested(log, [0, 1])  # the default group is broken: nothing more is tried
    assert wire.closed and [event for event in log if event[0] == "send"] == [("send", 0)]


def test_gloo_group_delivers_every_bucket_and_a_damaged_one_is_resent(model):
    """Rank 0 sends through the overlapped pipeline, rank 1 (a thread) receives into another model."""
    plan = BucketPlan.for_model(model, bucket_bytes=BUCKET_BYTES)
    target = tiny_model("llama", seed=2)
    targets = dict(target.named_parameters()) | dict(target.named_buffers())
    store = open_store("127.0.0.1", timeout_s=30)
    groups, errors = {}, []

    def join():
        try:
            groups[1] = SyncGroup("127.0.0.1", store.port, 1, 2, "gloo", generation=1, timeout_s=30)
        except Exception as err:  # surfaced below
            errors.append(err)

    thread = threading.Thread(target=join)
    thread.start()
    groups[0] = SyncGroup("127.0.0.1", store.port, 0, 2, "gloo", generation=1, timeout_s=30, store=store)
    thread.join()
    assert not errors, errors

    def sync(indices, tamper=None):
        received = {}

        def receive():
            try:
                received.update(receive_buckets(groups[1], plan, indices, targets, "cpu", tamper))
            except Exception as err:
                errors.append(err)

        thread = threading.Thread(target=receive)
        thread.start()
        sent = send_buckets(groups[0], plan, indices, plan.fetcher(model), "cpu")
        thread.join(timeout=60)
        assert not thread.is_alive() and not errors, errors
        assert [received[i][1] for i in indices] == [sent[i] for i in indices]  # the sender's sums, from the trailer
        return sorted(i for i in indices if received[i] != (sent[i], sent[i]))  # damaged on the way

    def damage(index, payload):
        if index == 3 and not damaged:
            payload[7] ^= 1
            damaged.append(index)

    damaged = []
    indices = list(range(len(plan)))
    assert sync(indices, damage) == [3]  # detected in the overlapped stream, and only that bucket
    assert plan.checksums(target)[3] != plan.checksums(model)[3]
    assert sync([3], damage) == []  # the resend
    assert plan.checksums(target) == plan.checksums(model)
    assert all(torch.equal(t, targets[name]) for name, t in model.state_dict().items())
    times = groups[0].take_send_times()
    assert sorted(times) == sorted(SYNC_PHASES) and times["buckets"] == len(plan) + 1
    assert times["send_seconds"] > 0 and groups[0].take_send_times()["buckets"] == 0
    for group in groups.values():
        group.close()


def test_closing_a_gloo_group_frees_a_peer_blocked_in_its_broadcast_though_a_handle_is_held():
    """Gloo's connections close only with the last reference to the communicator, and every work handle holds one
    (a failed send's handles live on in its traceback): ``close`` empties the handles it gave out, so a peer blocked
    in a broadcast that rank 0 will never send fails at once, not when the group's timeout runs out."""
    store = open_store("127.0.0.1", timeout_s=30)
    groups, outcome = {}, {}

    def join_then_wait():
        groups[1] = SyncGroup("127.0.0.1", store.port, 1, 2, "gloo", generation=1, timeout_s=30)
        groups[1].broadcast(torch.empty(8, dtype=torch.uint8)).wait()
        start = time.monotonic()
        try:
            groups[1].broadcast(torch.empty(8, dtype=torch.uint8)).wait()  # rank 0 never sends this one
            outcome["result"] = "received"
        except RuntimeError as err:
            outcome["result"] = str(err)
        outcome["seconds"] = time.monotonic() - start

    thread = threading.Thread(target=join_then_wait, daemon=True)
    thread.start()
    groups[0] = SyncGroup("127.0.0.1", store.port, 0, 2, "gloo", generation=1, timeout_s=30, store=store)
    held = groups[0].broadcast(torch.ones(8, dtype=torch.uint8))  # a handle still referenced, as in a traceback
    held.wait()
    time.sleep(0.5)  # rank 1 is waiting in its second broadcast
    groups[0].close()
    thread.join(timeout=10)
    assert not thread.is_alive(), "rank 1 still waits for rank 0 after close()"
    assert "closed" in outcome["result"] or "reset" in outcome["result"], outcome
    assert outcome["seconds"] < 10
    with pytest.raises(RuntimeError, match="sync group was closed"):
        held.wait()
    groups[1].close()


class Done:
    def wait(self):
        pass


class StubGroup:
    """What ``weight_sync._poll`` and ``SyncGroup.close`` read of a group: rank, timeout, the formation's prefixed
    store (a real TCPStore), the communicator (a stub recording ``abort``)."""

    def __init__(self, rank, prefixed, backend="nccl", timeout_s=600.0, setup=None):
        self.rank, self.prefixed, self.backend, self.timeout_s = rank, prefixed, backend, timeout_s
        self.pg, self._works, self.log = self, set(), []
        self._connected, self._connecting, self.setup = backend != "nccl", None, setup

    def abort(self):
        self.log.append("abort" if self.prefixed.check(["abort"]) else "abort before the flag")

    def broadcast(self, tensor):  # the set-up's broadcast: ``setup()`` blocks or raises as NCCL's set-up would
        self.log.append(("broadcast", tensor.numel()))
        if self.setup is not None:
            self.setup()
        return Done()

    aborted = SyncGroup.aborted
    close = SyncGroup.close
    connect = SyncGroup.connect


@pytest.fixture
def stores():
    """A formation's prefixed store on rank 0 (the server) and on a receiver (a client), as ``SyncGroup`` has."""
    import datetime

    import torch.distributed as dist

    server = open_store("127.0.0.1", timeout_s=10)
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=10))
    return dist.PrefixStore("kvroll-sync/7", server), dist.PrefixStore("kvroll-sync/7", client), server


def test_rank_0_closing_an_nccl_group_flags_the_formation_aborted_before_its_own_abort(stores):
    """NCCL's abort does not reach the peers: rank 0 flags the formation in the store first, so the receivers still
    waiting in one of its broadcasts give up (``wait_device``); a later formation does not see the flag."""
    import torch.distributed as dist

    rank0_store, receiver_store, server = stores
    sender, receiver = StubGroup(0, rank0_store), StubGroup(1, receiver_store)
    assert not receiver.aborted()
    sender.close()
    assert sender.log == ["abort"] and sender.pg is None  # the flag was set before the abort
    assert receiver.aborted() and not StubGroup(1, dist.PrefixStore("kvroll-sync/8", server)).aborted()
    sender.close()  # idempotent: nothing left to abort
    assert sender.log == ["abort"]
    gloo = StubGroup(0, dist.PrefixStore("kvroll-sync/9", server), backend="gloo")
    gloo.close()  # gloo: no flag (closing its side ends the peers' receives), no abort
    assert gloo.log == [] and not StubGroup(1, dist.PrefixStore("kvroll-sync/9", server)).aborted()


def test_a_device_wait_gives_up_on_the_watch_the_abort_flag_or_its_deadline(stores, monkeypatch):
    """``wait_device``'s loop (``_poll``) on a wait that never ends, as a broadcast to a dead NCCL peer: rank 0 raises
    what ``watch`` raises (the pool: Ray reports a receiver dead) within a few polls; a receiver raises ``PeerLost``
    once rank 0 has flagged the formation, its own communicator aborted; either gives up at its deadline; a wait
    already done returns at once and asks nothing."""
    import kvroll.rollout.weight_sync as ws

    monkeypatch.setattr(ws, "POLL_S", 0.02)
    rank0_store, receiver_store, _ = stores
    sender, receiver = StubGroup(0, rank0_store), StubGroup(1, receiver_store)
    asked = []

    def watch():
        asked.append(time.monotonic())
        if len(asked) == 3:
            raise ConnectionError("worker 1 died")

    start = time.monotonic()
    with pytest.raises(ConnectionError, match="worker 1 died"):
        ws._poll(lambda: False, sender, watch, deadline_s=60)
    assert len(asked) == 3 and time.monotonic() - start < 1.0
    ws._poll(lambda: True, sender, watch, deadline_s=0)  # done: no poll, no watch, no deadline
    assert len(asked) == 3

    flag = threading.Timer(0.1, rank0_store.set, ("abort", "1"))
    flag.start()
    start = time.monotonic()
    with pytest.raises(ws.PeerLost, match="aborted by rank 0"):
        ws._poll(lambda: False, receiver, None, deadline_s=60)
    assert 0.1 <= time.monotonic() - start < 1.0 and receiver.pg is None and receiver.log == ["abort"]

    late = StubGroup(1, receiver_store)  # the flag is there: a receiver asks it only after its first POLL_S
    with pytest.raises(ws.PeerLost):
        ws._poll(lambda: False, late, None, deadline_s=60)
    start = time.monotonic()
    quiet = StubGroup(0, rank0_store)
    with pytest.raises(TimeoutError, match="did not complete in 0.1s"):
        ws._poll(lambda: False, quiet, lambda: None, deadline_s=0.1)
    assert 0.1 <= time.monotonic() - start < 1.0 and quiet.pg is quiet  # rank 0's caller closes its own side
    calls = iter([False] * 5 + [True])
    ws._poll(lambda: next(calls), quiet, lambda: None, deadline_s=60)  # finishes while polling: returns


def test_wait_device_waits_for_nothing_off_the_gpu(stores):
    """gloo's waits are the host's own (``work.wait()``): on the CPU ``wait_device`` returns at once, asking nothing."""
    import kvroll.rollout.weight_sync as ws

    ws.wait_device(StubGroup(0, stores[0]), "cpu", lambda: pytest.fail("asked off the GPU"), deadline_s=0)


def test_send_and_receive_wait_for_the_device_by_polling_rank_0_asking_its_watch(model, monkeypatch):
    """NCCL: no plain synchronisation at the end of a send or a receive: both end in ``wait_device`` (rank 0's with
    the pool's ``watch``), whose polls a dead peer cannot block."""
    import kvroll.rollout.weight_sync as ws

    calls = []
    monkeypatch.setattr(ws, "wait_device", lambda group, device, watch=None, deadline_s=None: calls.append(watch))
    plan = BucketPlan.for_model(model, bucket_bytes=BUCKET_BYTES)
    watch = lambda: None  # noqa: E731
    send_buckets(LazyWire([]), plan, range(len(plan)), plan.fetcher(model), "cpu", watch=watch)
    assert calls == [watch]
    targets = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    with torch.no_grad():
        receive_buckets(LazyWire([]), plan, range(len(plan)), targets, "cpu")
    assert calls == [watch, None]


def test_a_synchronising_gather_is_entered_only_after_polling_for_the_broadcasts_in_flight(model, monkeypatch):
    """Multi-rank ZeRO-3: DeepSpeed's gather ends in ``torch.cuda.synchronize()``, which a broadcast to a dead peer
    never releases. Before each such gather but the first, ``send_buckets`` polls (``_drain``, asking ``watch``);
    when the watch raises, the group is closed and the remaining gathers still run, in order."""
    import kvroll.rollout.weight_sync as ws

    plan = BucketPlan.for_model(model, bucket_bytes=BUCKET_BYTES)
    log, drains = [], []
    inner = logged_fetch(plan, model, log)

    def fetch(index):
        context = inner(index)
        context.synchronises = True
        return context

    def drain(works, group, device, watch):
        log.append(("drain",))
        drains.append(len(drains))
        if len(drains) == 3:
            raise ConnectionError("worker 1 died")

    monkeypatch.setattr(ws, "_drain", drain)
    wire = LazyWire(log)
    with pytest.raises(ConnectionError, match="worker 1 died"):
        send_buckets(wire, plan, range(len(plan)), fetch, "cpu", watch=lambda: None)
    gathers_in_order_never_nested(log, range(len(plan)))  # the other ZeRO-3 ranks finish the attempt
    assert wire.closed and log.index(("drain",)) == log.index(("exit", 0)) + 1  # not before the first gather
    for k in (1, 2):  # a drain right before each gather's entry
        assert log[log.index(("enter", k)) - 1] == ("drain",)
    assert ("send", 2) not in log  # nothing broadcast after the watch raised
    log.clear()
    send_buckets(LazyWire(log), plan, range(len(plan)), inner, "cpu")  # a gather that does not synchronise
    assert ("drain",) not in log


def test_a_receiver_closes_its_group_when_its_wait_runs_out_and_gives_up_when_rank_0_is_gone(stores, monkeypatch):
    """A receiver that gives up at its deadline aborts its communicator (rank 0 learns through Ray); a receiver whose
    store no longer answers (rank 0's process, which serves it, is gone) stops waiting."""
    import kvroll.rollout.weight_sync as ws

    monkeypatch.setattr(ws, "POLL_S", 0.02)
    receiver = StubGroup(1, stores[1])
    with pytest.raises(TimeoutError, match="did not complete in 0.1s"):
        ws._poll(lambda: False, receiver, None, deadline_s=0.1)
    assert receiver.pg is None and receiver.log == ["abort before the flag"]

    class Gone:
        def check(self, keys):
            raise ConnectionResetError("store gone")

    orphan = StubGroup(1, Gone())
    orphan.abort = lambda: None
    assert orphan.aborted()
    with pytest.raises(ws.PeerLost):
        ws._poll(lambda: False, orphan, None, deadline_s=60)


def test_wait_device_gives_up_before_torchs_watchdog(stores, monkeypatch):
    """The default deadline is 90% of the group's timeout, so the wait gives up (and rank 0 aborts) before torch's
    NCCL watchdog, at the same timeout, would end the process."""
    import kvroll.rollout.weight_sync as ws

    seen = []

    class Event:
        def record(self, stream):
            pass

        def query(self):
            return True

    monkeypatch.setattr(ws.torch.cuda, "Event", Event)
    monkeypatch.setattr(ws.torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(ws, "_poll", lambda done, group, watch, deadline_s: seen.append(deadline_s))
    ws.wait_device(StubGroup(0, stores[0], timeout_s=20.0), "cuda:0")
    assert seen == [pytest.approx(18.0)]


def test_the_nccl_set_up_is_watched_and_given_up_without_an_abort_under_it(stores, monkeypatch):
    """NCCL sets a formation's communicator up in its first collective, which blocks its thread until every rank
    joins, with no timeout: a worker dead or hung after ``join_group`` held rank 0 there. ``connect`` runs it on a
    helper thread and polls as ``wait_device`` does: rank 0 raises what ``watch`` raises, a receiver gives up on the
    abort flag (``PeerLost``), either at its deadline; ``close`` then flags the formation but does not abort a
    communicator whose set-up is still running. A set-up that ends is done once; one that fails raises its error."""
    import kvroll.rollout.weight_sync as ws

    monkeypatch.setattr(ws, "POLL_S", 0.02)
    rank0_store, receiver_store, server = stores
    release = threading.Event()  # the peer that never joins (5 s: a set-up on the caller's thread fails, not hangs)
    try:
        sender = StubGroup(0, rank0_store, setup=lambda: release.wait(5))
        asked = []

        def watch():
            asked.append(1)
            if len(asked) == 3:
                raise ConnectionError("worker 1 died")

        start = time.monotonic()
        with pytest.raises(ConnectionError, match="worker 1 died"):
            sender.connect("cpu", watch)
        assert time.monotonic() - start < 1.0 and sender._connecting.is_alive()
        sender.close()  # the pool drops the group: the flag, but no abort under the set-up
        assert sender.log == [("broadcast", 1)] and sender.pg is None and receiver_store.check(["abort"])
        with pytest.raises(RuntimeError, match="set-up was given up"):
            sender.connect("cpu", watch)

        receiver = StubGroup(1, receiver_store, setup=lambda: release.wait(5))  # the flag is there (rank 0 gave up)
        start = time.monotonic()
        with pytest.raises(ws.PeerLost, match="aborted by rank 0"):
            receiver.connect("cpu")
        assert time.monotonic() - start < 1.0 and receiver.log == [("broadcast", 1)] and receiver.pg is None

        quiet = StubGroup(0, ws.dist.PrefixStore("kvroll-sync/8", server), timeout_s=0.2,
                          setup=lambda: release.wait(5))
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="did not complete in 0.18s"):
            quiet.connect("cpu", lambda: None)  # a peer alive but silent: 90% of the group's timeout
        assert 0.18 <= time.monotonic() - start < 1.0
    finally:
        release.set()  # the helpers left behind end

    done = StubGroup(0, ws.dist.PrefixStore("kvroll-sync/9", server), setup=lambda: time.sleep(0.05))
    done.connect("cpu", lambda: None)
    done.connect("cpu", lambda: None)  # once per formation
    assert done.log == [("broadcast", 1)] and done._connected
    done.close()  # the set-up ended: the communicator is aborted as usual, after the flag
    assert done.log == [("broadcast", 1), "abort"]

    def fails():
        raise RuntimeError("NCCL error: remote process exited")

    broken = StubGroup(1, receiver_store, setup=fails)
    with pytest.raises(RuntimeError, match="remote process exited"):
        broken.connect("cpu")
    gloo = StubGroup(0, rank0_store, backend="gloo", setup=lambda: pytest.fail("gloo's constructor connects"))
    gloo.connect("cpu", lambda: None)
    assert gloo.log == []
