"""A quiet console: a run shows its plan, its progress, its last line and errors.

Libraries' FutureWarnings (torch.distributed's deprecations, once per rank and
collective), DeepSpeed's INFO lines that repeat the whole command and its warnings
(e.g. "Attempting to get learning rate from scheduler before it has started", which the
engine's own start-up triggers) are filtered unless ``--verbose``.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from unittest import mock

from tqdm.auto import tqdm

SAID_ENV = "DS_PACKDPO_PHASE_ONE_SAID"  # set for the ranks of a front process that ran phase one itself


_PYTHON_FORMAT = warnings.formatwarning
_OWN_CODE = f"{os.sep}ds_packdpo{os.sep}"


def one_line_warning(message, category, filename, lineno, line=None) -> str:
    """This package's own warnings as ``warning: <message>``, like its ``error:`` lines; Python's format (the file,
    the line number and the source line of the ``warnings.warn`` call) says nothing to a user."""
    if _OWN_CODE in filename and issubclass(category, UserWarning):
        return f"warning: {message}\n"
    return _PYTHON_FORMAT(message, category, filename, lineno, line)


def quiet_libraries(verbose: bool) -> None:
    """This process's share: FutureWarnings ignored, DeepSpeed's logger at ERROR, this package's warnings one line
    each (``verbose``: everything as the libraries and Python show it)."""
    if verbose:
        warnings.formatwarning = _PYTHON_FORMAT
        return
    warnings.formatwarning = one_line_warning
    warnings.filterwarnings("ignore", category=FutureWarning)
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)


def progress_bar(total: int, desc: str, unit: str, shown: bool) -> tqdm:
    """The bar of a command's long work (precompute-ref's pairs, eval's rows, bench's steps): ``shown`` on rank 0
    with --progress only, so --no-progress and the other ranks print none."""
    return tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, disable=not shown)


def say_warning(text: str) -> None:
    """``warning: <text>`` on stderr, once per job: by the process that runs phase one first (the front process,
    or rank 0 under a launcher started by hand), not again by every rank."""
    if os.environ.get(SAID_ENV) or os.environ.get("RANK", "0") != "0":
        return
    print(f"warning: {text}", file=sys.stderr, flush=True)


_SAID_IN_THIS_PROCESS: set[str] = set()


def say_warning_once(text: str) -> None:
    """:func:`say_warning` at most once per process for one text: for a guard inside a step, which meets its cause
    at every step."""
    if text not in _SAID_IN_THIS_PROCESS:
        _SAID_IN_THIS_PROCESS.add(text)
        say_warning(text)


def said_already():
    """A block whose :func:`say_warning` lines were said before in this process (bench prepares the same data once
    per configuration): none again.  The environment is restored after it."""
    return mock.patch.dict(os.environ, {SAID_ENV: "1"})


def launcher_options(verbose: bool) -> list[str]:
    """The deepspeed launcher's own logging: its INFO lines print the whole command of every rank."""
    return [] if verbose else ["--log_level", "error"]


def rank_environment(env: dict, procs: int, device_type: str) -> dict:
    """The ranks' environment: on CPU each rank gets cores / ranks threads unless OMP_NUM_THREADS is set (torch's
    default of every core per rank oversubscribes the machine ``procs`` times); the front process has said phase
    one's warnings (:func:`say_warning`)."""
    env = {**env, SAID_ENV: "1"}
    if device_type == "cpu" and "OMP_NUM_THREADS" not in env:
        env = {**env, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // procs))}
    return env
