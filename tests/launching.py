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


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def rank_module(module: str, *args: str) -> list[str]:
    """One rank without a launcher (world size 1): cheaper than ``deepspeed_module(1, ...)``."""
    return [sys.executable, "-m", module, *args]


def two_node_launch(workdir: Path, module: str, *args: str, env: dict) -> list[subprocess.Popen]:
    """Two deepspeed launchers with one rank each, as two nodes of one job (``--no_ssh --node_rank``).

    Unlike one launcher with two ranks (which terminates the others as soon as one
    rank dies), each node only learns of a dead peer through the collectives.
    Output of node N goes to ``workdir/nodeN.log``.
    """
    hostfile = workdir / "hostfile"
    hostfile.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    port = str(free_port())
    procs = []
    for node in (0, 1):
        cmd = [DEEPSPEED, "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(node), "--master_addr",
               "127.0.0.1", "--master_port", port, "--module", module, *args]
        with open(workdir / f"node{node}.log", "w") as log:
            procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs
