"""Starting real multi-process runs from tests: a free port per launch, one place that builds the command.

Every multi-rank test goes through here, so that launches never collide on a fixed
port (tests of several checkouts may run on one machine at once) and a failing
launch always shows the tail of its output.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch.distributed as dist

from ds_packdpo.run.build_lock import venv_extensions_dir
from ds_packdpo.run.hooks import HOOKS_ENV
from ds_packdpo.run.layout import free_port
from ds_packdpo.run.process_group import SHM_DIR, shm_buffer_name

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
DEEPSPEED = str(BIN / "deepspeed")
# A small fp32 run: 48 synthetic pairs, 12 per optimizer step, 3 steps (~20-25 s on 2 ranks).
# The data and layout of a small run (what precompute-ref acts on too), and its training.
SMALL_DATA = ["--synthetic-pairs", "48", "--global-batch-pairs", "12", "--max-length", "96", "--dtype", "fp32",
              "--no-progress", "--overwrite"]
SMALL_RUN = [*SMALL_DATA, "--max-steps", "3", "--lr", "1e-3"]


def cpu_env(**extra: str) -> dict:
    """The environment of a CPU run of this checkout (its ds_packdpo first on the path, the venv's tools on PATH),
    with the fault hooks (fault_hooks.py) installed in every rank: inert unless ``extra`` asks for a fault."""
    path = os.pathsep.join(p for p in (str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH")) if p)
    tools = os.pathsep.join(p for p in (str(BIN), os.environ.get("PATH")) if p)
    extensions = {"TORCH_EXTENSIONS_DIR": venv_extensions_dir()} if venv_extensions_dir() else {}
    return {**extensions, **os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": path, "PATH": tools,
            HOOKS_ENV: "fault_hooks", **extra}


def _failure(cmd: list[str], outcome: str, output: str) -> str:
    return f"{outcome}: {' '.join(map(str, cmd))}\n{output[-6000:]}"


def run(cmd: list[str], timeout: float = 600, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    """Runs ``cmd`` in the repository with the CPU environment; with ``check`` a non-zero exit fails the test."""
    kwargs.setdefault("env", cpu_env())
    # In a session of its own, so that a timeout ends the whole job, the ranks of a launcher included: a rank left
    # running would hold a core for the rest of the suite.
    with subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True, **kwargs) as popen:
        try:
            stdout, stderr = popen.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(popen.pid, signal.SIGKILL)
            stdout, stderr = popen.communicate()
            raise AssertionError(_failure(cmd, f"timed out after {timeout} s", f"{stdout[-3000:]}\n{stderr[-3000:]}"))
    proc = subprocess.CompletedProcess(cmd, popen.returncode, stdout, stderr)
    if check:
        output = f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        assert proc.returncode == 0, _failure(cmd, f"exit {proc.returncode}", output)
        left = shm_buffers_left(cmd)
        assert not left, f"{left} left in {SHM_DIR} by {' '.join(map(str, cmd))}"
    return proc


def shm_buffers_left(cmd: list[str]) -> list[str]:
    """The /dev/shm buffers of DeepSpeed's CPU comm op that a deepspeed launch on its own port left behind (each
    rank unlinks its own: run/process_group.release_shm_buffer)."""
    if "--master_port" not in cmd:
        return []
    port = cmd[cmd.index("--master_port") + 1]
    return sorted(path.name for path in SHM_DIR.glob(shm_buffer_name("*", port, "*")))


def run_together(cmds: list[list[str]], timeout: float = 600) -> None:
    """Runs the processes of one job at once (e.g. one launcher per simulated node) and waits for all.

    The first failure, or the timeout, kills the others (their whole process groups, ranks included),
    so a rank that waits for a dead peer never outlives the test.  Output goes to files: a full pipe
    would stall a process that its peers wait for.
    """
    with contextlib.ExitStack() as stack:
        logs = [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in cmds]
        procs = [subprocess.Popen(cmd, cwd=REPO, env=cpu_env(), stdout=log, stderr=subprocess.STDOUT, text=True,
                                  start_new_session=True) for cmd, log in zip(cmds, logs)]
        deadline = time.monotonic() + timeout
        try:
            while any(p.poll() is None for p in procs) and not any(p.poll() for p in procs):
                assert time.monotonic() < deadline, f"timed out after {timeout} s: {cmds}"
                time.sleep(0.5)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        for cmd, proc, log in zip(cmds, procs, logs):
            log.seek(0)
            assert proc.returncode == 0, _failure(cmd, f"exit {proc.returncode}", log.read())


def launch_script(name: str, *args: str) -> list[str]:
    """The command of one of the repository's launch scripts (``launch/NAME``)."""
    return [str(REPO / "launch" / name), *map(str, args)]


def ranks_module(procs: int, module: str, *args: str) -> list[str]:
    """The ranks of ``deepspeed --num_gpus N --module MODULE ARGS`` on a free port, started by rank_launcher.py
    (each rank gets the launcher's environment, without the launcher's seconds of start-up)."""
    return _ranks(procs, "--module", module, *args)


def ranks_script(procs: int, script: str, *args: str) -> list[str]:
    """As ranks_module, for a script path relative to the repository."""
    return _ranks(procs, script, *args)


def _ranks(procs: int, *target: str) -> list[str]:
    return [sys.executable, str(REPO / "tests" / "rank_launcher.py"), "--num_gpus", str(procs), "--master_port",
            str(free_port()), *target]


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


# One process runs MODULE.main for each case in turn (the environment updated per case): one import of torch,
# DeepSpeed and transformers instead of one per case, for checks that end in phase one, before any process group.
_MAIN_PER_CASE = """
import contextlib, importlib, io, json, os, sys
main = importlib.import_module(sys.argv[1]).main
for argv, env in json.loads(sys.argv[2]):
    before = dict(os.environ)
    os.environ.update(env)
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            code = main(argv)
        except SystemExit as exit:
            code = exit.code
    os.environ.clear()
    os.environ.update(before)
    print("CASE", json.dumps([code, stderr.getvalue()]))
"""


def main_per_case(module: str, cases: list[tuple[list[str], dict]]) -> list[tuple[int, str]]:
    """Exit code and standard error of ``MODULE.main(argv)`` with ``env`` set, per case, in one rank process."""
    proc = run([sys.executable, "-c", _MAIN_PER_CASE, module, json.dumps(cases)], timeout=300)
    results = [json.loads(line[len("CASE "):]) for line in proc.stdout.splitlines() if line.startswith("CASE ")]
    assert len(results) == len(cases), proc.stdout[-3000:]
    return [tuple(result) for result in results]


def rank_module(module: str, *args: str) -> list[str]:
    """One rank without a launcher (world size 1): cheaper than ``ranks_module(1, ...)``."""
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


def rank_check_main(main) -> None:
    """Runs ``main(OUT, FLAGS)`` of a rank check script (``tests/*_check.py``) from its command line, the launcher's
    ``--local_rank`` dropped."""
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    main(args[0], args[1:])


def write_rank_report(run, report: dict, out_path: str) -> None:
    """The end of a rank check script: the engines freed, rank 0 writes the figures as JSON, every rank waits."""
    run.close()
    if run.setup.spec.layout.rank == 0:
        with open(out_path, "w") as handle:
            json.dump(report, handle)
    dist.barrier()
