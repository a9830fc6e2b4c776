"""``RolloutPool._get``: the wait for the workers' answers ends at the first failed call (on NCCL a survivor still
waiting for data the dead worker was to forward answers only once the pool aborts the group), and ``_consume`` reads
a failed attempt's calls. Ray's wait and get are faked: no cluster."""
from __future__ import annotations

import pytest
import torch


class Ref:
    def __init__(self, name, ready_after=None, error=None):
        self.name, self.ready_after, self.error = name, ready_after, error


@pytest.fixture
def fake_ray(monkeypatch):
    ray = pytest.importorskip("ray")

    clock = {"t": 0.0}
    read = []

    def is_ready(ref):
        return ref.ready_after is not None and ref.ready_after <= clock["t"]

    def wait(refs, num_returns=1, timeout=None):
        ready = sorted((r for r in refs if r.ready_after is not None), key=lambda r: r.ready_after)[:num_returns]
        if len(ready) < num_returns or (timeout is not None and ready[-1].ready_after > clock["t"] + timeout):
            clock["t"] += timeout or 0.0
            ready = [r for r in refs if is_ready(r)][:num_returns]
        else:
            clock["t"] = max(clock["t"], ready[-1].ready_after)
        return ready, [r for r in refs if r not in ready]

    def get(refs):
        many = isinstance(refs, list)
        for ref in refs if many else [refs]:
            read.append(ref.name)
            if ref.error is not None:
                raise ref.error
        return [ref.name for ref in refs] if many else refs.name

    monkeypatch.setattr(ray, "wait", wait)
    monkeypatch.setattr(ray, "get", get)
    return read, clock


def test_get_raises_at_the_first_failed_call_without_waiting_for_the_others(fake_ray):
    from kvroll.rollout.pool import RolloutPool

    pool = object.__new__(RolloutPool)
    pool.timeout_s = 600.0
    survivor = Ref("survivor")  # never answers until the pool aborts the group
    dead = Ref("dead", ready_after=1.0, error=ConnectionError("actor died"))
    with pytest.raises(ConnectionError, match="actor died"):
        pool._get([survivor, dead])
    assert fake_ray[1]["t"] == 1.0  # at the failure, not at the timeout
    assert pool._get([Ref("a", 2.0), Ref("b", 1.0)]) == ["a", "b"]  # answers in the order asked
    with pytest.raises(TimeoutError, match="1 rollout-worker call"):
        pool._get([Ref("a", 0.0), Ref("silent")], timeout_s=5.0)


def test_consume_reads_the_ended_calls_of_a_failed_attempt(fake_ray):
    from kvroll.rollout.pool import _consume

    _consume([Ref("lost", 0.0, RuntimeError("PeerLost")), Ref("ok", 0.0), Ref("running")])
    assert sorted(fake_ray[0]) == ["lost", "ok"]


class SetupRecorder:
    """A sync group recording the order of ``connect`` and the broadcasts (gloo-like: no device)."""

    backend = "gloo"

    def __init__(self, log):
        self.log = log

    def connect(self, device, watch=None, deadline_s=None):
        self.log.append(("connect", watch is not None))

    def broadcast(self, tensor):
        self.log.append(("broadcast", tensor.numel()))
        return self

    def wait(self):
        pass


def test_the_probe_sets_the_communicator_up_watched_on_both_sides_before_any_broadcast(fake_ray):
    """A formation's first collective sets NCCL's communicator up: the pool's probe (``_form_group`` runs it) calls
    ``connect`` with its watch of the workers' calls before its warm-up, and a worker's probe calls ``connect``
    before its receives, so that both sides give up a set-up a dead or hung peer never joins."""
    from kvroll.rollout.pool import RolloutPool, _Slot
    from kvroll.rollout.worker import RolloutWorker

    log = []

    class Actor:
        class probe:
            @staticmethod
            def remote(nbytes, repeats):
                log.append(("probe.remote", repeats))
                return Ref("probe", ready_after=0.0)

    pool = object.__new__(RolloutPool)
    pool.timeout_s, pool.backend, pool.slots = 600.0, "gloo", [_Slot(Actor()), _Slot(Actor())]
    pool._group = SetupRecorder(log)
    out = pool.probe_bandwidth(nbytes=8, repeats=2)
    assert out["repeats"] == 2
    assert log == [("probe.remote", 3)] * 2 + [("connect", True)] + [("broadcast", 8)] * 3

    log.clear()
    worker = object.__new__(RolloutWorker)
    worker.device = torch.device("cpu")
    worker.group = SetupRecorder(log)
    worker.group.backend = "nccl"  # on a CPU stand-in: the receives, then a device wait with nothing to wait for
    assert worker.probe(8, 2) == 2
    assert log == [("connect", False), ("broadcast", 8), ("broadcast", 8)]


