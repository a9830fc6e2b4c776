"""A worker killed or hung in the middle of an NCCL weight sync, on GPUs: the sync recovers in bounded time.

    CUDA_VISIBLE_DEVICES=1,2 scripts/ray_cluster.sh head --num-gpus 2     # the workers' GPUs
    python benchmarks/ray_nccl_faults.py --address auto --out OUT          # the trainer's rank 0 on GPU 0

The CPU suite (``tests/ray/test_pool.py``) checks these faults on gloo. On NCCL a broadcast to a dead peer never
completes, so rank 0 waits for its device by polling and asks Ray between polls (``weight_sync.wait_device``). A
tiny random model (2 layers, ~0.4 MB of fp32 weights in 64 KB buckets) on cuda:0, two workers with one GPU each:

1. a clean sync;
2. worker 0 SIGKILLed when rank 0 reaches bucket 2 (the default ``worker_timeout_s`` of 600 s);
3. worker 1 SIGSTOPped at bucket 2 with ``worker_timeout_s`` 20 s (alive and silent: rank 0 gives up at 90% of it);
4. and 5. the same two faults after the workers answered ``join_group`` and before the communicator's set-up (the
   first collective of a formation, which blocks each rank until all have joined: ``SyncGroup.connect``);
6. a rollout after the faults.

Each fault: elapsed seconds, restarts per worker, whether the other worker was kept, the versions, and whether every
worker's checksums equal the trainer's. Writes ray_nccl_faults.json; exits 1 if a check fails.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kvroll import CompressionConfig, SamplingParams  # noqa: E402
from kvroll.rollout.pool import RolloutPool  # noqa: E402
from tests.conftest import tiny_model  # noqa: E402
from tests.ray.test_pool import _alive as alive, _stop_at as stop_at  # noqa: E402  (the CPU fault tests' trigger)


def at_setup(pool, worker, signum):
    """Send ``signum`` to worker ``worker`` when the pool's next formation has its workers' ``join_group`` answers and
    is about to set NCCL's communicator up (the probe ``_form_group`` runs): the worker never joins the set-up."""
    pid, state, probe = pool.health()[worker]["pid"], {}, pool.probe_bandwidth

    def probe_once(*args, **kwargs):
        del pool.probe_bandwidth  # the class's method again
        state["sent"] = pid
        os.kill(pid, signum)
        return probe(*args, **kwargs)

    pool.probe_bandwidth = probe_once
    return None, state


def fault(pool, name, worker, signum, timeout_s, results, setup=False):
    pool.timeout_s = timeout_s
    pool._drop_group()  # re-formed with this timeout
    pids, restarts = [h["pid"] for h in pool.health()], [s.restarts for s in pool.slots]
    fetch, state = at_setup(pool, worker, signum) if setup else stop_at(pool, worker, bucket=2, signum=signum)
    start = time.monotonic()
    row = {"worker": worker, "signal": signal.Signals(signum).name, "timeout_s": timeout_s,
           "at": "set-up" if setup else "bucket 2"}
    try:
        stats = pool.update_weights(fetch=fetch)
        row["stats"] = stats
    except Exception as err:  # reported: the check below fails
        row["error"] = f"{type(err).__name__}: {err}"[:500]
    finally:
        row["seconds"] = time.monotonic() - start
        if signum == signal.SIGSTOP and alive(pids[worker]):
            os.kill(pids[worker], signal.SIGKILL)
    other = 1 - worker
    row["killed_pid_matches"] = state.get("sent") == pids[worker]
    row["restarts"] = [s.restarts - r for s, r in zip(pool.slots, restarts)]
    row["other_kept"] = pool.health()[other]["pid"] == pids[other]
    row["versions"], row["pool_version"] = pool.versions(), pool.version
    row["checksums_ok"] = pool.checksums() == [pool.plan.checksums(pool.source)] * len(pool.slots)
    row["ok"] = "error" not in row and row["killed_pid_matches"] and row["restarts"][worker] == 1 \
        and row["restarts"][other] == 0 and row["other_kept"] and row["checksums_ok"] \
        and row["versions"] == [pool.version] * len(pool.slots)
    results[name] = row
    print(name, json.dumps(row, default=str), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default="auto")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--setup-only", action="store_true", help="only a worker killed before the set-up")
    parser.add_argument("--no-connect", action="store_true",
                        help="rank 0 sets the communicator up on its own thread, unwatched (as before connect)")
    parser.add_argument("--dump-after", type=float, default=0.0, help="print every thread's stack after S seconds")
    args = parser.parse_args()
    if args.dump_after:
        faulthandler.dump_traceback_later(args.dump_after)
    if args.no_connect:  # the same one-byte broadcast as the workers' connect, blocking this thread until all join
        from kvroll.rollout.weight_sync import SyncGroup

        def connect(self, device, watch=None, deadline_s=None):
            if not self._connected:
                self.broadcast(torch.zeros(1, dtype=torch.uint8, device=device)).wait()
                self._connected = True

        SyncGroup.connect = connect
    model = tiny_model("llama").to("cuda:0")
    pool = RolloutPool(model, CompressionConfig("longflow", 12), num_workers=2, gpus_per_worker=1, max_batch=4,
                       ray_address=args.address, bucket_bytes=1 << 16)
    results = {"device": torch.cuda.get_device_name(0), "backend": pool.backend, "buckets": None}
    try:
        start = time.monotonic()
        stats = pool.update_weights()
        results["buckets"] = len(pool.plan)
        results["clean"] = {"seconds": time.monotonic() - start, "stats": stats,
                            "checksums_ok": pool.checksums() == [pool.plan.checksums(model)] * 2}
        print("clean", results["clean"], flush=True)
        if not args.setup_only:  # --setup-only --no-connect: the set-up as before ``SyncGroup.connect``
            fault(pool, "killed", 0, signal.SIGKILL, 600.0, results)
            fault(pool, "hung", 1, signal.SIGSTOP, 20.0, results)
        fault(pool, "killed_at_setup", 0, signal.SIGKILL, 600.0, results, setup=True)
        if not args.setup_only:
            fault(pool, "hung_at_setup", 1, signal.SIGSTOP, 20.0, results, setup=True)
        prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13], [3, 3, 3]]
        rows = pool.generate(prompts, SamplingParams(max_new_tokens=16, temperature=1.0, seed=3), n=2)
        results["rollout_after"] = {"rows": len(rows), "in_order": [(c.prompt_index, c.sample_index) for c in rows]
                                    == [(i, s) for i in range(4) for s in range(2)],
                                    "lengths": sorted({len(c.token_ids) for c in rows})}
        print("rollout after", results["rollout_after"], flush=True)
    finally:
        pool.close()
        with open(os.path.join(args.out, "ray_nccl_faults.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)
    faults = ("killed_at_setup",) if args.setup_only else ("killed", "hung", "killed_at_setup", "hung_at_setup")
    ok = results["clean"]["checksums_ok"] and all(results.get(k, {}).get("ok") for k in faults) \
        and results["rollout_after"]["in_order"]
    print("ALL OK" if ok else "CHECK FAILED", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
