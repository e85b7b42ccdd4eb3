"""Fault-injection points for the fault-tolerance tests; inert unless their environment variable is set.

``DS_PACKDPO_FAULT_KILL=RANK:STEP``   rank RANK SIGKILLs itself as optimizer step STEP begins.
``DS_PACKDPO_FAULT_NAN_STEPS=S1,S2``  the loss of those optimizer steps is NaN on every rank.
"""

from __future__ import annotations

import os
import signal

KILL_ENV = "DS_PACKDPO_FAULT_KILL"
NAN_ENV = "DS_PACKDPO_FAULT_NAN_STEPS"


def kill_point(rank: int, step: int) -> None:
    if os.environ.get(KILL_ENV) == f"{rank}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)


def nan_step(step: int) -> bool:
    return str(step) in os.environ.get(NAN_ENV, "").split(",")