def test_a_closed_pool_refuses_work_and_close_frees_the_reservation_once_though_a_kill_fails(fake_ray, monkeypatch):
    """``close()`` kills every worker it can and removes the placement group even when one kill raises, once; a
    closed pool's ``update_weights`` / ``probe_bandwidth`` / ``submit`` say so instead of an IndexError or a sync
    that "succeeds" with no workers."""
    import importlib

    import ray

    from kvroll.rollout.pool import RolloutPool, _Slot

    killed, removed = [], []

    def kill(actor, no_restart=True):
        killed.append(actor)
        if actor == "gone":
            raise ValueError("actor already gone")

    monkeypatch.setattr(ray, "kill", kill)
    placement = importlib.import_module("ray.util.placement_group")  # the module, not ray.util's function
    monkeypatch.setattr(placement, "remove_placement_group", lambda group: removed.append(group))
    pool = object.__new__(RolloutPool)
    pool.slots, pool.placement, pool._group, pool._store = [_Slot("gone"), _Slot("b")], "pg", None, 1
    pool._closed = False
    pool.close()
    pool.close()
    assert killed == ["gone", "b"] and removed == ["pg"] and pool.slots == []
    pool.vocab_size, pool.max_positions = 256, 8192
    for call in (lambda: pool.update_weights(), lambda: pool.probe_bandwidth(), lambda: pool.submit([[1, 2]])):
        with pytest.raises(RuntimeError, match="the pool is closed"):
            call()


def test_a_plan_the_workers_refuse_is_not_kept(fake_ray):
    """A bucket plan the workers refuse (the trainer's model is another architecture) is dropped with the error, so
    that the next ``update_weights`` plans the model it is given instead of failing on the old plan for ever."""
    from kvroll.rollout.pool import RolloutPool, _Slot

    from ..conftest import tiny_model

    class Actor:
        class set_plan:
            @staticmethod
            def remote(plan):
                return Ref("set_plan", ready_after=0.0, error=ValueError("the trainer sends ['x'] which this "
                                                                         "worker's model lacks"))

    pool = object.__new__(RolloutPool)
    pool.slots, pool.plan, pool.source, pool._closed = [_Slot(Actor())], None, None, False
    pool.dtype, pool.bucket_bytes, pool.start_timeout_s = torch.float32, 1 << 16, 60.0
    with pytest.raises(ValueError, match="which this worker's model lacks"):
        pool.update_weights(tiny_model("llama"))
    assert pool.plan is None


def test_a_sync_whose_replacement_fails_to_start_tries_again_and_ends_in_weight_sync_error(fake_ray, monkeypatch):
    """A replacement that dies or does not answer set_plan (replace's _get raises) is one failed attempt more: the
    sync tries again and, every attempt failing, ends in WeightSyncError (pool doc), not the raw error after one."""
    from kvroll.rollout import pool as pool_module
    from kvroll.rollout.pool import RolloutPool, WeightSyncError

    pool = object.__new__(RolloutPool)
    pool.sync_retries, pool._group, pool._attempt_refs, pool.slots = 3, None, [], []
    formed = []

    def form():
        formed.append(1)
        raise RuntimeError("worker 1 died while the group formed")

    def replace_unhealthy(reason):
        raise TimeoutError("1 rollout-worker call(s) did not return within 180s (worker_timeout_s).")

    pool._form_group, pool._drop_group, pool._replace_unhealthy = form, lambda: None, replace_unhealthy
    monkeypatch.setattr(pool_module, "_consume", lambda refs: None)
    with pytest.raises(WeightSyncError, match=r"failed 4 times \(last: TimeoutError: 1 rollout-worker call"):
        pool._sync(2, None, None, lambda indices: None)
    assert len(formed) == 4


