"""precompute-ref's work kept across a crash: the results of every few steps on disk, and a rerun continues from them.

Beside ``--out FILE`` the job keeps ``FILE.parts/``: ``manifest.json`` naming the settings the work is made under
(the reference fingerprint, the plan's, the layout, the row budget, the kernels: whatever changes a stored number or
which pairs make up step s), and one ``steps-A-B.npz`` shard per few steps (rank 0 writes each atomically, after
gathering the ranks' results).  A rerun with the same settings skips the steps its shards cover; with other settings
it refuses in one line, or starts over with ``--overwrite`` (said once).  The final file is built from the shards
alone, so a resumed job writes the bytes an uninterrupted one writes; the folder is removed once it is written.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..errors import InputError
from ..files import atomic_write

MAX_SHARDS = 200  # a crash loses at most 1/200 of the work (and a job writes at most ~200 small files)
MANIFEST = "manifest.json"
_SHARD = re.compile(r"steps-(\d+)-(\d+)\.npz")


def parts_folder(out) -> Path:
    return Path(f"{out}.parts")


def steps_per_shard(total_steps: int) -> int:
    return max(1, math.ceil(total_steps / MAX_SHARDS))


def _read_manifest(out) -> dict | None:
    try:
        return json.loads((parts_folder(out) / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError):  # no folder, or one left before its manifest was written: nothing kept
        return None


def _differing(stored: dict, settings: dict) -> list[str]:
    return sorted(k for k in set(stored) | set(settings) if stored.get(k) != settings.get(k))


def _describe(key: str, stored: dict, settings: dict) -> str:
    if isinstance(settings.get(key), (dict, str)) and len(json.dumps(settings.get(key))) > 40:  # a hash says nothing
        return key
    return f"{key} (kept {stored.get(key)}, this run {settings.get(key)})"


def check_parts(out, run_settings: Callable[[], dict], overwrite: bool) -> None:
    """Phase one: work kept under other settings is refused in one line, unless ``--overwrite`` starts over
    (``run_settings`` is called only when work is kept: it hashes the reference's weights)."""
    stored = _read_manifest(out)
    if stored is None or overwrite:
        return
    settings = run_settings()
    differing = _differing(stored, settings)
    if differing:
        raise InputError(f"--out {out}: {parts_folder(out).name} holds work of an interrupted run under another "
                         f"{', '.join(_describe(k, stored, settings) for k in differing)}; rerun with its settings to "
                         f"continue, or pass --overwrite to start over")


def kept_steps(out, settings: dict) -> int:
    """Rank 0, as the job starts: the steps whose results are kept (0: none), said once; work kept under other
    settings (``--overwrite``, else phase one refused it) is removed."""
    folder = parts_folder(out)
    stored = _read_manifest(out)
    if stored is not None and _differing(stored, settings):
        print(f"precompute-ref: {folder} held work under other settings; starting over (--overwrite)", flush=True)
        stored = None
    if stored is None:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        atomic_write(folder / MANIFEST, lambda tmp: Path(tmp).write_text(json.dumps(settings, indent=2) + "\n"))
        return 0
    done = _covered_steps(folder)
    if done:
        print(f"precompute-ref: continuing after step {done} of {settings['steps']} (the results of steps 1-{done} "
              f"kept in {folder})", flush=True)
    return done


def _shards(folder: Path) -> list[tuple[int, int, Path]]:
    return sorted((int(m[1]), int(m[2]), p) for p in folder.iterdir() if (m := _SHARD.fullmatch(p.name)))


def _covered_steps(folder: Path) -> int:
    """The last step of the unbroken run of shards from step 1 (a shard past a gap is not used)."""
    done = 0
    for first, last, _ in _shards(folder):
        if first != done + 1:
            break
        done = last
    return done


def write_shard(out, first_step: int, last_step: int, columns: dict[str, np.ndarray]) -> None:
    """The results of steps ``first_step..last_step`` (1-based, inclusive), whole or absent."""
    path = parts_folder(out) / f"steps-{first_step:07d}-{last_step:07d}.npz"

    def write(tmp):
        with open(tmp, "wb") as handle:  # a handle: np.savez would add ".npz" to the temporary name
            np.savez(handle, **columns)

    atomic_write(path, write)


def read_shards(out, keys: tuple[str, ...], last_step: int) -> dict[str, np.ndarray]:
    """Every kept result up to ``last_step``, the shards' columns concatenated in step order."""
    parts = [np.load(path) for first, last, path in _shards(parts_folder(out)) if last <= last_step]
    return {key: np.concatenate([part[key] for part in parts]) for key in keys}


def remove_parts(out) -> None:
    shutil.rmtree(parts_folder(out), ignore_errors=True)
