"""Output files written whole or not at all (design invariant 5: nothing is partially written).

Plain Python, no torch: the data and packing stages use it too.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from .errors import InputError


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


def check_output_file(path, flag: str, overwrite: bool) -> None:
    """An output file's path, checked before any work: not a folder, in a folder, no silent overwrite."""
    path = Path(path)
    if path.is_dir():
        raise InputError(f"{flag} {path}: is a folder; give the file to write")
    if path.parent.exists() and not path.parent.is_dir():
        raise InputError(f"{flag} {path}: {path.parent} is not a folder")
    if path.exists() and not overwrite:
        raise InputError(f"{flag} {path}: file exists (pass --overwrite to replace it)")
