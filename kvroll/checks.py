"""The integer test every public entry point's arguments share, and numpy numbers as Python's (numpy-only: any kvroll
module imports it)."""
from __future__ import annotations

import numpy as np


def as_int(value) -> int | None:
    """``value`` as a Python int if it is a Python or numpy integer, else None: a bool (Python's or numpy's), a
    float (even 2.0), a string or a tensor is None. Callers store the int: values travel to Ray workers and JSON."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return int(value)
    return None


def plain(value):
    """A numpy integer or float as a Python int or float (values travel to Ray workers and JSON); a numpy bool and any
    other value as it is, for the caller's checks to judge."""
    if isinstance(value, np.floating):
        return float(value)
    number = as_int(value)
    return value if number is None else number
