"""Every exception that carries an exit code, and the guard that turns them into one line and that code.

Every problem a user can fix (a malformed dataset row, an impossible setting, a
missing file) is raised as :class:`InputError` with a single-line message that
names the file, row or key and the reason; :func:`run_guarded` prints it as
``error: <message>`` and returns exit code 2, before any heavy work starts.  A run
that cannot go on raises a :class:`RunAbortedError` subclass with its own code.
Nothing here imports torch, so every command (``prepare`` and ``pack-stats`` too)
can use it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable


class InputError(ValueError):
    """Bad user input; the message is one line naming where and why."""

    exit_code = 2


class RunAbortedError(RuntimeError):
    """The run cannot go on; the message is one line for the user, the command exits with ``exit_code``."""

    exit_code = 1


class PackingNotExactError(RunAbortedError):
    """The attention backend lets packed sequences see each other (or is otherwise inexact)."""

    exit_code = 3


class TooManyBadStepsError(RunAbortedError):
    """--max-bad-steps consecutive steps had a non-finite loss or gradient."""

    exit_code = 4


class PeerFailureError(RunAbortedError):
    """A collective failed: another rank died (its connection closed) or stalled past --collective-timeout-s."""

    exit_code = 5


class DiskFullError(RunAbortedError):
    """A checkpoint save ran out of space (or quota); the previous checkpoint and ``latest`` are intact."""

    exit_code = 6


class StoppedError(RunAbortedError):
    """The run stopped at a step boundary because a rank received SIGTERM or SIGINT (a scheduler's cancel or
    pre-emption, Ctrl-C); its message is the ``stopped: ...`` line (rank 0's; empty on the other ranks)."""

    exit_code = 7


def first_line(error: BaseException) -> str:
    """The first line of an exception's message (its type name when it has none), for one-line errors."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def run_guarded(job: Callable[[], int]) -> int:
    """Runs ``job``; a user error or an aborted run becomes ``error: <one line>`` and its exit code, no traceback."""
    try:
        return job()
    except (InputError, RunAbortedError) as error:
        if str(error):  # a stop's line names itself; the other ranks of a stop say nothing
            print(str(error) if isinstance(error, StoppedError) else f"error: {error}", file=sys.stderr)
        return error.exit_code
