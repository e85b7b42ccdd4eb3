"""Where a step's time goes: each profiled activity in one category of :data:`CATEGORIES`, and the idle time between.

An activity is what the device ran: a kernel on CUDA (its time on the GPU), an operator's own time (``self`` time)
on a CPU run, where the CPU is the device.  Each carries the names of the host ranges it ran under (``scopes``,
innermost first: for a kernel, the operator that launched it and that operator's callers; for a backward operator,
the autograd node it belongs to), so that a kernel whose name says nothing (an elementwise multiply) still lands in
the stage that ran it (the log-prob stage's ``ds_packdpo.logps`` range, its ``*LabelLogProbBackward`` node).  The
first category whose patterns match wins; what none matches is elementwise work (norms, rotary, activations, casts).

Idle is the step's wall time in which no activity ran: on a GPU the time it waited for the host (launch overhead,
Python, synchronisation); on a CPU, the interpreter's own time between operators.  Kernels of several streams may
overlap (a collective beside a GEMM), so the categories can add up to more than the busy time.

Torch's profiler knows FLOPs of some host operators (matrix products, ``with_flops``): they are summed per category
from the operators that launched the work ("where known": attention kernels and fused ones report none).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from ..model.logps import LOGPS_SCOPE

STEP_SCOPE = "ds_packdpo.step"  # the host range around one optimizer step (the profile's window)
OPTIMIZER_SCOPE = "ds_packdpo.optimizer_step"  # the host range around the engine's step (the optimizer's update)


@dataclass(frozen=True)
class Activity:
    """One thing the device ran: ``micros`` of device time (0 for a host operator that only reports FLOPs)."""

    name: str
    scopes: tuple[str, ...]  # the host ranges it ran under, innermost first
    micros: float
    flops: int = 0


@dataclass(frozen=True)
class Category:
    """A row of the table: the activities whose name (or one of whose scopes) matches a pattern (case-insensitive)."""

    name: str
    description: str
    names: tuple[str, ...] = ()  # searched in the activity's name
    scopes: tuple[str, ...] = ()  # searched in each of its scopes

    def matches(self, activity: Activity) -> bool:
        return (any(re.search(p, activity.name, re.IGNORECASE) for p in self.names)
                or any(re.search(p, scope, re.IGNORECASE) for p in self.scopes for scope in activity.scopes))


ELEMENTWISE = "elementwise"
# First match wins: collectives before the stages they run in (the lm_head's gather runs inside the log-prob stage),
# the stages before the kernel kinds (the head's GEMM is the log-prob stage's).
CATEGORIES: tuple[Category, ...] = (
    Category("zero3_gather", "ZeRO-3 parameter all-gather (and broadcasts)",
             names=(r"all_?gather", r"broadcast"), scopes=(r"all_?gather", r"broadcast")),
    Category("reduce_scatter", "gradient reduce-scatter and all-reduce (collectives)",
             names=(r"reduce_?scatter", r"all_?reduce", r"nccl.*reduce", r"gloo"),
             scopes=(r"reduce_?scatter", r"all_?reduce")),
    Category("optimizer", "the optimizer's update, gradient norm and clipping (the engine's step)",
             names=(r"multi_tensor_apply", r"adam"), scopes=(re.escape(OPTIMIZER_SCOPE), r"^Optimizer\.step")),
    Category("logps", "the log-prob stage: lm_head chunks, log-softmax, label gather (forward and backward)",
             names=(r"log_?softmax", r"logsumexp", r"cce", r"cross_entropy"),
             scopes=(re.escape(LOGPS_SCOPE), r"LabelLogProb", r"LogSoftmaxBackward", r"cce")),
    Category("attention", "attention kernels (flash, memory-efficient, varlen, sdpa)",
             names=(r"flash", r"fmha", r"attention", r"attn", r"sdpa", r"varlen"),
             scopes=(r"ScaledDotProduct", r"FlashAttention", r"EfficientAttention", r"varlen")),
    Category("gemm", "matrix products of the layers (projections, MLP)",
             names=(r"gemm", r"^aten::(mm|addmm|bmm|baddbmm|matmul|linear|_addmm_activation)$", r"cutlass", r"nvjet",
                    r"xmma", r"cublas", r"s16816", r"wgmma")),
    Category("memory", "copies between devices and fills (memcpy, memset)", names=(r"memcpy", r"memset")),
    Category(ELEMENTWISE, "everything else: norms, rotary, activations, casts, copies, reductions"),
)
IDLE = "idle"  # not a row of the table: the step's time with no activity


def categorize(activity: Activity) -> str:
    return next((c.name for c in CATEGORIES if c.matches(activity)), ELEMENTWISE)


def union_micros(intervals: Iterable[tuple[float, float]], windows: Iterable[tuple[float, float]]) -> float:
    """The time within ``windows`` covered by at least one of ``intervals`` (each a (start, end) in microseconds)."""
    clipped = sorted((max(s, ws), min(e, we)) for ws, we in windows for s, e in intervals if min(e, we) > max(s, ws))
    covered, end = 0.0, float("-inf")
    for start, stop in clipped:
        if stop <= end:
            continue
        covered += stop - max(start, end)
        end = stop
    return covered


def step_breakdown(activities: Iterable[Activity], busy: Iterable[tuple[float, float]],
                   windows: list[tuple[float, float]], device: str) -> dict:
    """The table of a profile: per category its device time and FLOPs per step, and the idle time.

    ``windows`` are the profiled steps' (start, end), ``busy`` the intervals in which the device ran something.
    """
    steps = max(len(windows), 1)
    step_us = sum(end - start for start, end in windows) / steps
    micros = {c.name: 0.0 for c in CATEGORIES}
    flops = {c.name: 0 for c in CATEGORIES}
    counts = {c.name: 0 for c in CATEGORIES}
    for activity in activities:
        name = categorize(activity)
        micros[name] += activity.micros
        flops[name] += activity.flops
        counts[name] += 1 if activity.micros else 0
    idle_us = step_us - union_micros(list(busy), windows) / steps
    rows = [{"category": c.name, "description": c.description, "ms_per_step": micros[c.name] / steps / 1e3,
             "share": micros[c.name] / steps / step_us if step_us else None,
             "activities_per_step": counts[c.name] / steps,
             "gflop_per_step": flops[c.name] / steps / 1e9 if flops[c.name] else None,
             "tflop_per_s": flops[c.name] / micros[c.name] / 1e6 if flops[c.name] and micros[c.name] else None}
            for c in CATEGORIES]
    rows.append({"category": IDLE, "description": f"the {device} waiting for the host (no activity in the step)",
                 "ms_per_step": idle_us / 1e3, "share": idle_us / step_us if step_us else None,
                 "activities_per_step": 0, "gflop_per_step": None, "tflop_per_s": None})
    return {"device": device, "steps": len(windows), "step_ms": step_us / 1e3, "categories": rows}


def describe_breakdown(breakdown: dict) -> list[str]:
    """The table in Markdown (acceptance.md, the run's log)."""
    lines = [f"Step time by category ({breakdown['device']}, {breakdown['steps']} profiled steps, "
             f"{breakdown['step_ms']:.1f} ms per step):", "",
             "| category | ms/step | share | GFLOP/step | TFLOP/s | what |", "|---|---|---|---|---|---|"]
    for row in breakdown["categories"]:
        gflop = "-" if row["gflop_per_step"] is None else f"{row['gflop_per_step']:.4g}"
        rate = "-" if row["tflop_per_s"] is None else f"{row['tflop_per_s']:.3g}"
        share = "-" if row["share"] is None else f"{row['share']:.1%}"
        lines.append(f"| {row['category']} | {row['ms_per_step']:.2f} | {share} | {gflop} | {rate} | "
                     f"{row['description']} |")
    return lines
