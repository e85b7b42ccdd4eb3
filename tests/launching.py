"""Starting real multi-process runs from tests: a free port per launch, one place that builds the command.

Every multi-rank test goes through here, so that launches never collide on a fixed
port (tests of several checkouts may run on one machine at once) and a failing
launch always shows the tail of its output.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
DEEPSPEED = str(BIN / "deepspeed")


def free_port() -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_env(**extra: str) -> dict:
    """The environment of a CPU run of this checkout (its ds_packdpo first on the path)."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": path, **extra}


def run(cmd: list[str], timeout: float = 600, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    """Runs ``cmd`` in the repository with the CPU environment; with ``check`` a non-zero exit fails the test."""
    kwargs.setdefault("env", cpu_env())
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, **kwargs)
    if check:
        assert proc.returncode == 0, f"exit {proc.returncode}: {' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def deepspeed_module(procs: int, module: str, *args: str) -> list[str]:
    """``deepspeed --num_gpus N --master_port P --module MODULE ARGS`` on a free port."""
    return [DEEPSPEED, "--num_gpus", str(procs), "--master_port", str(free_port()), "--module", module, *args]


def deepspeed_script(procs: int, script: str, *args: str) -> list[str]:
    """``deepspeed --num_gpus N --master_port P SCRIPT ARGS`` on a free port (a script path relative to the repo)."""
    return [DEEPSPEED, "--num_gpus", str(procs), "--master_port", str(free_port()), script, *args]


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]
