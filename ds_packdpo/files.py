"""Output files written whole or not at all (design invariant 5: nothing is partially written).

Plain Python, no torch: the data and packing stages use it too.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def atomic_write(path, write: Callable[[str], object]) -> None:
    """``write(temporary_path)`` beside ``path``, then a rename: a crash leaves the old file or none, never half."""
    path = Path(path)
    handle = tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp", delete=False)
    handle.close()
    try:
        write(handle.name)
        os.replace(handle.name, path)
    except BaseException:
        os.unlink(handle.name)
        raise
