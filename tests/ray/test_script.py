"""scripts/ray_cluster.sh on one machine: head starts a cluster a trainer joins with 'auto', status lists its
resources, stop ends it; a missing argument is a usage error."""
from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray
ray = pytest.importorskip("ray")

SCRIPT = Path(__file__).parents[2] / "scripts" / "ray_cluster.sh"
RAY = Path(sys.executable).parent / "ray"


def sh(*args, timeout=120):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          env={**__import__("os").environ, "RAY": str(RAY)})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_head_status_join_stop():
    ray.shutdown()
    port = free_port()
    head = sh("head", "--port", str(port), "--num-cpus", "1")
    try:
        assert head.returncode == 0, head.stderr[-2000:]
        assert "scripts/ray_cluster.sh worker" in head.stdout and f":{port}" in head.stdout
        status = sh("status")
        assert status.returncode == 0 and "1.0 CPU" in status.stdout, status.stdout + status.stderr[-2000:]
        joined = subprocess.run(
            [sys.executable, "-c", "from kvroll.rollout.cluster import connect; import ray; "
             "print(connect(None, timeout_s=30)); print(int(ray.cluster_resources()['CPU']))"],
            capture_output=True, text=True, timeout=120)
        assert joined.returncode == 0 and "joined the running cluster\n1" in joined.stdout, joined.stderr[-2000:]
    finally:
        stop = sh("stop")
    assert stop.returncode == 0
    assert sh("status").returncode != 0  # nothing left running


def test_usage_errors():
    assert sh("worker").returncode == 2 and "give the head's address" in sh("worker").stderr
    assert sh("submit", "--").returncode == 2
    assert sh("bogus").returncode == 2
