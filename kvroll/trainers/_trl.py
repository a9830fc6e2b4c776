"""The TRL versions kvroll integrates with, checked once at import.

kvroll turns its rollouts on through private surfaces of TRL's trainers (DESIGN.md §2.5): the attributes
``use_vllm``, ``vllm_mode``, ``vllm_generation`` and ``_last_loaded_step`` and the ``generate`` / ``sync_weights``
calls made on ``vllm_generation``. They are stable within a minor version only, so the minor version is pinned
and ``tests/trainers/test_trl_contract.py`` checks those surfaces against the installed TRL.
"""
from __future__ import annotations

SUPPORTED_TRL = ">=1.16,<1.17"
_SUPPORTED_MINOR = (1, 16)


def _minor(version: str) -> tuple[int, int]:
    parts = version.split(".")
    return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)


def check_trl_version(version: str | None = None) -> str:
    """Raise ImportError naming the supported range unless TRL's version is in it; returns the version."""
    if version is None:
        try:
            import trl
        except ImportError as err:
            raise ImportError(f"kvroll.trainers needs TRL {SUPPORTED_TRL}: pip install 'trl{SUPPORTED_TRL}'") from err
        version = trl.__version__
    if _minor(version) != _SUPPORTED_MINOR:
        raise ImportError(
            f"kvroll.trainers supports TRL {SUPPORTED_TRL}, but TRL {version} is installed. kvroll relies on private "
            f"surfaces of TRL's GRPO/RLOO trainers that change between minor versions; install "
            f"'trl{SUPPORTED_TRL}'."
        )
    return version
