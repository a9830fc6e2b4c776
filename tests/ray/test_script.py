"""scripts/ray_cluster.sh on one machine: head starts a cluster a trainer joins with 'auto' and by the HOST:PORT it
prints (token authentication on), status lists its resources, stop ends it; a missing argument is a usage error."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray
ray = pytest.importorskip("ray")

SCRIPT = Path(__file__).parents[2] / "scripts" / "ray_cluster.sh"
RAY = Path(sys.executable).parent / "ray"


def sh(*args, timeout=120):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "RAY": str(RAY)})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_head_status_join_stop():
    ray.shutdown()
    port = free_port()
    head = sh("head", "--num-cpus", "1", "--port", str(port))  # --port after other flags counts too
    try:
        assert head.returncode == 0, head.stderr[-2000:]
        assert "scripts/ray_cluster.sh worker" in head.stdout and f":{port}" in head.stdout
        assert "warning" not in head.stderr, head.stderr[-2000:]  # the script waited on the right port
        # The address the script prints for other machines, joined the way `kvroll train --kvroll_ray_address`
        # does: the head wants a token, and Ray sends one to an explicit address only in RAY_AUTH_MODE=token.
        address = re.search(r"elsewhere: kvroll_ray_address: (\S+)", head.stdout).group(1)
        assert address.endswith(f":{port}")
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS")}
        by_address = subprocess.run(
            [sys.executable, "-c", "import sys; from kvroll.rollout.cluster import connect; import ray; "
             "print(connect(sys.argv[1], timeout_s=30)); print(int(ray.cluster_resources()['CPU']))", address],
            capture_output=True, text=True, timeout=120, env=env)
        assert by_address.returncode == 0 and f"joined {address}\n1" in by_address.stdout, by_address.stderr[-2000:]
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


def test_a_worker_waits_for_a_late_head_and_gives_up_on_a_dead_one():
    # A head started beside its workers (SLURM, Kubernetes) may listen a few seconds late: the worker retries until
    # CONNECT_TIMEOUT_S, then runs `ray start` (here `echo`, to see its arguments); an unreachable head fails in it.
    import threading

    port = free_port()
    server = socket.socket()

    def listen_late():
        time.sleep(2)
        server.bind(("127.0.0.1", port))
        server.listen(4)

    threading.Thread(target=listen_late, daemon=True).start()
    env = {**os.environ, "RAY": "echo", "RAY_AUTH_TOKEN": "t", "CONNECT_TIMEOUT_S": "20"}
    run = subprocess.run(["bash", str(SCRIPT), "worker", f"127.0.0.1:{port}"], capture_output=True, text=True,
                         timeout=60, env=env)
    server.close()
    assert run.returncode == 0 and f"start --address=127.0.0.1:{port}" in run.stdout, run.stderr
    start = time.monotonic()
    dead = subprocess.run(["bash", str(SCRIPT), "worker", "127.0.0.1:1"], capture_output=True, text=True,
                          timeout=60, env={**env, "CONNECT_TIMEOUT_S": "3"})
    assert dead.returncode == 1 and "the head 127.0.0.1:1 does not answer within 3s" in dead.stderr
    assert time.monotonic() - start < 20


def test_usage_errors():
    assert sh("worker").returncode == 2 and "give the head's address" in sh("worker").stderr
    assert sh("submit", "--").returncode == 2
    for flags in (["submit", "--address"], ["submit", "--address", "--", "echo"]):
        missing = sh(*flags)
        assert missing.returncode == 2 and "--address needs a value" in missing.stderr, missing.stderr
    bogus = sh("bogus")
    assert bogus.returncode == 2 and "unknown command 'bogus'" in bogus.stderr
    for flags in (["head", "--port"], ["head", "--num-cpus", "1", "--port"], ["head", "--port", "--num-cpus", "1"]):
        missing = sh(*flags)
        assert missing.returncode == 2 and "--port needs a value" in missing.stderr, missing.stderr
    for flags in (["--help"], ["-h"]):
        helped = sh(*flags)
        assert helped.returncode == 0 and "scripts/ray_cluster.sh head" in helped.stdout
        assert "set -euo" not in helped.stdout and helped.stdout.rstrip().endswith("before `ray start`.")
    nothing = sh()
    assert nothing.returncode == 2 and "set -euo" not in nothing.stderr and "ray_cluster.sh head" in nothing.stderr
    # a port that is none is a usage error at once (a worker retried it for CONNECT_TIMEOUT_S; a head passed it on)
    for address in ("127.0.0.1:abc", "127.0.0.1:", "127.0.0.1:0", "127.0.0.1:70000", ":6379"):
        start = time.monotonic()
        bad = sh("worker", address)
        assert bad.returncode == 2 and f"'{address}' is not HOST:PORT with a port 1-65535" in bad.stderr, bad.stderr
        assert time.monotonic() - start < 10
    for port in ("99999", "0", "abc"):
        bad = sh("head", "--port", port)
        assert bad.returncode == 2 and f"--port {port} is not a port number 1-65535" in bad.stderr, bad.stderr


def _listener(family=socket.AF_INET, host="127.0.0.1"):
    server = socket.socket(family)
    server.bind((host, 0))
    server.listen(4)
    return server


def test_a_worker_without_a_token_is_refused_before_ray_start(tmp_path):
    # Token authentication on (the script's default) and no token on this node: a usage error before `ray start`
    # (here `echo`), which would otherwise retry for minutes; with a token file it goes ahead.
    server = _listener()
    port = server.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE")}
    env.update(RAY="echo", HOME=str(tmp_path), CONNECT_TIMEOUT_S="5")
    try:
        run = subprocess.run(["bash", str(SCRIPT), "worker", f"127.0.0.1:{port}"], capture_output=True, text=True,
                             timeout=60, env=env)
        assert run.returncode == 1 and "this node has no token" in run.stderr and "start" not in run.stdout
        start = time.monotonic()  # checked before the head's reachability wait: at once, even for a dead head
        dead = subprocess.run(["bash", str(SCRIPT), "worker", "127.0.0.1:1"], capture_output=True, text=True,
                              timeout=60, env={**env, "CONNECT_TIMEOUT_S": "30"})
        assert dead.returncode == 1 and "this node has no token" in dead.stderr and time.monotonic() - start < 10
        token = tmp_path / "token"
        token.write_text("t")
        run = subprocess.run(["bash", str(SCRIPT), "worker", f"127.0.0.1:{port}"], capture_output=True, text=True,
                             timeout=60, env={**env, "RAY_AUTH_TOKEN_PATH": str(token)})
        assert run.returncode == 0 and f"start --address=127.0.0.1:{port}" in run.stdout, run.stderr
    finally:
        server.close()


def test_a_worker_reaches_an_ipv6_head_written_as_ray_writes_it():
    try:
        server = _listener(socket.AF_INET6, "::1")
    except OSError:
        pytest.skip("no IPv6 loopback here")
    port = server.getsockname()[1]
    env = {**os.environ, "RAY": "echo", "RAY_AUTH_TOKEN": "t", "CONNECT_TIMEOUT_S": "5"}
    try:
        run = subprocess.run(["bash", str(SCRIPT), "worker", f"[::1]:{port}"], capture_output=True, text=True,
                             timeout=60, env=env)
    finally:
        server.close()
    assert run.returncode == 0 and f"start --address=[::1]:{port}" in run.stdout, run.stderr


def test_the_last_port_is_taken_and_the_one_past_it_refused():
    env = {**os.environ, "RAY": "echo", "READY_TIMEOUT_S": "0"}
    for port, code in (("65535", 0), ("65536", 2), ("1", 0)):
        run = subprocess.run(["bash", str(SCRIPT), "head", "--port", port], capture_output=True, text=True,
                             timeout=60, env=env)
        assert run.returncode == code, run.stderr
        assert (f"--port={port} " in run.stdout) == (code == 0), run.stdout


def test_gpu_and_cpu_counts_are_checked_before_ray_start():
    # `ray start --num-gpus -2` crashed after its GCS server had started, and left it running: the next `head` on
    # the port failed with Ray's "Session name ... does not match persisted value". A count is checked first.
    env = {**os.environ, "RAY": "echo", "RAY_AUTH_TOKEN": "t", "CONNECT_TIMEOUT_S": "30", "READY_TIMEOUT_S": "0"}
    for args in (["head", "--num-gpus", "-2"], ["head", "--num-gpus", "abc"], ["head", "--num-cpus=1.5"],
                 ["head", "--port", "6380", "--num-gpus"], ["worker", "127.0.0.1:1", "--num-gpus", "x"]):
        start = time.monotonic()
        bad = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60, env=env)
        assert bad.returncode == 2 and "is not a whole number >= 0" in bad.stderr, (args, bad.stderr)
        assert "start" not in bad.stdout and time.monotonic() - start < 10
    good = subprocess.run(["bash", str(SCRIPT), "head", "--num-gpus", "0", "--num-cpus=4"], capture_output=True,
                          text=True, timeout=60, env=env)
    assert good.returncode == 0 and "--num-gpus 0 --num-cpus=4" in good.stdout, good.stderr


def test_a_worker_without_its_address_is_refused_at_once():
    env = {**os.environ, "RAY": "echo", "RAY_AUTH_TOKEN": "t", "CONNECT_TIMEOUT_S": "30"}
    start = time.monotonic()
    bad = subprocess.run(["bash", str(SCRIPT), "worker", "--num-gpus", "2"], capture_output=True, text=True,
                         timeout=60, env=env)
    assert bad.returncode == 2 and "give the head's address first" in bad.stderr, bad.stderr
    assert time.monotonic() - start < 10


def test_the_head_waits_ready_timeout_s_seconds_not_tries(tmp_path):
    # `ray status` takes a second or two: a wait of READY_TIMEOUT_S tries took ~3x READY_TIMEOUT_S seconds
    fake = tmp_path / "ray"
    fake.write_text("#!/bin/bash\ncase \"$1\" in status) sleep 2; echo 'No cluster status.';; esac\nexit 0\n")
    fake.chmod(0o755)
    start = time.monotonic()
    run = subprocess.run(["bash", str(SCRIPT), "head"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "RAY": str(fake), "READY_TIMEOUT_S": "6"})
    took = time.monotonic() - start
    assert run.returncode == 0 and "warning" in run.stderr, run.stderr
    assert took < 6 + 2 + 3, took
