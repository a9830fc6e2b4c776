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
