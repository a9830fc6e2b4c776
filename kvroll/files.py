"""The files kvroll writes beside a user's work: whole or not at all, with the user's permissions, and never over
another run's. Neutral ground (no torch, no other kvroll module) that the rollout, bench and trainer sides share.

    write_text(out / "report.md", text)                          # a temporary file of its own, then renamed
    with exclusive(out, "kvroll bench", "--out"):                # a second run into ``out`` is refused at once
        move_to_previous(out, found, "kvroll bench", "an earlier sweep")   # into out/previous-<UTC time>/
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

LOCK_NAME = ".kvroll.lock"


def umask() -> int:
    """This process's umask (read by setting it and back: the only way before Python 3.13's os.umask query)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text(path: str | Path, text: str) -> None:
    """``text`` at ``path``, whole or not at all: written to a temporary file of this process's own, then renamed
    (a name shared by two writers of one path let one rename the other's half-written file, or fail on it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o666 & ~umask())  # mkstemp's file is private (0600); a report is not
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def move_to_previous(folder: Path, paths: list[Path], who: str, what: str) -> Path | None:
    """Move ``paths`` (an earlier run's files and folders in ``folder``) to ``folder/previous-<UTC time>/``, said on
    stderr as ``who: folder held what; ...``. Returns that folder, or None when ``paths`` is empty."""
    if not paths:
        return None
    keep = folder / f"previous-{datetime.now(timezone.utc).strftime('%Y%m%dT%H%M%S.%fZ')}"
    keep.mkdir()
    for path in paths:
        os.replace(path, keep / path.name)
    print(f"{who}: {folder} held {what}; its files moved to {keep}", file=sys.stderr, flush=True)
    return keep


@contextlib.contextmanager
def exclusive(folder: Path, who: str, field: str):
    """Hold ``folder``'s lock (``.kvroll.lock``, an flock the system drops when the process ends, killed or not)
    for the ``with`` block; another process holding it is refused at once with a ``ValueError`` naming ``field``.

    Two runs writing one folder would each move the other's files to ``previous-*`` and interleave their logs. The
    lock file stays behind (removing it would let a third process lock a file the first still holds)."""
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            raise ValueError(f"{field} {folder} is in use by another {who} (pid {holder}); wait for it to finish, "
                             f"or pass another {field}.") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock
