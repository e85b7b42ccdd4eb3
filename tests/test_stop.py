"""SIGTERM/SIGINT to ``ds-packdpo train``: every rank stops at one step boundary, saved, exit 7, resumable.

The multi-rank test goes through the front command and the real deepspeed launcher (the signal path is the
subject); the grace period is tested on a stand-in launcher that ignores SIGTERM (no ranks, no torch).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from launching import REPO, cpu_env, ranks_module, read_metrics, run
from test_checkpoint import RUN_SETTINGS, SCHEDULE, TIMING, flags

from ds_packdpo import cli
from ds_packdpo.errors import StoppedError
from ds_packdpo.run.checkpoint import LATEST
from fault_hooks import WAIT_FOR_STOP_ENV
from ds_packdpo.run.launch_group import LaunchOutcome, rank_processes
from ds_packdpo.run.layout import free_port
from ds_packdpo.run.manifest import MANIFEST_FILE

STOP_AT = 2  # the ranks wait for the signal as step 2 begins, then finish it and stop


def front(*args: str) -> list[str]:
    return [sys.executable, "-m", "ds_packdpo.cli", "train", "--num-procs", "2", *args]


def wait_for_step(metrics: Path, step: int, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.is_file() and any(r["step"] >= step for r in read_metrics(metrics)):
            return
        time.sleep(0.2)
    raise AssertionError(f"step {step} never logged (exit {proc.poll()})")


@pytest.mark.multirank
def test_sigint_to_train_stops_every_rank_saved_and_resume_continues(tmp_path, capsys, two_rank_run):
    """Ctrl-C's SIGINT (SIGTERM, a scheduler's, takes the same path; a rank's own SIGTERM: the next test): the ranks
    get the signal the front process received, so the stopped: line names it, and the launcher's error line of a
    rank's exit 7 (a clean stop) is not passed on.  Resumed, the job continues the uninterrupted run (conftest.py's,
    of the same flags and schedule) bitwise."""
    # no --save-steps: the stop alone saves
    argv = flags(tmp_path, "run", *SCHEDULE, "--save-dir", str(tmp_path / "ckpt"))
    with subprocess.Popen(front(*argv), cwd=REPO, env=cpu_env(**{WAIT_FOR_STOP_ENV: str(STOP_AT)}), text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True) as proc:
        try:
            wait_for_step(tmp_path / "run" / "metrics.jsonl", STOP_AT - 1, proc)
            sent = time.monotonic()
            proc.send_signal(signal.SIGINT)  # to the front process alone, as Ctrl-C in its terminal does
            stdout, stderr = proc.communicate(timeout=120)
            stop_s = time.monotonic() - sent
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == StoppedError.exit_code, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == (f"stopped: SIGINT after step {STOP_AT}, checkpoint saved; resume with "
                                               f"--resume auto (tag global_step{STOP_AT})"), stderr[-3000:]
    assert "another rank died" not in stderr and "Traceback" not in stderr, stderr[-3000:]
    assert "[ERROR]" not in stdout + stderr and "return code" not in stdout + stderr, stdout[-3000:]
    assert "\nplan: " in f"\n{stdout}", stdout[-3000:]  # rank 0's stdout still comes through
    assert stop_s < 20  # within the default --stop-grace-s: the ranks stopped themselves
    with capsys.disabled():
        print(f"\nstop: SIGINT as step {STOP_AT} ran; the ranks saved global_step{STOP_AT} and exited 7 "
              f"{stop_s:.1f} s after the signal")
    assert (tmp_path / "ckpt" / LATEST).read_text() == f"global_step{STOP_AT}"
    assert (tmp_path / "ckpt" / f"global_step{STOP_AT}" / MANIFEST_FILE).is_file()
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == list(range(1, STOP_AT + 1))

    # the rank launcher's ranks (no deepspeed launcher: the signal path ends above; the front command's own resume
    # of a checkpoint is test_checkpoint.py's killed-rank test)
    resumed = run(ranks_module(2, "ds_packdpo.train", *argv, "--resume", "auto"))
    assert f"resuming from {tmp_path / 'ckpt' / f'global_step{STOP_AT}'} at step {STOP_AT}\n" in resumed.stderr
    stopped_and_resumed = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in stopped_and_resumed] == list(range(1, 7))

    for got, want in zip(stopped_and_resumed, read_metrics(two_rank_run / "metrics.jsonl"), strict=True):
        keep = set(want) - set(TIMING) - RUN_SETTINGS
        assert {k: got[k] for k in keep} == {k: want[k] for k in keep}, got["step"]


@pytest.mark.multirank
def test_a_signal_to_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    """The flag is agreed (all-reduced) at every step boundary: rank 1 alone gets SIGTERM, both ranks save the same
    step and exit 7 (a rank that stopped alone would leave the other in its next collective)."""
    argv = flags(tmp_path, "run", "--save-dir", str(tmp_path / "ckpt"))
    with subprocess.Popen(ranks_module(2, "ds_packdpo.train", *argv), cwd=REPO, text=True,
                          env=cpu_env(**{WAIT_FOR_STOP_ENV: str(STOP_AT)}), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, start_new_session=True) as proc:
        try:
            wait_for_step(tmp_path / "run" / "metrics.jsonl", STOP_AT - 1, proc)
            (rank1,) = [rank for rank in rank_processes(proc.pid) if "--local_rank=1" in rank.cmdline()]
            rank1.send_signal(signal.SIGTERM)
            _, stderr = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == StoppedError.exit_code, stderr[-3000:]
    assert (f"stopped: a stop signal to another rank after step {STOP_AT}, checkpoint saved; resume with --resume "
            f"auto (tag global_step{STOP_AT})") in stderr.splitlines(), stderr[-3000:]
    tag = tmp_path / "ckpt" / f"global_step{STOP_AT}"
    assert (tag / MANIFEST_FILE).is_file() and len(list(tag.glob("*zero_pp_rank_*_optim_states.pt"))) == 2


FAKE_LAUNCHER = """#!{python}
import os, signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # ranks that never reach a step boundary
if {signal_parent}:
    time.sleep(0.5)
    os.makedirs(os.path.dirname({latest!r}), exist_ok=True)
    open({latest!r}, "w").write("global_step3")  # a checkpoint the run saved before
    open({stamp!r}, "w").write(str(time.time()))
    os.kill(os.getppid(), signal.SIGTERM)  # the scheduler's cancel, sent to the front process
