"""Bad environments and several nodes: an unreachable address or a missing cluster is an error in bounded time,
a cluster too small is an error with both numbers (or a placement timeout, not a hang), and a simulated two-node
cluster (ray.cluster_utils.Cluster) runs one worker on each node."""
from __future__ import annotations

import time
import types

import pytest
import torch

from kvroll import CompressionConfig, SamplingParams
from kvroll.rollout import cluster
from kvroll.rollout.pool import RolloutPool

from ..conftest import tiny_model
from .test_pool import COMPRESSION, PROMPTS, SAMPLING, reference, same

pytestmark = pytest.mark.ray
ray = pytest.importorskip("ray")


@pytest.fixture(autouse=True)
def no_ray():
    ray.shutdown()
    yield
    ray.shutdown()


@pytest.mark.parametrize("address", ["127.0.0.1:1", "10.255.255.1:6379"])
def test_unreachable_address_is_an_error_in_bounded_time(address):
    # The second address may be unroutable, or (behind a transparent proxy) accept the connection and speak no
    # Ray: either way the error names the address within the connect timeout.
    start = time.monotonic()
    with pytest.raises(ConnectionError, match=f"kvroll_ray_address='{address}' (is unreachable|answers but)"):
        RolloutPool(tiny_model("llama"), COMPRESSION, ray_address=address, connect_timeout_s=3)
    assert time.monotonic() - start < 40
    assert not ray.is_initialized()


def test_a_port_that_is_no_ray_head_is_an_error_in_bounded_time():
    import socket
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    threading.Thread(target=lambda: [server.accept() for _ in range(8)], daemon=True).start()
    address = f"127.0.0.1:{server.getsockname()[1]}"
    start = time.monotonic()
    with pytest.raises(ConnectionError, match=f"kvroll_ray_address='{address}'"):
        cluster.connect(address, timeout_s=3)
    assert time.monotonic() - start < 40
    server.close()


def test_a_refused_token_is_the_error_not_the_last_stderr_line(monkeypatch):
    # What a head started by scripts/ray_cluster.sh answers a client without its token (Ray 2.60): the decisive
    # line sits above ray.init's generic "Failed to connect", which is the last one.
    stderr = "\n".join([
        "Traceback (most recent call last):",
        "ray.exceptions.AuthenticationError: RPC error: InvalidAuthToken: Authentication token is missing or "
        "incorrect. Note: RAY_AUTH_MODE is currently 'disabled' (not 'token'). Ensure that the token for the cluster "
        "is available in a local file",
        "The above exception was the direct cause of the following exception:",
        "ConnectionError: Failed to connect to Ray cluster at 10.0.0.1:6379"])
    monkeypatch.setattr(cluster.subprocess, "run", lambda *a, **k: types.SimpleNamespace(returncode=1, stderr=stderr))
    with pytest.raises(ConnectionError, match=r"kvroll_ray_address='10.0.0.1:6379': joining the Ray cluster failed: "
                       r"it uses token authentication and refused this machine \(.*InvalidAuthToken: Authentication "
                       r"token is missing or incorrect. Note: .*\); this machine needs the head's token, in "
                       r"~/.ray/auth_token") as caught:
        cluster._probe("10.0.0.1:6379", timeout_s=1)
    assert "Failed to connect" not in str(caught.value) and isinstance(caught.value, cluster.ClusterError)


def test_an_unreachable_ray_address_variable_is_an_error_in_bounded_time(monkeypatch):
    # With kvroll_ray_address unset or 'auto', Ray joins $RAY_ADDRESS and retried an unreachable one for minutes
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    start = time.monotonic()
    for address in (None, "auto"):
        with pytest.raises(ConnectionError, match=r"the environment variable RAY_ADDRESS='127.0.0.1:1' \(which Ray "
                           rf"joins when kvroll_ray_address is {address!r}\): .*Unset RAY_ADDRESS or fix it"):
            cluster.connect(address, timeout_s=3)
    assert time.monotonic() - start < 40
    assert not ray.is_initialized()


