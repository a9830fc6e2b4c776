"""``RewardPrinter``: the per-step line of ``kvroll train`` and its ``metrics.jsonl``.

    trainer.add_callback(RewardPrinter(Path("runs/grpo"), max_steps=10, resume_step=None))
"""
from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

from transformers import TrainerCallback

from kvroll.bench.run_report import training_row


def reward_parts(logs: dict) -> list[tuple[str, float]]:
    """(short label, mean) of each reward function in TRL's ``rewards/NAME/mean`` logs, in logged order:
    ``format_reward`` and ``final_answer_format_reward`` read "format", ``*correctness*`` "correct". A function that
    returned None for every row (TRL logs its mean as null) is left out."""
    parts = []
    for key, value in logs.items():
        if key.startswith("rewards/") and key.endswith("/mean") and value is not None:
            name = key[len("rewards/"):-len("/mean")]
            parts.append(("format" if "format" in name else "correct" if "correct" in name else name, value))
    return parts


class InterruptGuard(TrainerCallback):
    """Ctrl-C stops training even where Python drops its ``KeyboardInterrupt``.

    Python raises the interrupt in whatever frame runs when the signal is handled; inside a finalizer (a ``__del__``,
    a weakref callback) the exception is printed and dropped, and the run went on (once, on a loaded machine: 30
    steps past the Ctrl-C). This SIGINT handler raises as Python's does and remembers it; the trainer's next
    callback (a step's start or end, a log) raises it again if it was lost.

        with InterruptGuard() as guard:
            trainer.add_callback(guard)
            trainer.train()
    """

    def __init__(self):
        self.pending, self._previous = False, None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # only the main thread may set a handler
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def _handle(self, signum, frame):
        self.pending = True
        raise KeyboardInterrupt

    def _raise_if_lost(self, args, state, control, **kwargs):
        if self.pending:
            raise KeyboardInterrupt

    on_step_begin = on_substep_end = on_step_end = on_log = _raise_if_lost


class RewardPrinter(TrainerCallback):
    """Prints one line of rewards per logged step with a rollout and appends every logged step's logs to
    ``metrics.jsonl`` (PPO's steps between rollouts too: their time and their weight syncs). A rollout's line shows
    the sync before it, which PPO logs on the step before the rollout.

    A resumed run (``resume_step`` = the checkpoint's step) keeps the lines up to that step and appends after them;
    a fresh run starts the file empty.
    """

    def __init__(self, out_dir: Path, max_steps: int, resume_step: int | None = None):
        self.path, self.max_steps, self.rows, self.start = out_dir / "metrics.jsonl", max_steps, [], time.time()
        self.pending_sync = None  # a sync logged on a step without a rollout (PPO), shown on the next rollout's line
        out_dir.mkdir(parents=True, exist_ok=True)
        kept = []
        if resume_step is not None and self.path.is_file():
            kept = [line for line in self.path.read_text(errors="replace").splitlines()
                    if _resumed_line(line, resume_step)]
        self.path.write_text("".join(line + "\n" for line in kept))
        self.kept = len(kept)
        # a resumed run: the summary's halves and elapsed_s continue the kept steps', as the report reads them
        self.kept_rows = [json.loads(line) for line in kept]
        self.elapsed_before = max((row.get("elapsed_s", 0) for row in self.kept_rows
                                   if isinstance(row.get("elapsed_s", 0), (int, float))), default=0)

    def on_train_begin(self, args, state, control, **kwargs):
        if self.max_steps is None or self.max_steps <= 0:  # max_steps -1: the trainer's count from the epochs
            self.max_steps = state.max_steps

    @property
    def logged_steps(self) -> int:
        """Lines in ``metrics.jsonl``: those kept from the run resumed and this run's."""
        return self.kept + len(self.rows)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not training_row(logs):
            return
        row = {"step": state.global_step, "elapsed_s": round(self.elapsed_before + time.time() - self.start, 1),
               **logs}
        self.rows.append(row)
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if "reward" not in logs:  # a step between rollouts (PPO): logged, not printed
            self.pending_sync = logs.get("kvroll/sync_seconds", self.pending_sync)
            return
        sync = logs.get("kvroll/sync_seconds", self.pending_sync)
        self.pending_sync = None
        print(step_line(state.global_step, self.max_steps, logs, sync, row["elapsed_s"]), flush=True)

    def summary(self) -> None:
        rewarded = [r for r in self.kept_rows + self.rows if r.get("reward") is not None]  # as the report's
        if not rewarded:
            return
        half = max(1, len(rewarded) // 2)
        first = sum(r["reward"] for r in rewarded[:half]) / half
        last = sum(r["reward"] for r in rewarded[-half:]) / half
        print(f"kvroll train: done in {time.time() - self.start:.0f}s; mean reward first half {first:.3f}, "
              f"last half {last:.3f}; logs in {self.path.parent}", flush=True)


def step_line(step: int, max_steps, logs: dict, sync: float | None, elapsed_s: float) -> str:
    """One console line per rollout step: the reward (and its parts), then each figure the step logged, in this
    order; a figure not logged (TRL's own rollouts log no kvroll/* keys, RLOO no |dlogp|) is left out, not 'nan'."""
    get = logs.get
    reward = get("reward")  # null where every reward function returned None for every row (TRL)
    parts = [f"step {step:>3}/{max_steps}", "reward -" if reward is None else f"reward {reward:.3f}"]
    parts += [f"{label} {value:.2f}" for label, value in reward_parts(logs)]
    if get("completions/mean_length") is not None:
        parts.append(f"len {get('completions/mean_length'):.0f}")
    if get("kvroll/kv_bytes") is not None:
        full = get("kvroll/kv_bytes_full_equivalent")
        parts.append(f"KV {get('kvroll/kv_bytes') / 2**20:.1f} MiB"
                     + (f" (full {full / 2**20:.1f})" if full is not None else ""))
    if get("kvroll/evicted_tokens") is not None:
        parts.append(f"evicted {get('kvroll/evicted_tokens'):.0f}")
    if get("sampling/sampling_logp_difference/mean") is not None:
        parts.append(f"|dlogp| {get('sampling/sampling_logp_difference/mean'):.3f}")
    if get("kvroll/rollout_seconds") is not None:
        parts.append(f"rollout {get('kvroll/rollout_seconds'):.1f}s")
    if sync is not None:
        parts.append(f"sync {1000 * sync:.2f}ms")
    parts.append(f"elapsed {elapsed_s:.0f}s")
    return "  ".join(parts)


def _resumed_line(line: str, resume_step: int) -> bool:
    """Whether a line of the resumed run's metrics.jsonl is kept: a logged step at or before the checkpoint's. A line
    that is not such an object (one a killed run cut short) is dropped: the steps after the checkpoint are logged
    again anyway."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return False
    return isinstance(row, dict) and isinstance(row.get("step", 0), int) and row.get("step", 0) <= resume_step
