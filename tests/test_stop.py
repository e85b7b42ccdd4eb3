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
from test_checkpoint import RUN_SETTINGS, TIMING, flags

from ds_packdpo import cli
from ds_packdpo.errors import StoppedError
from ds_packdpo.run.checkpoint import LATEST
from ds_packdpo.run.faults import WAIT_FOR_STOP_ENV
from ds_packdpo.run.launch_group import rank_processes
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
def test_sigterm_to_train_stops_every_rank_saved_and_resume_continues(tmp_path, capsys):
    argv = flags(tmp_path, "run", "--save-dir", str(tmp_path / "ckpt"))  # no --save-steps: the stop alone saves
    with subprocess.Popen(front(*argv), cwd=REPO, env=cpu_env(**{WAIT_FOR_STOP_ENV: str(STOP_AT)}), text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True) as proc:
        try:
            wait_for_step(tmp_path / "run" / "metrics.jsonl", STOP_AT - 1, proc)
            sent = time.monotonic()
            proc.send_signal(signal.SIGTERM)  # to the front process alone, as `kill PID` or a scheduler does
            _, stderr = proc.communicate(timeout=120)
            stop_s = time.monotonic() - sent
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == StoppedError.exit_code, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == (f"stopped: SIGTERM after step {STOP_AT}, checkpoint saved; resume with "
                                               f"--resume auto (tag global_step{STOP_AT})"), stderr[-3000:]
    assert "another rank died" not in stderr and "Traceback" not in stderr, stderr[-3000:]
    assert stop_s < 20  # within the default --stop-grace-s: the ranks stopped themselves
    with capsys.disabled():
        print(f"\nstop: SIGTERM as step {STOP_AT} ran; the ranks saved global_step{STOP_AT} and exited 7 "
              f"{stop_s:.1f} s after the signal")
    assert (tmp_path / "ckpt" / LATEST).read_text() == f"global_step{STOP_AT}"
    assert (tmp_path / "ckpt" / f"global_step{STOP_AT}" / MANIFEST_FILE).is_file()
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == list(range(1, STOP_AT + 1))

    resumed = run(front(*argv, "--resume", "auto"))
    assert f"resuming from {tmp_path / 'ckpt' / f'global_step{STOP_AT}'} at step {STOP_AT}\n" in resumed.stderr
    stopped_and_resumed = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in stopped_and_resumed] == list(range(1, 7))

    run(front(*flags(tmp_path, "straight")))  # the uninterrupted run: the same records, bitwise
    for got, want in zip(stopped_and_resumed, read_metrics(tmp_path / "straight" / "metrics.jsonl"), strict=True):
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
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # ranks that never reach a step boundary
time.sleep(60)
"""


@pytest.mark.parametrize("grace_s", [0.5, 2.0])
def test_ranks_that_outlive_stop_grace_s_are_killed(tmp_path, monkeypatch, capsys, grace_s):
    """--stop-grace-s: after it the front process kills the launcher's whole session and says where to resume."""
    launcher = tmp_path / "bin" / "deepspeed"
    launcher.parent.mkdir()
    launcher.write_text(FAKE_LAUNCHER.format(python=sys.executable))
    launcher.chmod(0o755)
    monkeypatch.setenv("PATH", f"{launcher.parent}{os.pathsep}{os.environ['PATH']}")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / LATEST).write_text("global_step3")
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
    started = time.monotonic()
    code = cli._launch([], 2, free_port(), "ds_packdpo.train", grace_s=grace_s, save_dir=tmp_path / "ckpt")
    took = time.monotonic() - started
    assert code == StoppedError.exit_code
    assert grace_s + 0.5 <= took < grace_s + 3
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"stopped: SIGTERM; the ranks did not stop within --stop-grace-s {grace_s:g} s and were killed; resume with "
        f"--resume auto (tag global_step3)")


def test_a_second_signal_kills_at_once(tmp_path, monkeypatch, capsys):
    launcher = tmp_path / "bin" / "deepspeed"
    launcher.parent.mkdir()
    launcher.write_text(FAKE_LAUNCHER.format(python=sys.executable))
    launcher.chmod(0o755)
    monkeypatch.setenv("PATH", f"{launcher.parent}{os.pathsep}{os.environ['PATH']}")
    for delay, signum in ((0.5, signal.SIGINT), (1.0, signal.SIGINT)):  # Ctrl-C twice
        threading.Timer(delay, os.kill, (os.getpid(), signum)).start()
    started = time.monotonic()
    code = cli._launch([], 2, free_port(), "ds_packdpo.train", grace_s=30, save_dir=tmp_path / "none")
    assert code == StoppedError.exit_code and time.monotonic() - started < 3
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "stopped: SIGINT; a second signal killed the ranks; no checkpoint to resume from")