def test_a_pool_that_fails_to_start_frees_its_placement_group():
    import torch
    from ray.util.placement_group import placement_group_table

    ray.init(num_cpus=2, include_dashboard=False)
    model = tiny_model("llama")
    model.register_buffer("extra_scale", torch.ones(4))  # a tensor the workers' config-built models lack
    for _ in range(2):  # the second attempt gets the same error, not a placement timeout
        with pytest.raises(ray.exceptions.RayTaskError, match="extra_scale"):
            RolloutPool(model, COMPRESSION, num_workers=2, gpus_per_worker=0, max_batch=4, worker_timeout_s=30,
                        connect_timeout_s=10)
    deadline = time.monotonic() + 10
    while "CREATED" in (states := [g["state"] for g in placement_group_table().values()]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "CREATED" not in states, states


def test_malformed_address_names_the_field():
    with pytest.raises(ValueError, match="kvroll_ray_address='http://' is invalid"):
        cluster.connect("http://", timeout_s=1)


def test_auto_without_a_running_cluster(monkeypatch):
    monkeypatch.setattr(cluster, "_running_cluster", lambda address=None: False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    start = time.monotonic()
    with pytest.raises(ConnectionError, match="found no running Ray cluster"):
        cluster.connect("auto", timeout_s=5)
    assert time.monotonic() - start < 30


def test_ray_address_auto_or_local_in_the_environment(monkeypatch):
    """RAY_ADDRESS=auto with kvroll_ray_address unset and no cluster: the error names the variable the user set, not
    the field they left unset; RAY_ADDRESS=local is Ray's request for a new local cluster, not a running one."""
    monkeypatch.setattr(cluster, "_running_cluster", lambda address=None: False)
    monkeypatch.setenv("RAY_ADDRESS", "auto")
    with pytest.raises(ConnectionError, match="environment variable RAY_ADDRESS='auto'.*unset RAY_ADDRESS"):
        cluster.connect(None, timeout_s=5)
    monkeypatch.undo()
    monkeypatch.setenv("RAY_ADDRESS", "local")
    monkeypatch.setattr("ray._private.services.find_gcs_addresses", lambda: ["192.0.2.2:6379"])
    assert cluster._running_cluster() is False  # a cluster runs here, but 'local' asks Ray for a new one
    assert cluster._running_cluster("auto") is True  # an explicit 'auto' joins the one running
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")
    assert cluster._running_cluster() is True


def test_an_explicit_address_other_than_the_cluster_already_joined_is_an_error(monkeypatch):
    """A process already connected (ray.init ran before) with an explicit kvroll_ray_address of another cluster: an
    error naming both, not a silent run on the wrong cluster. The same cluster (its address, this machine's loopback
    at its port) or no address: the connection is used."""
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: types.SimpleNamespace(gcs_address="10.0.0.5:6379"))
    for address in ("203.0.113.1:6379", "10.0.0.5:6380"):
        with pytest.raises(ConnectionError, match=f"kvroll_ray_address='{address}'.*connected to the Ray cluster "
                                                  "at 10.0.0.5:6379.*ray.shutdown"):
            cluster.connect(address, timeout_s=5)
    for address in (None, "auto", "10.0.0.5:6379", "10.0.0.5", "127.0.0.1:6379", "localhost"):
        assert cluster.connect(address, timeout_s=5) == "already connected", address


def test_two_nodes_one_worker_each_and_a_full_cluster():
    from ray.cluster_utils import Cluster

    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    nodes.add_node(num_cpus=1)
    try:
        ray.init(address=nodes.address)
        model = tiny_model("llama")
        with pytest.raises(ValueError, match=r"need 3 CPUs .* the Ray cluster has 2"):
            RolloutPool(model, COMPRESSION, num_workers=3, gpus_per_worker=0)
        with RolloutPool(model, COMPRESSION, num_workers=2, gpus_per_worker=0, max_batch=4,
                         placement_strategy="SPREAD", worker_timeout_s=60) as pool:
            health = ray.get([slot.actor.health.remote() for slot in pool.slots])
            assert len({h["node"] for h in health}) == 2, health  # one worker on each node
            same(pool.generate(PROMPTS, SAMPLING, n=2), reference(model))
            assert pool.checksums() == [pool.plan.checksums(model)] * 2  # gloo across the two nodes
            # Every CPU is now held: a second pool's placement group cannot be placed and says so in time.
            start = time.monotonic()
            with pytest.raises(TimeoutError, match=r"\(1 x CPU 1, GPU 0, strategy PACK\) was not placed within 5s; "
                                                   r"the cluster has CPU 2, GPU 0, of which CPU 0, GPU 0 free"):
                RolloutPool(model, COMPRESSION, num_workers=1, gpus_per_worker=0, connect_timeout_s=5)
            assert time.monotonic() - start < 30
    finally:
        ray.shutdown()
        nodes.shutdown()


def test_pool_error_for_bad_arguments_comes_before_ray_starts():
    for kwargs, message in ((dict(num_workers=0), "num_workers=0"), (dict(gpus_per_worker=-1), "gpus_per_worker=-1"),
                            (dict(placement_strategy="ANY"), "placement_strategy='ANY'"),
                            (dict(backend="mpi"), "backend='mpi'"), (dict(worker_timeout_s=0), "worker_timeout_s=0"),
                            # an infinite timeout passed a '> 0' check, then failed in ray.wait after the workers
                            # started, naming no field (session 42's audit)
                            (dict(worker_timeout_s=float("inf")), r"worker_timeout_s=inf is invalid: use a finite"),
                            (dict(worker_timeout_s=True), "worker_timeout_s=True is invalid"),
                            (dict(connect_timeout_s=float("inf")), "connect_timeout_s=inf is invalid"),
                            (dict(connect_timeout_s=0), "connect_timeout_s=0 is invalid"),
                            (dict(dtype=torch.float64), r"dtype=torch.float64 is invalid: use one of")):
        with pytest.raises(ValueError, match=message):
            RolloutPool(tiny_model("llama"), CompressionConfig("full"), **kwargs)
        assert not ray.is_initialized()
    pool = types.SimpleNamespace(vocab_size=256, max_positions=8192)  # what RolloutPool.__init__ reads first
    with pytest.raises(ValueError, match="must be a kvroll.SamplingParams"):
        RolloutPool.submit(pool, [[1]], sampling="greedy")
    assert SamplingParams  # imported for the message above


def test_the_probe_is_stopped_at_the_connect_timeout_or_15_s(monkeypatch):
    """The child that joins a port first is stopped at max(timeout_s, 15 s) (docs/ray.md), not later."""
    given = []

    def run(*args, timeout=None, **kwargs):
        given.append(timeout)
        raise cluster.subprocess.TimeoutExpired(args[0], timeout)

    monkeypatch.setattr(cluster.subprocess, "run", run)
    for timeout_s in (3, 40):
        with pytest.raises(ConnectionError, match=r"answers but no Ray cluster could be joined"):
            cluster._probe("10.0.0.1:6379", timeout_s=timeout_s)
    assert given == [15.0, 40]
