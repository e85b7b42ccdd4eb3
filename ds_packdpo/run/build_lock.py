"""Where torch's JIT extensions are built, and their stale build locks, which would hang every later launch with no
output.

DeepSpeed JIT-builds its CPU ``deepspeed_shm_comm`` extension inside
``deepspeed.init_distributed`` through ``torch.utils.cpp_extension``, whose lock is a
plain file, ``<extensions root>/[py311_cpu/]<name>/lock``, created with ``O_EXCL`` and
held open by the building process until it is removed.  A builder that is killed
leaves the file behind, and every later build of that extension waits for it to
disappear, forever.  Nothing can ever release such a lock, so it is removed (with a
warning naming it) rather than refused: refusing would only make the user delete it.

A lock is stale when no process has it open and it is older than :data:`MIN_AGE_S` (the
builder closes its descriptor just before removing the file); where ``/proc`` cannot tell
(not Linux), when it is older than :data:`STALE_AFTER_S`.  Plain Python, no torch: the
front command runs it before the launch, and every rank before its process group.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

STALE_AFTER_S = 300.0  # a build of deepspeed_shm_comm takes well under a minute; used only without /proc
MIN_AGE_S = 10.0
LOCK_NAME = "lock"


def extensions_root() -> Path:
    """Where torch builds its extensions: $TORCH_EXTENSIONS_DIR, else its user cache folder (torch._appdirs)."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(cache) / "torch_extensions"


def _open_files() -> set[str] | None:
    """Every file some process we may inspect holds open (the targets of /proc/PID/fd/*); None without /proc."""
    proc = Path("/proc")
    if not (proc / "self" / "fd").is_dir():
        return None
    held = set()
    for fd_dir in proc.glob("[0-9]*/fd"):
        try:
            held.update(os.readlink(fd) for fd in fd_dir.iterdir())
        except OSError:  # the process ended, or is not ours
            continue
    return held


def stale_locks(root: Path | None = None, now: float | None = None) -> dict[Path, int]:
    """The build locks under ``root`` (``<name>/lock`` or ``<py_cpu>/<name>/lock``) that no live builder holds,
    with their inode numbers."""
    root = extensions_root() if root is None else root
    locks = [*root.glob(f"*/{LOCK_NAME}"), *root.glob(f"*/*/{LOCK_NAME}")]
    if not locks:
        return {}
    held = _open_files()
    now = time.time() if now is None else now
    stale = {}
    for lock in locks:
        try:
            info = lock.stat()
        except FileNotFoundError:  # its builder just finished
            continue
        age = now - info.st_mtime
        unheld = held is not None and str(lock.resolve()) not in held
        if (unheld and age > MIN_AGE_S) or (held is None and age > STALE_AFTER_S):
            stale[lock] = info.st_ino
    return stale


def remove_stale_locks(root: Path | None = None) -> list[Path]:
    """Removes the stale build locks, one warning line each on stderr; returns them."""
    removed = []
    for lock, inode in stale_locks(root).items():
        try:
            if lock.stat().st_ino != inode:  # another rank removed it and a new build took the lock since
                continue
            lock.unlink()
        except FileNotFoundError:
            continue
        removed.append(lock)
        print(f"warning: removed the stale torch extension build lock {lock} (its builder is gone; every "
              f"build of {lock.parent.name} would wait for it forever)", file=sys.stderr)
    return removed


def venv_extensions_dir() -> str | None:
    """A build folder of this Python environment (``<venv>/torch_extensions``), None outside a venv.

    torch's default folder is shared by every environment of the user, while DeepSpeed's build key
    holds the environment's path: two checkouts then rebuild the extension for each other.
    """
    return os.path.join(sys.prefix, "torch_extensions") if sys.prefix != sys.base_prefix else None


COMM_OP = "deepspeed_shm_comm"  # DeepSpeed's CPU communication op, JIT-built by init_distributed on CPU
BUILD_ESTIMATE = "about 1-3 minutes"  # 40 s on an idle 2-core machine, ~2.5 min under `make install`'s load


def use_venv_extensions() -> None:
    """``TORCH_EXTENSIONS_DIR`` of this process and of the ranks it starts: the user's, else this venv's folder, where
    ``make install`` (and every earlier run of this venv) built DeepSpeed's CPU comm op.  Without it a plain
    ``ds-packdpo train`` built the op again, silently, in torch's default folder."""
    if not os.environ.get("TORCH_EXTENSIONS_DIR") and venv_extensions_dir():
        os.environ["TORCH_EXTENSIONS_DIR"] = venv_extensions_dir()


def say_if_comm_op_unbuilt() -> bool:
    """One line when DeepSpeed's CPU comm op is not built under :func:`extensions_root` yet (the ranks about to start
    build it, saying nothing themselves); whether it said so."""
    root = extensions_root()
    if [*root.glob(f"{COMM_OP}/{COMM_OP}*.so"), *root.glob(f"*/{COMM_OP}/{COMM_OP}*.so")]:
        return False
    print(f"building DeepSpeed's CPU communication op ({COMM_OP}) into {root}: once, {BUILD_ESTIMATE}; later runs "
          f"load it", file=sys.stderr, flush=True)
    return True
