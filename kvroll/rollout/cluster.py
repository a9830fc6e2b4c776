"""Reaching a Ray cluster and reserving the workers' resources, each with an error in bounded time.

    connect("auto", timeout_s=30)        # None: join a running cluster, else start a local one
    group = reserve(num_workers=2, gpus_per_worker=1, timeout_s=60)      # a ready placement group

An unreachable address is an error naming it within ``timeout_s`` (Ray's own connect retries for minutes); asking
for more GPUs or CPUs than the cluster has is an error with both numbers, not a placement group pending forever.
These errors are ``ClusterError`` s (and ``ConnectionError``, ``ValueError`` or ``TimeoutError``). Joining by
HOST:PORT sends this machine's Ray token, as Ray does for 'auto' (see ``_token_auth_if_token``).
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from urllib.parse import urlparse


class ClusterError(Exception):
    """The Ray cluster could not be joined, or could not hold the workers; the message names the setting to fix."""


class ClusterConnectionError(ClusterError, ConnectionError):
    """No Ray cluster answered at the address within the timeout (or none was started here)."""


class ClusterTooSmallError(ClusterError, ValueError):
    """The cluster, as it stands, lacks the GPUs or CPUs the workers ask for: it can never be placed."""


class PlacementTimeoutError(ClusterError, TimeoutError):
    """The workers' placement group was not ready within the timeout (the resources are held by other work)."""


def connect(address: str | None = None, timeout_s: float = 30.0, num_cpus: int | None = None) -> str:
    """Join the cluster at ``address`` (``None``: the running one if any, else a new local one); returns how."""
    import ray

    if ray.is_initialized():
        if address not in (None, "", "auto") and not address.startswith("ray://"):
            _check_joined(address, ray.get_runtime_context().gcs_address)
        return "already connected"
    env = {"RAY_DEDUP_LOGS": "0"}
    for key, value in env.items():
        os.environ.setdefault(key, value)
    if address in (None, "", "auto"):
        env_address = os.environ.get("RAY_ADDRESS", "")
        if env_address not in ("", "auto", "local"):  # Ray joins it and retries for minutes: check it as an address
            try:
                _check_address(env_address, timeout_s)
            except (ClusterError, ValueError) as err:
                raise ClusterConnectionError(f"the environment variable RAY_ADDRESS={env_address!r} (which Ray "
                                             f"joins when kvroll_ray_address is {address!r}): {err} Unset "
                                             "RAY_ADDRESS or fix it.") from None
        if _running_cluster(address):
            _init(ray, address="auto", timeout_s=timeout_s)
            return "joined the running cluster"
        if address == "auto" or env_address == "auto":
            if address != "auto":
                raise ClusterConnectionError("the environment variable RAY_ADDRESS='auto' (which Ray joins when "
                                             "kvroll_ray_address is unset) found no running Ray cluster on this "
                                             "machine; unset RAY_ADDRESS to start a local one, or start one with "
                                             "`scripts/ray_cluster.sh head`.")
            raise ClusterConnectionError("kvroll_ray_address='auto' found no running Ray cluster on this machine; "
                                         "start one with `scripts/ray_cluster.sh head`, or leave the address unset "
                                         "to start a local one.")
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=True)
        return "started a local cluster"
    _check_address(address, timeout_s)
    _init(ray, address=address, timeout_s=timeout_s)
    return f"joined {address}"


def _check_address(address: str, timeout_s: float) -> None:
    """Before Ray joins ``address`` (and retries for minutes): its form, that it answers, this machine's token for a
    head with token authentication, and a join from a child process stopped at the deadline."""
    host, port = _host_port(address)
    _check_reachable(address, host, port, timeout_s)
    _token_auth_if_token()
    _probe(address, timeout_s)


