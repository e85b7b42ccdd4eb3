"""The front process's launcher: started in a session of its own, stop signals forwarded to every rank.

A scheduler's cancel or pre-emption (SIGTERM) or Ctrl-C (SIGINT) reaches the process it was
sent to: ``ds-packdpo train``.  Left alone, the front process died and the launcher and the
ranks trained on.  Here the launcher runs in its own session (a terminal's Ctrl-C no longer
reaches it and its ranks half-way), and the front process passes the first signal on to the
ranks (``run/stop.py`` makes them save at the next step boundary and exit 7), waits up to
``--stop-grace-s`` and then kills the whole session.  A second signal kills at once.  The
ranks are signalled rather than the deepspeed launcher: on SIGTERM it would terminate them
and exit 1 itself, while left alone it passes their exit code 7 through.  They get the signal
the front process received, so that the ``stopped:`` line names it (SIGINT for a Ctrl-C).

The launcher's (and the ranks') stdout passes through the front process line by line, less the
one line the launcher logs as an error when a rank exits 7 (``[ERROR] [launch.py:...:sigkill_handler]
[...] exits with return code = 7``): that is a clean stop, which rank 0 has just said; any other
code's line stays.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil

from ..errors import StoppedError

SIGNALS = (signal.SIGTERM, signal.SIGINT)
POLL_S = 0.2
_CLEAN_STOP_LINE = re.compile(rf"\[ERROR\] \[launch\.py:\d+:sigkill_handler\] .* exits with return code = "
                              rf"{StoppedError.exit_code}\s*$")


def rank_processes(launcher_pid: int) -> list[psutil.Process]:
    """The ranks under a deepspeed launcher: its descendants called with ``--local_rank=N``."""
    try:
        children = psutil.Process(launcher_pid).children(recursive=True)
    except psutil.Error:
        return []
    ranks = []
    for child in children:
        try:
            if any(arg.startswith(("--local_rank", "--local-rank")) for arg in child.cmdline()):
                ranks.append(child)
        except psutil.Error:
            continue
    return ranks


@dataclass
class LaunchOutcome:
    """How the launcher ended: its exit code, the stop signal the front process received (None: none) and whether
    the session had to be killed (the ranks outlived the grace period, or a second signal came)."""

    code: int
    signal_name: str | None = None
    killed: bool = False
    repeated: bool = False  # a second signal came (and killed at once)


@dataclass
class _Forwarder:
    proc: subprocess.Popen
    grace_s: float
    received: list[int] = field(default_factory=list)
    deadline: float | None = None

    def handle(self, signum, frame) -> None:
        self.received.append(signum)
        if len(self.received) > 1:
            self.deadline = time.monotonic()  # a second signal: no more grace
            return
        self.deadline = time.monotonic() + self.grace_s
        ranks = rank_processes(self.proc.pid)
        if not ranks:  # none started yet (or not a deepspeed launcher): the whole session
            _signal_session(self.proc.pid, signal.SIGTERM)
        for rank in ranks:
            try:
                rank.send_signal(signum)  # the signal received: the stopped: line names it
            except psutil.Error:
                pass


def _signal_session(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _pass_through(stream, sink, on_line: Callable[[str], None] | None) -> None:
    """Copies a launcher's output stream to ``sink`` line by line, less the launcher's error line of a clean stop;
    each line also to ``on_line``."""
    for line in iter(stream.readline, ""):
        if not _CLEAN_STOP_LINE.search(line):
            sink.write(line)
            sink.flush()
        if on_line is not None:
            on_line(line)
    stream.close()


def run_launcher(cmd: list[str], env: dict, grace_s: float,
                 on_line: Callable[[str], None] | None = None) -> LaunchOutcome:
    """Runs ``cmd`` (a launcher) in its own session until it exits, forwarding SIGTERM/SIGINT as the module says;
    its stdout passes through :func:`_pass_through` (the ranks' unbuffered, so each line comes when it is printed);
    ``on_line``: called with every line of its output, stderr's too (still written to ours), e.g. for the bench to
    say which configuration a crash ended."""
    pipes = {"stdout": subprocess.PIPE, "text": True, "errors": "replace",
             **({} if on_line is None else {"stderr": subprocess.PIPE})}
    proc = subprocess.Popen(cmd, env={**env, "PYTHONUNBUFFERED": "1"}, start_new_session=True, **pipes)
    streams = [(proc.stdout, sys.stdout), *([] if on_line is None else [(proc.stderr, sys.stderr)])]
    readers = [threading.Thread(target=_pass_through, args=(stream, sink, on_line), daemon=True)
               for stream, sink in streams]
    for reader in readers:
        reader.start()
    forwarder = _Forwarder(proc, grace_s)
    previous = {signum: signal.signal(signum, forwarder.handle) for signum in SIGNALS}
    killed = False
    try:
        while True:
            try:
                code = proc.wait(timeout=POLL_S)
                break
            except subprocess.TimeoutExpired:
                pass
            if forwarder.deadline is not None and time.monotonic() >= forwarder.deadline:
                _signal_session(proc.pid, signal.SIGKILL)
                killed = True
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if killed or forwarder.received:
            _signal_session(proc.pid, signal.SIGKILL)  # nothing of the session outlives a stop
        for reader in readers:
            reader.join(timeout=5)  # the output the launcher's last processes wrote
    name = signal.Signals(forwarder.received[0]).name if forwarder.received else None
    return LaunchOutcome(code, name, killed, repeated=len(forwarder.received) > 1)
