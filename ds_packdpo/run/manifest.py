"""A checkpoint that proves it is whole: ``manifest.json`` lists every file of the tag with its size and checksum.

The save writes it last (rank 0, after every rank's files are on disk), synced, before
``latest`` moves; a tag without one is a save that did not finish.  Checking a tag reads
every byte once (blake2b from hashlib, no extra dependency: 2-2.5 s per GB measured, README), so a
file that is missing, truncated (a half-copied node) or altered is named before anything
loads it.  The ``universal/`` form a resume at another layout adds later has its own
commit (an atomic rename) and is not part of the manifest.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..files import atomic_write

MANIFEST_FILE = "manifest.json"
MANIFEST_VERSION = 1
ALGORITHM = "blake2b-128"
# made after the save, by the first resume at another layout (run/universal.py), or left by one that died
NOT_LISTED = ("universal", "latest_universal", ".universal.")


def checksum(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, lambda: hashlib.blake2b(digest_size=16)).hexdigest()


def listed_files(tag_dir: Path) -> list[Path]:
    """The files of a tag that its manifest covers, sorted."""
    return sorted(path for path in tag_dir.rglob("*") if path.is_file() and path.name != MANIFEST_FILE
                  and not path.relative_to(tag_dir).parts[0].startswith(NOT_LISTED))


def write_manifest(tag_dir: Path) -> dict:
    """Reads every file of the tag and writes ``manifest.json`` (atomically, synced); returns what it wrote."""
    files = {str(path.relative_to(tag_dir)): {"size": path.stat().st_size, "checksum": checksum(path)}
             for path in listed_files(tag_dir)}
    manifest = {"version": MANIFEST_VERSION, "algorithm": ALGORITHM, "files": files}
    atomic_write(tag_dir / MANIFEST_FILE,
                 lambda temporary: Path(temporary).write_text(json.dumps(manifest, indent=1) + "\n"))
    return manifest


def read_manifest(tag_dir: Path) -> dict | None:
    try:
        manifest = json.loads((tag_dir / MANIFEST_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    ok = isinstance(manifest, dict) and manifest.get("version") == MANIFEST_VERSION and \
        manifest.get("algorithm") == ALGORITHM and isinstance(manifest.get("files"), dict)
    return manifest if ok else None


def has_manifest(tag_dir: Path) -> bool:
    return (tag_dir / MANIFEST_FILE).is_file()


def total_bytes(tag_dir: Path) -> int | None:
    """The size of a checkpoint from its manifest (None without one)."""
    manifest = read_manifest(tag_dir)
    return sum(entry["size"] for entry in manifest["files"].values()) if manifest else None


def manifest_problem(tag_dir: Path) -> str | None:
    """Why the tag is not whole, or None: every file its manifest lists is there, of its size and checksum (sizes
    first: a truncation costs no read)."""
    if not has_manifest(tag_dir):
        return f"no {MANIFEST_FILE} (its save did not finish)"
    manifest = read_manifest(tag_dir)
    if manifest is None:
        return f"unreadable {MANIFEST_FILE}"
    entries = manifest["files"]
    for name, entry in entries.items():
        path = tag_dir / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != entry["size"]:
            return f"{name} is truncated or grew ({size} bytes, the manifest says {entry['size']})"
    for name, entry in entries.items():
        if checksum(tag_dir / name) != entry["checksum"]:
            return f"{name} was altered (its checksum differs from the manifest's)"
    return None