def test_get_waits_the_timeout_it_is_given_not_the_worker_timeout(fake_ray):
    """A fresh actor's first calls (health, set_plan) get start_timeout_s, longer than worker_timeout_s: _get must
    wait the timeout it is given, and still give up at it."""
    from kvroll.rollout.pool import RolloutPool

    pool = object.__new__(RolloutPool)
    pool.timeout_s = 10.0
    assert pool._get([Ref("slow start", ready_after=150.0)], 180.0) == ["slow start"]
    with pytest.raises(TimeoutError, match="did not return within 180s"):
        pool._get([Ref("never")], 180.0)


def test_the_health_wait_after_a_failed_sync_is_at_most_30_s_at_the_default_timeout(fake_ray):
    """After a failed sync the workers that do not answer a health call are replaced; the wait is the worker timeout
    but at most 30 s (docs/ray.md: a hung receiver costs the timeout plus 30 s, not twice the timeout)."""
    import types

    from kvroll.rollout.pool import RolloutPool, _Slot

    _, clock = fake_ray
    answers = iter([Ref("healthy", ready_after=0.0), Ref("silent")])
    pool = object.__new__(RolloutPool)
    pool.timeout_s = 600.0
    pool.slots = [_Slot(types.SimpleNamespace(health=types.SimpleNamespace(remote=lambda: next(answers))))
                  for _ in range(2)]
    replaced = []
    pool.replace = lambda index, reason: replaced.append(index)
    pool._replace_unhealthy("weight sync failed")
    assert replaced == [1] and clock["t"] == 30.0


def test_a_bucket_whose_returned_checksum_differs_from_the_senders_is_resent(fake_ray, monkeypatch):
    """The pool compares each worker's checksum with the one it sent, not only the worker's own verdict (None): a
    worker whose bytes and carried checksum were damaged alike reports a sum the trainer never sent."""
    import types

    from kvroll.rollout import pool as pool_module
    from kvroll.rollout.pool import RolloutPool, _Slot

    answers = iter([Ref({0: (7, 7), 1: (3, 4)}, ready_after=0.0), Ref({0: (1, 2)}, ready_after=0.0)])
    sent = []

    def send_buckets(group, plan, indices, fetch, device, watch=None):
        sent.append(list(indices))
        return {0: (1, 2), 1: (3, 4)}

    monkeypatch.setattr(pool_module, "send_buckets", send_buckets)
    pool = object.__new__(RolloutPool)
    pool.timeout_s, pool.sync_retries, pool.version, pool._group = 60.0, 3, 1, object()
    pool.plan = type("Plan", (), {"sizes": [8, 8], "__len__": lambda self: 2})()
    pool.slots = [_Slot(types.SimpleNamespace(receive=types.SimpleNamespace(remote=lambda v, i: next(answers))))]
    stats = {"bytes": 0, "attempts": 0, "resent": 0, "regroups": 0}
    pool._send_verified(2, None, None, lambda indices: None, stats)
    assert sent == [[0, 1], [0]] and stats["attempts"] == 2 and stats["resent"] == 1
    assert pool.slots[0].version == 2 and pool.verified_sums == {0: (1, 2), 1: (3, 4)}


def test_a_receiver_call_already_failed_is_raised_at_once_and_pending_ones_are_not_waited_for(fake_ray):
    """``_raise_known_failures``, asked before each broadcast and between the sender's device polls (NCCL: a
    broadcast to a dead worker never completes), raises a receive that already failed, without waiting."""
    from kvroll.rollout.pool import _raise_known_failures

    read, clock = fake_ray
    _raise_known_failures([Ref("receiving"), Ref("receiving too")])  # none ended: nothing to raise, no wait
    assert clock["t"] == 0.0 and read == []
    with pytest.raises(RuntimeError, match="worker 2 died"):
        _raise_known_failures([Ref("receiving"), Ref("dead", ready_after=0.0, error=RuntimeError("worker 2 died"))])
    assert clock["t"] == 0.0
