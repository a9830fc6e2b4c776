"""``RolloutPool._get``: the wait for the workers' answers ends at the first failed call (on NCCL a survivor still
waiting for data the dead worker was to forward answers only once the pool aborts the group), and ``_consume`` reads
a failed attempt's calls. Ray's wait and get are faked: no cluster."""
from __future__ import annotations

import pytest


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
