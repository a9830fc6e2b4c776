"""examples/slurm_ray.sbatch's shell logic under stand-ins for Slurm's ``scontrol`` and ``srun`` (and ``sleep``): the
head and the trainer on the first node, a Ray worker on each other node, one rollout worker per GPU of those nodes
(a typed ``--gpus-per-node=h100:4`` too), a failing ``ray status`` reported and not fatal, one node refused."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

SBATCH = Path(__file__).parents[1] / "examples" / "slurm_ray.sbatch"


def run_job(tmp_path: Path, hosts: list[str], gpus_per_node: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stubs = {
        "scontrol": f"printf '%s\\n' {' '.join(hosts)}",
        # srun: log its arguments; 'hostname -I' answers an address; 'status' fails (a cluster still starting)
        "srun": 'echo "$*" >> "$SRUN_LOG"\n'
                'for a in "$@"; do [ "$a" = hostname ] && { echo "10.0.0.1 192.168.0.1"; exit 0; }; done\n'
                'for a in "$@"; do [ "$a" = status ] && exit 1; done\nexit 0',
        "sleep": "exit 0",
    }
    for name, body in stubs.items():
        (bin_dir / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "srun.log"
    log.touch()
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SRUN_LOG": str(log),
           "SLURM_JOB_NODELIST": "stub", "SLURM_GPUS_PER_NODE": gpus_per_node, "SLURM_SUBMIT_DIR": str(tmp_path)}
    done = subprocess.run(["bash", str(SBATCH)], capture_output=True, text=True, env=env, timeout=60)
    return done, log.read_text().splitlines()


def test_three_nodes_with_typed_gpus(tmp_path):
    done, calls = run_job(tmp_path, ["node01", "node02", "node03"], "h100:4")
    assert done.returncode == 0, done.stderr
    assert "ray status failed" in done.stderr
    head = [c for c in calls if "ray_cluster.sh head" in c]
    workers = [c for c in calls if "ray_cluster.sh worker" in c]
    train = [c for c in calls if "kvroll train" in c]
    assert len(head) == 1 and "-w node01" in head[0] and "--num-gpus 0" in head[0]
    assert sorted(c.split("-w ")[1].split()[0] for c in workers) == ["node02", "node03"]
    assert all("10.0.0.1:6379 --block" in c for c in workers)
    assert len(train) == 1 and "-w node01" in train[0]
    assert "--kvroll_ray_address 10.0.0.1:6379 --kvroll_num_workers 8 --kvroll_gpus_per_worker 1" in train[0]
    stop = [i for i, c in enumerate(calls) if "ray_cluster.sh stop" in c]  # the daemons' sruns log in the background
    assert len(stop) == 1 and stop[0] > calls.index(train[0]) and "--nodes=3" in calls[stop[0]]


def test_one_node_is_refused_before_anything_starts(tmp_path):
    done, calls = run_job(tmp_path, ["node01"], "8")
    assert done.returncode == 2 and calls == []
    assert "1 node(s) allocated; it needs --nodes >= 2" in done.stderr
