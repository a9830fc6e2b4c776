"""The checks every ``kvroll`` subcommand makes of its input before torch loads, and how it stops: ``UsageError``
(one line, exit status 2), the readers of config and prompt files, the model, policy-name and writable-path checks,
and ``interrupted`` for Ctrl-C. Nothing here imports torch, transformers or TRL.

    config = read_yaml("--config", path)          # a UsageError names the file and the line of a YAML error
    check_writable_dir("--output_dir", "runs/x")  # before any model loads
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path


class UsageError(ValueError):
    """Input a subcommand's checks refused: ``main`` prints it as one line and exits with status 2."""


def read_text(flag: str, path: str | Path) -> str:
    """The UTF-8 text of the file given as ``flag``; a ``UsageError`` names the file and what is wrong with it."""
    path = Path(path)
    try:
        return path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise UsageError(f"{flag} {path} does not exist.") from None
    except IsADirectoryError:
        raise UsageError(f"{flag} {path} is a directory; give a file.") from None
    except OSError as err:
        raise UsageError(f"{flag} {path} cannot be read ({err.strerror or err}).") from None
    except UnicodeDecodeError as err:
        raise UsageError(f"{flag} {path} is not UTF-8 text (byte {err.start}: {err.reason}); save it as UTF-8.") \
            from None


def read_yaml(flag: str, path: str | Path) -> dict:
    """The mapping of a YAML config file; a ``UsageError`` names the file (and the line of a syntax error)."""
    import yaml

    try:
        data = yaml.safe_load(read_text(flag, path))
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = f", line {mark.line + 1} column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise UsageError(f"{flag} {path} is not valid YAML ({problem}{line}).") from None
    if data is not None and not isinstance(data, dict):
        raise UsageError(f"{flag} {path} must hold a mapping of 'field: value' lines, not a {type(data).__name__}.")
    return data or {}


def read_jsonl_lines(flag: str, path: str | Path) -> list[tuple[int, object]]:
    """(line number, row) of each non-blank line, so that a caller's error about a row names the file's line."""
    rows = []
    for line_no, line in enumerate(read_text(flag, path).splitlines(), 1):
        if line.strip():
            try:
                rows.append((line_no, json.loads(line)))
            except json.JSONDecodeError as err:
                raise UsageError(f"{flag} {path}:{line_no} is not JSON ({err.msg}).") from None
    return rows


def check_model(flag: str, model: str, tokenizer: bool = True, gguf: bool = True) -> None:
    """``model`` is 'smollm2' or a local Hugging Face model directory (no hub is reachable), with a tokenizer where
    the command reads one from it; ``gguf=False`` where the command loads it with ``load_model`` (no GGUF)."""
    from kvroll.model_dir import model_dir_problem

    if model == "smollm2":
        return
    problem = model_dir_problem(model, tokenizer=tokenizer, gguf=gguf)
    if problem == "does not exist":
        raise UsageError(f"{flag} {model} does not exist; pass 'smollm2' or a local Hugging Face model directory.")
    if problem:
        raise UsageError(f"{flag} {model} {problem}.")


def check_policy_names(flag: str, names) -> None:
    """Each of ``names`` is a known policy (``kvroll.policies.known_policies``, no torch): a mistyped name is
    refused at once, not after torch loads."""
    from kvroll.policies import known_policies

    known = known_policies()
    for name in [names] if isinstance(names, str) else names:
        if name not in known:
            import difflib

            close = difflib.get_close_matches(str(name), known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else "."
            raise UsageError(f"{flag} {name!r} is not a known policy; choose one of {sorted(known)}{hint}")


def check_writable_dir(flag: str, path: str | Path) -> None:
    """``path`` is, or can be made, a directory this process may write in; nothing is created."""
    why = _why_unwritable(Path(path))
    if why:
        raise UsageError(f"{flag} {path} is not a writable directory: {why}.")


def check_writable_file(flag: str, path: str | Path) -> None:
    """``path`` can be written (its folder created if need be); nothing is created."""
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"{flag} {path} is a directory; give a file name.")
    why = ("no write permission on the file" if path.exists() and not os.access(path, os.W_OK)
           else _why_unwritable(path.parent))
    if why:
        raise UsageError(f"{flag} {path} cannot be written: {why}.")


def _why_unwritable(folder: Path) -> str | None:
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent  # the nearest existing folder decides
    if not existing.is_dir():
        return f"{existing} is a file"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"no write permission in {existing.resolve()}"
    try:  # os.access says yes to root everywhere; a file made and removed at once is the real test (/proc, EROFS)
        import tempfile

        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        return f"cannot create a file in {existing.resolve()} ({err.strerror or err})"
    return None


def tempfile_dir() -> str:
    import tempfile

    return tempfile.gettempdir()


def interrupted(command: str, where: str) -> int:
    """After Ctrl-C: one line saying where ``kvroll <command>`` stopped and what it kept; 130 (SIGINT's status).

        try:
            report = run_sweep(config, out, command)
        except KeyboardInterrupt:
            return interrupted("bench", f"after {done} of {total} points; the partial report is in {out}/report.md")
    """
    close_progress_bars()
    print(f"kvroll {command}: interrupted {where}", file=sys.stderr, flush=True)
    return 130


def close_progress_bars() -> None:
    """Close tqdm's open bars: each ends its line, so a message printed next starts a line of its own."""
    tqdm = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", ())):
        bar.close()
