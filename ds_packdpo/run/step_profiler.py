"""--profile-steps N: N optimizer steps under torch.profiler; OUTPUT_DIR/profile.json (and .md), the step by category.

The first step is left out (allocator growth, kernel selection, compilation): steps 2 to N + 1 are profiled, or
the run's last N steps when it has fewer.  Every rank profiles (so the ranks stay alike at the collectives); rank 0
writes the table (:mod:`.profile_categories`).  torch.profiler does the recording; what it leaves to its user is
which kernel belongs to which stage of this trainer, hence the categoriser.
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from ..files import atomic_write
from .profile_categories import STEP_SCOPE, Activity, describe_breakdown, step_breakdown

_WRAPPERS = ("autograd::engine::", "ProfilerStep", "ds_packdpo.")  # host ranges around operators, not work


def _scopes(event) -> tuple[str, ...]:
    names = []
    parent = event.cpu_parent
    while parent is not None:
        names.append(parent.name)
        parent = parent.cpu_parent
    return tuple(names)


def _is_wrapper(event) -> bool:
    """A range around operators (a user range, autograd's engine and its backward nodes), not an operator: on a CPU
    its own time is the host's bookkeeping, left to the idle time."""
    return (event.is_user_annotation or event.is_async or event.name.startswith(_WRAPPERS)
            or re.search(r"Backward\d*$", event.name) is not None)


def profile_activities(events, device: str) -> tuple[list[Activity], list[tuple[float, float]],
                                                     list[tuple[float, float]]]:
    """A finished profile's events as (activities, busy intervals, step windows) for :func:`step_breakdown`.

    On CUDA the activities are the kernels (and copies), each under the operator that launched it, plus the host
    operators' FLOPs; on CPU the operators' own times, with their FLOPs.
    """
    host = [e for e in events if e.device_type == DeviceType.CPU]
    windows = sorted((e.time_range.start, e.time_range.end) for e in host if e.name == STEP_SCOPE)
    flop_ops = [Activity(e.name, _scopes(e), 0.0, e.flops) for e in host if e.flops and not _is_wrapper(e)]
    if device == "cuda":
        launcher = {e.id: e for e in host if not e.is_async}
        kernels = [e for e in events if e.device_type == DeviceType.CUDA]
        activities = []
        for kernel in kernels:
            op = launcher.get(kernel.linked_correlation_id)
            scopes = (op.name, *_scopes(op)) if op is not None else ()
            activities.append(Activity(kernel.name, scopes, kernel.time_range.elapsed_us()))
        busy = [(k.time_range.start, k.time_range.end) for k in kernels]
        return activities + flop_ops, busy, windows
    ops = [e for e in host if not _is_wrapper(e)]
    activities = [Activity(e.name, _scopes(e), e.self_cpu_time_total, e.flops) for e in ops]
    return activities, [(e.time_range.start, e.time_range.end) for e in ops], windows


class StepProfiler:
    """Starts torch.profiler before the first profiled step and stops it after the last; ``step(n)`` wraps step
    ``n`` in the range the table's window is read from."""

    def __init__(self, profile_steps: int, total_steps: int, start_step: int, device_type: str, out: Path | None):
        self.device_type = device_type
        self.out = out  # None: profile, write nothing (ranks but rank 0)
        self.first = start_step + 2  # this process's first step is left out when the run has room
        if self.first + profile_steps - 1 > total_steps:
            self.first = max(start_step + 1, total_steps - profile_steps + 1)
        self.last = min(self.first + profile_steps - 1, total_steps) if profile_steps else 0
        self._profiler = None

    def begin(self, step: int) -> None:
        if step == self.first and self.last:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device_type == "cuda" else [])
            self._profiler = profile(activities=activities, with_flops=True)
            self._profiler.__enter__()

    @contextlib.contextmanager
    def range(self):
        """Around one step: the window of the table (on CUDA until the step's last kernel has run)."""
        if self._profiler is None:
            yield
            return
        with record_function(STEP_SCOPE):
            yield
            if self.device_type == "cuda":
                torch.cuda.synchronize()

    def end(self, step: int) -> None:
        if self._profiler is None or step != self.last:
            return
        if self.device_type == "cuda":
            torch.cuda.synchronize()
        self._profiler.__exit__(None, None, None)
        events, self._profiler = self._profiler.events(), None
        if self.out is None:
            return
        breakdown = step_breakdown(*profile_activities(events, self.device_type), device=self.device_type)
        breakdown["profiled_steps"] = [self.first, self.last]
        table = "\n".join(describe_breakdown(breakdown)) + "\n"
        atomic_write(self.out, lambda path: Path(path).write_text(json.dumps(breakdown, indent=1)))
        atomic_write(self.out.with_suffix(".md"), lambda path: Path(path).write_text(table))
        print(table, file=sys.stderr, flush=True)