time.sleep(60)
"""


def fake_launcher(tmp_path, monkeypatch, signal_parent: bool = False) -> Path:
    """A stand-in `deepspeed` first on PATH that ignores SIGTERM; with ``signal_parent`` it SIGTERMs the front
    process 0.5 s after it starts (a ``latest`` in tmp_path/ckpt first) and writes the time it did so to the
    returned file."""
    stamp = tmp_path / "signalled_at"
    launcher = tmp_path / "bin" / "deepspeed"
    launcher.parent.mkdir()
    launcher.write_text(FAKE_LAUNCHER.format(python=sys.executable, signal_parent=signal_parent, stamp=str(stamp),
                                             latest=str(tmp_path / "ckpt" / LATEST)))
    launcher.chmod(0o755)
    monkeypatch.setenv("PATH", f"{launcher.parent}{os.pathsep}{os.environ['PATH']}")
    return stamp


@pytest.mark.parametrize("grace_s", ["0.5", "2"])
def test_ranks_that_outlive_stop_grace_s_are_killed(tmp_path, monkeypatch, capsys, grace_s):
    """--stop-grace-s: after it the front process kills the launcher's whole session and says where to resume."""
    for key in cli.LAUNCHED_ENV:
        monkeypatch.delenv(key, raising=False)
    stamp = fake_launcher(tmp_path, monkeypatch, signal_parent=True)
    code = cli.main(["train", "--num-procs", "2", "--stop-grace-s", grace_s, "--save-dir", str(tmp_path / "ckpt"),
                     "--output-dir", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache"),
                     "--synthetic-pairs", "16", "--max-length", "64"])
    took = time.time() - float(stamp.read_text())
    assert code == StoppedError.exit_code
    assert float(grace_s) <= took < float(grace_s) + 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"stopped: SIGTERM; the ranks did not stop within --stop-grace-s {grace_s} s and were killed; resume with "
        f"--resume auto (tag global_step3)")


def test_a_second_signal_kills_at_once(tmp_path, monkeypatch, capsys):
    fake_launcher(tmp_path, monkeypatch)
    for delay, signum in ((0.5, signal.SIGINT), (1.0, signal.SIGINT)):  # Ctrl-C twice
        threading.Timer(delay, os.kill, (os.getpid(), signum)).start()
    started = time.monotonic()
    code = cli._launch([], 2, free_port(), "ds_packdpo.train", grace_s=30, save_dir=tmp_path / "none")
    assert code == StoppedError.exit_code and time.monotonic() - started < 3
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "stopped: SIGINT; a second signal killed the ranks; no checkpoint to resume from")


def test_the_front_process_exit_code_after_a_stop(tmp_path, capsys):
    """7 when the ranks stopped (rank 0 said so), a job that finished or failed on its own keeps its code, anything
    else (a launcher that a scheduler signalled too exits 1) is a stop said here with the newest checkpoint."""
    (tmp_path / LATEST).write_text("global_step4")
    assert cli.stop_status(LaunchOutcome(7, "SIGTERM"), 20, tmp_path) == 7
    assert [cli.stop_status(LaunchOutcome(code, "SIGTERM"), 20, tmp_path) for code in (0, 2, 5, 6)] == [0, 2, 5, 6]
    assert capsys.readouterr().err == ""
    assert cli.stop_status(LaunchOutcome(1, "SIGTERM"), 20, tmp_path) == 7
    assert capsys.readouterr().err == ("stopped: SIGTERM; the launcher exited 1; resume with --resume auto (tag "
                                       "global_step4)\n")


def test_the_launchers_error_line_of_a_clean_stop_alone_is_dropped(capsys):
    """The launcher's output through the front process: its error line for a rank's exit 7 (a clean stop, said by
    rank 0) is dropped; any other code's, and every other line, pass."""
    from ds_packdpo.run.launch_group import _pass_through

    error = "[2026-12-06 21:04:55,123] [ERROR] [launch.py:{}:sigkill_handler] ['python', '-u', '-m', " \
            "'ds_packdpo.train', '--local_rank=1'] exits with return code = {}\n"
    lines = ["plan: 48 pairs in 4 steps\n", error.format(341, 7), error.format(341, 5), error.format(341, 70),
             "done\n"]
    read, write = os.pipe()
    os.write(write, "".join(lines).encode())
    os.close(write)
    _pass_through(os.fdopen(read), sys.stdout, None)
    assert capsys.readouterr().out == "".join(lines[:1] + lines[2:])
