"""The fault-tolerance tests' step hooks (``ds_packdpo.run.hooks``): inert unless their environment variable is set.

``cpu_env`` (launching.py) names this module in ``DS_PACKDPO_STEP_HOOKS``, so every rank a test starts installs it.

``DS_PACKDPO_FAULT_KILL=RANK:STEP[:POINT]``  rank RANK SIGKILLs itself during optimizer step STEP, at POINT:
    ``step`` (the default: as the step begins), ``forward`` (inside the policy's forward, in a middle layer),
    ``backward`` (inside the backward, as the gradient reaches that layer), ``save`` (the step's checkpoint: every
    rank's files written, no manifest yet), ``universal`` (rank 0 converting checkpoint STEP for --allow-new-layout:
    the universal form written, not yet renamed into place).
``DS_PACKDPO_FAULT_WAIT_FOR_STOP=STEP``  as optimizer step STEP begins every rank waits (up to 120 s) until a stop
    signal reached any rank (run/stop.py), so a test's SIGTERM lands at a known step however fast the steps run.
``DS_PACKDPO_FAULT_NAN_STEPS=S1,S2``  the loss of those optimizer steps is NaN on every rank.
``DS_PACKDPO_FAULT_DISK_FULL=RANK:STEP``  on rank RANK the checkpoint of step STEP runs out of space in DeepSpeed's
    writer: the first ``*optim_states.pt`` gets half its bytes, then ``OSError(ENOSPC)``.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import re
import signal
import sys
import time
from unittest import mock

import torch

from ds_packdpo.run import stop
from ds_packdpo.run.hooks import StepHooks

KILL_ENV = "DS_PACKDPO_FAULT_KILL"
NAN_ENV = "DS_PACKDPO_FAULT_NAN_STEPS"
DISK_FULL_ENV = "DS_PACKDPO_FAULT_DISK_FULL"
WAIT_FOR_STOP_ENV = "DS_PACKDPO_FAULT_WAIT_FOR_STOP"


def kill_requested(rank: int, step: int, point: str = "step") -> bool:
    spec = os.environ.get(KILL_ENV, "")
    return spec == f"{rank}:{step}:{point}" or (point == "step" and spec == f"{rank}:{step}")


def die() -> None:
    """SIGKILL this process, its time stamp on stderr first (tests/dead_rank_time.py times the job's end from it)."""
    print(f"fault: pid {os.getpid()} SIGKILLs itself at {time.time():.3f}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def kill_point(rank: int, step: int, point: str = "step") -> None:
    if kill_requested(rank, step, point):
        die()


def wait_for_stop(step: int, device) -> None:
    """Every rank polls the agreed stop flag (a collective: all leave the loop together), so a signal to one rank
    alone is enough."""
    if os.environ.get(WAIT_FOR_STOP_ENV) != str(step):
        return
    waited_until = time.monotonic() + 120
    while not stop.agreed(device) and time.monotonic() < waited_until:
        time.sleep(0.05)


def arm_kill_in_model(model: torch.nn.Module, rank: int, step: int) -> list:
    """Installs this step's ``forward``/``backward`` kill point on a middle decoder layer of ``model``; returns the
    hook handles to remove after the step (none when no such kill is asked for)."""
    point = next((p for p in ("forward", "backward") if kill_requested(rank, step, p)), None)
    if point is None:
        return []
    layers = [module for name, module in model.named_modules() if re.search(r"layers\.\d+$", name)] or [model]
    layer = layers[len(layers) // 2]

    def hook(module, args, output):
        if point == "forward":
            die()
        out = output[0] if isinstance(output, tuple) else output
        if torch.is_tensor(out) and out.requires_grad:
            out.register_hook(lambda grad: die())

    return [layer.register_forward_hook(hook)]


class FaultHooks(StepHooks):
    """The faults the environment asks for, at the run's step hooks."""

    def step_begins(self, run, step: int):
        rank = run.setup.spec.layout.rank
        kill_point(rank, step)
        wait_for_stop(step, run.device)
        armed = arm_kill_in_model(run.policy.module, rank, step)
        return lambda: [handle.remove() for handle in armed]

    def losses(self, step: int, losses: torch.Tensor) -> torch.Tensor:
        return losses * float("nan") if str(step) in os.environ.get(NAN_ENV, "").split(",") else losses

    @contextlib.contextmanager
    def saving(self, rank: int, step: int):
        """The disk-full fault, when asked for this rank and step."""
        if os.environ.get(DISK_FULL_ENV) != f"{rank}:{step}":
            yield
            return
        real_save = torch.save

        def save(obj, f, *args, **kwargs):
            if not str(f).endswith("optim_states.pt"):
                return real_save(obj, f, *args, **kwargs)
            buffer = io.BytesIO()
            real_save(obj, buffer, *args, **kwargs)
            with open(f, "wb") as handle:
                handle.write(buffer.getbuffer()[: buffer.tell() // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))

        with mock.patch.object(torch, "save", save):
            yield

    def saved(self, rank: int, step: int) -> None:
        kill_point(rank, step, "save")

    def converted(self, step: int) -> None:
        kill_point(0, step, "universal")


def step_hooks() -> StepHooks:
    return FaultHooks()
