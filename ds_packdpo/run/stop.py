"""A stop a user or a scheduler asks for (SIGTERM, SIGINT): every rank ends at the same step boundary, saved.

A signal only sets a flag here; the trainer asks :func:`agreed` after every optimizer step.
That asks every rank (one MAX all-reduce of the flag), so a signal that reached one rank a
step before the others still stops them all after the same step: a rank that stopped alone
would leave its peers waiting in the next step's collectives (design invariant 3).  The
front process (``ds-packdpo train``) forwards the signal to every rank and gives them
``--stop-grace-s`` to save and exit (:mod:`ds_packdpo.run.launch_group`).
"""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist

from ..errors import StoppedError

SIGNALS = (signal.SIGTERM, signal.SIGINT)
_received: list[int] = []


def _note(signum, frame) -> None:
    _received.append(signum)


def end_at_once() -> None:
    """Until :func:`install`: SIGINT ends this rank at once, as SIGTERM does, not as a KeyboardInterrupt with a
    traceback in every rank (the front process passes a Ctrl-C on to the ranks as SIGINT)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def install() -> None:
    """From now on SIGTERM and SIGINT ask this rank to stop at the next step boundary (no KeyboardInterrupt).

    Installed as the loop starts: before it (phase one, the engines) there is nothing to save, and a signal ends the
    rank at once, as a launcher that stops a dead rank's peers expects."""
    for signum in SIGNALS:
        signal.signal(signum, _note)


def requested() -> str | None:
    """The name of the first stop signal this rank received, or None."""
    return signal.Signals(_received[0]).name if _received else None


def agreed(device) -> bool:
    """True on every rank when any rank was asked to stop (a collective: every rank calls it after every step)."""
    flag = torch.tensor([1.0 if _received else 0.0], device=device)
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() > 0


def stopped(global_step: int, saved_tag: str | None, rank: int) -> StoppedError:
    """The error that ends every rank of a stopped run with exit code 7; rank 0's carries the one line."""
    if rank != 0:
        return StoppedError("")
    what = requested() or "a stop signal to another rank"
    if saved_tag is None:
        return StoppedError(f"stopped: {what} after step {global_step}; no checkpoint (set --save-steps or --save-dir "
                            f"to save one on a stop)")
    return StoppedError(f"stopped: {what} after step {global_step}, checkpoint saved; resume with --resume auto "
                        f"(tag {saved_tag})")