def reserve(num_workers: int, gpus_per_worker: float, strategy: str = "PACK", timeout_s: float = 60.0):
    """A ready placement group of ``num_workers`` bundles {CPU: 1, GPU: gpus_per_worker}."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    total = ray.cluster_resources()
    need = {"GPU": gpus_per_worker * num_workers, "CPU": float(num_workers)}
    for resource, amount in need.items():
        have = float(total.get(resource, 0.0))
        if amount > have + 1e-9:
            raise ClusterTooSmallError(f"the rollout workers need {amount:g} {resource}s (kvroll_num_workers="
                                       f"{num_workers} x {gpus_per_worker if resource == 'GPU' else 1:g} each) but "
                                       f"the Ray cluster has {have:g}; lower kvroll_num_workers / "
                                       "kvroll_gpus_per_worker or add nodes.")
    bundle = {"CPU": 1.0, **({"GPU": float(gpus_per_worker)} if gpus_per_worker else {})}
    group = placement_group([dict(bundle) for _ in range(num_workers)], strategy=strategy)
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        raise PlacementTimeoutError(f"the rollout workers' placement group ({num_workers} x {_plain(bundle)}, "
                                    f"strategy {strategy}) was not placed within {timeout_s:g}s; the cluster has "
                                    f"{_plain(ray.cluster_resources())}, of which {_plain(ray.available_resources())} "
                                    "free (other jobs or actors hold the rest). Free resources or ask for fewer "
                                    "workers.")
    return group


def _plain(resources: dict) -> str:
    """CPUs and GPUs as 'CPU 2, GPU 0' (0 where none is listed): Ray's dicts also name every placement group's
    bundles, memory and node ids, and leave out a resource none of which is free."""
    return ", ".join(f"{name} {float(resources.get(name, 0.0)):g}" for name in ("CPU", "GPU"))


def _init(ray, address: str, timeout_s: float) -> None:
    try:
        ray.init(address=address, log_to_driver=True)
    except ConnectionError as err:
        raise ClusterConnectionError(f"kvroll_ray_address={address!r}: could not join the Ray cluster ({err}).") \
            from err


def _probe(address: str, timeout_s: float) -> None:
    """Join the cluster from a child process first: Ray's own connect retries for minutes against a port that
    answers but is no Ray head (a proxy, another service); a child can be stopped at the deadline."""
    code = "import sys, ray; ray.init(address=sys.argv[1], log_to_driver=False); ray.shutdown()"
    try:
        done = subprocess.run([sys.executable, "-c", code, address], capture_output=True, text=True,
                              timeout=max(timeout_s, 15.0))
    except subprocess.TimeoutExpired:
        raise ClusterConnectionError(f"kvroll_ray_address={address!r} answers but no Ray cluster could be joined "
                                     f"there within {max(timeout_s, 15.0):g}s; check the address (the head's GCS "
                                     "port, 6379 by default) and that `ray status` works on the head. If the head "
                                     "uses token authentication (scripts/ray_cluster.sh turns it on), "
                                     f"{AUTH_HELP}.") from None
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or ["no output"]
        auth = [line for line in lines if any(word in line for word in AUTH_WORDS)]
        if auth:  # the decisive line; the last one is only ray.init's "Failed to connect"
            refusal = auth[-1].strip().split(". Ensure")[0][:300]  # Ray's own advice follows; ours is below
            raise ClusterConnectionError(f"kvroll_ray_address={address!r}: joining the Ray cluster failed: it uses "
                                         f"token authentication and refused this machine ({refusal}); {AUTH_HELP}.")
        raise ClusterConnectionError(f"kvroll_ray_address={address!r}: joining the Ray cluster failed ({lines[-1]}).")


# Ray 2.60's token authentication, which scripts/ray_cluster.sh turns on (RAY_AUTH_MODE=token): what a refusal says,
# and what a machine joining by HOST:PORT needs.
AUTH_WORDS = ("InvalidAuthToken", "AuthenticationError", "Authentication token", "authentication token")
AUTH_HELP = ("this machine needs the head's token, in ~/.ray/auth_token (copy the head's file, or share the home "
             "directory) or in the RAY_AUTH_TOKEN environment variable")


def _token_auth_if_token() -> None:
    """Send this machine's Ray token when joining by address, as Ray itself does only for 'auto'.

    A head started by ``scripts/ray_cluster.sh`` requires token authentication, but Ray 2.60 enables it on the
    client side for an explicit address only when ``RAY_AUTH_MODE=token`` is set. With the variable unset and a token
    at hand (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``), set it, for the probe and this
    process; a cluster without authentication ignores the token. An explicit ``RAY_AUTH_MODE`` is left alone.
    """
    if os.environ.get("RAY_AUTH_MODE") is not None or not _has_token():
        return
    os.environ["RAY_AUTH_MODE"] = "token"
    try:
        from ray._raylet import Config

        Config.initialize("")  # Ray caches its config: re-read, so this process sees token mode too
    except Exception:  # a private surface: the probe (a child) sees the variable anyway
        pass


def _has_token() -> bool:
    try:
        from ray._raylet import AuthenticationTokenLoader

        return bool(AuthenticationTokenLoader.instance().has_token(ignore_auth_mode=True))
    except Exception:  # a private surface: look where Ray looks
        path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
        return bool(os.environ.get("RAY_AUTH_TOKEN")) or os.path.isfile(path)


def _check_joined(address: str, joined: str) -> None:
    """An explicit ``address`` must name the cluster this process has already joined (GCS address ``joined``)."""
    host, port = _host_port(address)
    joined_host, _, joined_port = joined.rpartition(":")
    try:
        resolved = socket.gethostbyname(host)
    except OSError:
        resolved = host
    loopback = resolved.startswith("127.") or host == "localhost"  # this machine: any of its addresses
    if not ((loopback or joined_host in (host, resolved)) and str(port) == joined_port):
        raise ClusterConnectionError(f"kvroll_ray_address={address!r}, but this process is already connected to the "
                                     f"Ray cluster at {joined} (ray.init ran before); call ray.shutdown() first, or "
                                     "leave kvroll_ray_address unset to use it.")


def _running_cluster(address: str | None = None) -> bool:
    """Whether ``connect(address)`` (None / '' / 'auto') has a running cluster to join."""
    if os.environ.get("RAY_ADDRESS", "") not in ("", "auto", "local"):
        return True
    if os.environ.get("RAY_ADDRESS") == "local" and address != "auto":  # unset: Ray starts a new local cluster
        return False
    try:
        from ray._private.services import find_gcs_addresses

        return bool(find_gcs_addresses())
    except Exception:  # a private helper: its absence only means "start a local cluster"
        return False


def _host_port(address: str) -> tuple[str, int]:
    parsed = urlparse(address if "://" in address else f"ray://{address}")
    if not parsed.hostname:
        raise ValueError(f"kvroll_ray_address={address!r} is invalid: use HOST:PORT (e.g. 10.0.0.1:6379), "
                         "'auto', or leave it unset.")
    default = 10001 if address.startswith("ray://") else 6379
    return parsed.hostname, parsed.port or default


def _check_reachable(address: str, host: str, port: int, timeout_s: float) -> None:
    try:
        with socket.create_connection((host, port), timeout=min(timeout_s, 10.0)):
            return
    except OSError as err:
        raise ClusterConnectionError(f"kvroll_ray_address={address!r} is unreachable ({host}:{port}: {err}); start "
                                     "the head with `scripts/ray_cluster.sh head` and pass the address it prints, "
                                     "or leave kvroll_ray_address unset for a local cluster.") from None
