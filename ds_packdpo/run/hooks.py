"""Step hooks: the points of a run where a test may act (kill a rank, poison a loss, fill the disk); none in a run.

The training loop, the checkpoint save and the universal conversion call the installed :class:`StepHooks` at
their points; the base class does nothing at any of them, and it is all a run ever has unless the environment
names a hook module: ``DS_PACKDPO_STEP_HOOKS=MODULE`` imports ``MODULE`` in every process of the run and installs
what its ``step_hooks()`` returns.  The fault-tolerance tests name ``fault_hooks`` (tests/fault_hooks.py): the
package itself holds no fault and imports no test helper.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Callable, Iterator

import torch

HOOKS_ENV = "DS_PACKDPO_STEP_HOOKS"


class StepHooks:
    """Every point a hook may act at, each doing nothing here."""

    def step_begins(self, run, step: int) -> Callable[[], None]:
        """Optimizer step ``step`` (1-based) of ``run`` (an ``assemble.Run``) begins; returns what undoes whatever
        was installed for the step, called once it ends."""
        return lambda: None

    def losses(self, step: int, losses: torch.Tensor) -> torch.Tensor:
        """A row's per-pair losses in step ``step``, before they are reduced (what the step trains on)."""
        return losses

    @contextlib.contextmanager
    def saving(self, rank: int, step: int) -> Iterator[None]:
        """Around this rank's writing of the checkpoint of step ``step``."""
        yield

    def saved(self, rank: int, step: int) -> None:
        """Every rank's files of step ``step``'s checkpoint are written; its manifest is not."""

    def converted(self, step: int) -> None:
        """The universal form of step ``step``'s checkpoint is written, not yet renamed into place."""


_installed: list[StepHooks] = []


def installed() -> StepHooks:
    """This process's hooks: those of the module ``DS_PACKDPO_STEP_HOOKS`` names, else none (the base class)."""
    if not _installed:
        module = os.environ.get(HOOKS_ENV)
        _installed.append(importlib.import_module(module).step_hooks() if module else StepHooks())
    return _installed[0]
