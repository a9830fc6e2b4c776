"""The exit of a worker that ``torch.distributed.run`` starts (the 2-rank tests' workers): after its checks passed,
tear the gloo group down explicitly, then leave without the interpreter's teardown. There, native threads (gloo's,
the trainer's) have aborted a rank with "terminate called without an active exception" after both ranks had passed
(CI, sessions 1 and 4), even after ``destroy_process_group``.
"""
from __future__ import annotations

import os
import sys

import torch.distributed as dist


def exit_rank() -> None:
    """Barrier, destroy the process group (if one was made), flush stdout and stderr, ``os._exit(0)``. Call it only
    after every check passed: a failed check raises before it, and the rank exits non-zero as usual."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
