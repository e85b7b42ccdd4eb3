"""Output files written whole or not at all (design invariant 5: nothing is partially written), and durably.

A rename makes a write atomic; only an ``fsync`` of the file and then of its folder makes
it (and the rename) survive a power loss: without it a pointer such as a checkpoint's
``latest`` could reach the disk before the files it names.  Every writer here syncs.
Plain Python, no torch: the data and packing stages use it too.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from .errors import InputError


def fsync_dir(path) -> None:
    """Makes the entries of folder ``path`` (files created, renamed or removed in it) durable."""
    handle = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def fsync_tree(path) -> None:
    """Makes a file, or every file and folder below a folder (itself included), durable on disk."""
    path = Path(path)
    if not path.is_dir():
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())
        return
    for folder, _, files in os.walk(path, topdown=False):  # a folder after what it holds
        for name in files:
            fsync_tree(Path(folder) / name)
        fsync_dir(folder)


def _umask() -> int:
    """This process's umask (the OS offers no read alone: set and put back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(path) -> None:
    """A file, or every file and folder below a folder (itself included), with the permissions the user's umask gives
    new ones (0666, or 0777 for folders and executables, less the umask): a temporary file (mkstemp's) and what
    safetensors writes are 0600, so others could not read an export in a shared cluster folder."""
    mask = _umask()
    path = Path(path)
    for entry in [path, *path.rglob("*")] if path.is_dir() else [path]:
        mode = entry.lstat().st_mode
        if entry.is_symlink():
            continue
        full = 0o777 if entry.is_dir() or mode & 0o111 else 0o666
        os.chmod(entry, full & ~mask)


def atomic_write(path, write: Callable[[str], object]) -> None:
    """``write(temporary_path)`` beside ``path``, synced, then a rename: a crash leaves the old file or none, never
    half, and a power loss after the return cannot undo it.  The file follows the umask (:func:`follow_umask`)."""
    path = Path(path)
    handle = tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp", delete=False)
    handle.close()
    try:
        write(handle.name)
        follow_umask(handle.name)
        fsync_tree(handle.name)
        os.replace(handle.name, path)
    except BaseException:
        os.unlink(handle.name)
        raise
    fsync_dir(path.parent)


def atomic_folder(out, fill: Callable[[Path], object]) -> None:
    """``fill(staging_folder)`` beside ``out``, synced, then renamed to ``out`` (an existing ``out`` is replaced):
    readers see the old folder or the complete new one, never a part.  Its files and folders follow the umask."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
    staging.mkdir()  # with the umask's permissions, as out would have (mkdtemp's are 0700)
    try:
        fill(staging)
        follow_umask(staging)
        fsync_tree(staging)
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=out.parent))
            out.rename(old / out.name)
            staging.rename(out)
            shutil.rmtree(old)
        else:
            staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    fsync_dir(out.parent)


def check_creatable_folder(path, flag: str, named=None) -> None:
    """A folder a run will write into (made if missing): its nearest existing ancestor is a folder this process can
    make a folder in, so that no rank dies on the mkdir.  ``named``: the path the error names (a file in it)."""
    path = Path(path).expanduser()
    named = path if named is None else named
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is None:
        return
    if not existing.is_dir():
        raise InputError(f"{flag} {named}: {existing} is not a folder")
    try:  # a real folder made and removed: permissions, read-only mounts, /proc-like trees alike
        os.rmdir(tempfile.mkdtemp(prefix=".ds_packdpo_probe_", dir=existing))
    except OSError as error:
        where = "" if existing == named else f" (in {existing})"
        raise InputError(f"{flag} {named}: cannot write there{where}: {error.strerror}") from None


def replaces(output, path) -> bool:
    """Whether writing ``output`` (a file or a folder written whole) replaces ``path``: it is ``path`` or holds it."""
    target = Path(output).expanduser()
    target = target.parent.resolve() / target.name if target.name else target.resolve()  # a link is replaced itself
    path = Path(path).expanduser().resolve()
    return target == path or target in path.parents


def check_not_an_input(path, flag: str, reads) -> None:
    """An output that is, or holds, a path the command reads (``reads``) would replace it: ``prepare --out`` of its own
    dataset, ``pack-stats --plan-out`` (always replaced) of it, a bench folder written over its dataset's folder."""
    for source in reads:
        if replaces(path, source):
            raise InputError(f"{flag} {path}: would replace {source}, which this command reads; write elsewhere")


def check_output_folder(path, flag: str, overwrite: bool, reads=()) -> None:
    """A folder written whole beside itself and renamed into place (:func:`atomic_folder`), checked before any work:
    neither one of the paths the command reads (``reads``) nor a folder holding one (--overwrite replaced a bench
    folder with its own report), not a file, empty unless ``overwrite``, beside a folder this process can write in."""
    path = Path(path)
    check_not_an_input(path, flag, reads)
    if path.exists() and not path.is_dir():
        raise InputError(f"{flag} {path}: exists and is not a folder")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise InputError(f"{flag} {path}: folder is not empty (pass --overwrite to replace it)")
    check_creatable_folder(path.parent, flag, named=path)  # the folder is filled beside it, then renamed


def check_output_file(path, flag: str, overwrite: bool, reads=()) -> None:
    """An output file's path, checked before any work: not an input, not a folder, in a folder, no silent
    overwrite."""
    path = Path(path)
    check_not_an_input(path, flag, reads)
    if path.is_dir():
        raise InputError(f"{flag} {path}: is a folder; give the file to write")
    if path.parent.exists() and not path.parent.is_dir():
        raise InputError(f"{flag} {path}: {path.parent} is not a folder")
    check_creatable_folder(path.parent, flag, named=path)
    if path.exists() and not overwrite:
        raise InputError(f"{flag} {path}: file exists (pass --overwrite to replace it)")
