"""``kvroll.files``: whole writes, an earlier run's files kept aside, and one run at a time per folder (a second
process is refused while the first lives, and let in once it is killed)."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from kvroll.files import LOCK_NAME, exclusive, move_to_previous, umask, write_text

HOLDER = """
import sys, time
from pathlib import Path
from kvroll.files import exclusive
with exclusive(Path(sys.argv[1]), "kvroll bench", "--out"):
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_second_holder_in_this_process_is_refused_naming_the_field_then_let_in(tmp_path):
    with exclusive(tmp_path, "kvroll bench", "--out"):
        with pytest.raises(ValueError) as refused:
            with exclusive(tmp_path, "kvroll bench", "--out"):
                pytest.fail("two holders of one folder")
    assert str(refused.value) == (f"--out {tmp_path} is in use by another kvroll bench (pid {os.getpid()}); wait "
                                  "for it to finish, or pass another --out.")
    with exclusive(tmp_path, "kvroll bench", "--out"):  # released at the end of the block
        pass
    with pytest.raises(RuntimeError), exclusive(tmp_path, "kvroll bench", "--out"):
        raise RuntimeError("the block failed")
    with exclusive(tmp_path / "new" / "folder", "kvroll train", "output_dir"):  # released when the block raised
        assert (tmp_path / "new" / "folder" / LOCK_NAME).is_file()


def test_another_process_holds_the_lock_until_it_is_killed(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              env=env)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ValueError, match=f"in use by another kvroll bench \\(pid {holder.pid}\\)"):
            with exclusive(tmp_path, "kvroll bench", "--out"):
                pass
    finally:
        holder.kill()
        holder.wait(timeout=30)
    deadline = time.monotonic() + 10  # the kernel drops a killed process's flock with its descriptors
    while True:
        try:
            with exclusive(tmp_path, "kvroll bench", "--out"):
                break
        except ValueError:
            assert time.monotonic() < deadline, "a killed holder's lock was not released"
            time.sleep(0.1)


def test_move_to_previous_moves_files_and_folders_and_says_so(tmp_path, capsys):
    assert move_to_previous(tmp_path, [], "kvroll train", "an earlier run") is None
    (tmp_path / "metrics.jsonl").write_text("1\n")
    (tmp_path / "checkpoint-2").mkdir()
    (tmp_path / "checkpoint-2" / "w").write_text("w")
    (tmp_path / "other.txt").write_text("stays")
    keep = move_to_previous(tmp_path, [tmp_path / "metrics.jsonl", tmp_path / "checkpoint-2"], "kvroll train",
                            "an earlier run")
    assert keep.parent == tmp_path and keep.name.startswith("previous-")
    assert (keep / "metrics.jsonl").read_text() == "1\n" and (keep / "checkpoint-2" / "w").read_text() == "w"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([keep.name, "other.txt"])
    assert capsys.readouterr().err == f"kvroll train: {tmp_path} held an earlier run; its files moved to {keep}\n"


def test_write_text_gives_the_umask_s_permissions(tmp_path):
    old = os.umask(0o027)
    try:
        assert umask() == 0o027 and umask() == 0o027  # reading it leaves it as it was
        write_text(tmp_path / "sub" / "report.md", "text")
    finally:
        os.umask(old)
    assert (tmp_path / "sub" / "report.md").read_text() == "text"
    assert (tmp_path / "sub" / "report.md").stat().st_mode & 0o777 == 0o640
