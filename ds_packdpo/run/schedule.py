"""The LR schedule of a run, as the DeepSpeed scheduler section that runs it.

``--lr-scheduler constant|linear|cosine`` is DeepSpeed's ``WarmupLR``, ``WarmupDecayLR``
or ``WarmupCosineLR``, configured from the run (peak --lr, the warm-up, the floor
--min-lr-ratio x --lr, and the run's total steps from the plan); the engine builds and
steps it and checkpoints carry its position.  With p = --lr, m = --min-lr-ratio, W the
warm-up steps, T the run's steps and W2 = max(2, W), optimizer step s = 1..T runs at

    lr(s) = p (m + (1 - m) g(s))
    g(s) = s / W                                   s < W2, W >= 2  (warm-up: step 1 trains, step W is at p)
           1                                       s < W2, W <= 1  (no warm-up)
           1                                       s >= W2, constant
           (T + 1 - s) / (T + 1 - W2)              s >= W2, linear
           (1 + cos(pi (s - W2 + 1) / (T + 2 - W2))) / 2   s >= W2, cosine

Two choices make that so (DeepSpeed's own start wasted two steps: its scheduler sets its
floor at construction, and its iteration 0, which the engine steps to after the first
optimizer step, is the floor again -- measured 0, 0, 2.5e-4 for a 4-step warm-up):

* step s runs at iteration s: a fresh run moves the scheduler to iteration 1 before its
  first step (:func:`start_schedule`), so the warm-up's first step already trains at p / W
  (transformers' schedules run step 1 at LR 0) and step W at p (cosine: just below p, as
  DeepSpeed's cosine starts decaying at the warm-up's last iteration);
* ``total_num_steps`` is T + 1 (WarmupDecayLR reaches its floor at iteration total) or
  T + 2 (WarmupCosineLR reaches it one iteration earlier), so the last step still trains
  above the floor, as in transformers' schedules.

DeepSpeed warms up over at least 2 iterations; without warm-up (W <= 1) the schedule uses
its 2-iteration ``log`` warm-up, whose iteration 1 is the peak, so step 1 runs at p (a
linear decay then keeps p for steps 1 and 2, since its decay starts after iteration 2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import InputError

DEEPSPEED_SCHEDULERS = {"constant": "WarmupLR", "linear": "WarmupDecayLR", "cosine": "WarmupCosineLR"}
FIRST_ITERATION = 1  # the scheduler iteration of a run's first optimizer step


@dataclass(frozen=True)
class Schedule:
    kind: str  # constant | linear | cosine
    peak: float
    warmup_steps: int
    total_steps: int
    min_lr_ratio: float

    @property
    def deepspeed_warmup(self) -> tuple[int, str]:
        """(warmup_num_steps, warmup_type) for DeepSpeed: at least 2 iterations; without warm-up a log warm-up of 2,
        whose iteration 1 (the first step's) is the peak."""
        if self.warmup_steps >= 2:
            return self.warmup_steps, "linear"
        return 2, "log"

    def deepspeed_section(self) -> dict | None:
        """The DeepSpeed config's "scheduler" section; None for a constant LR without warm-up (no scheduler)."""
        warmup, warmup_type = self.deepspeed_warmup
        floor = self.min_lr_ratio * self.peak
        if self.kind == "constant":
            if self.warmup_steps <= 1:
                return None
            params = {"warmup_min_lr": 0.0, "warmup_max_lr": self.peak, "warmup_num_steps": warmup,
                      "warmup_type": warmup_type}
        elif self.kind == "linear":
            params = {"total_num_steps": self.total_steps + 1, "warmup_min_lr": floor, "warmup_max_lr": self.peak,
                      "warmup_num_steps": warmup, "warmup_type": warmup_type}
        else:
            params = {"total_num_steps": self.total_steps + 2, "warmup_min_ratio": self.min_lr_ratio,
                      "cos_min_ratio": self.min_lr_ratio, "warmup_num_steps": warmup, "warmup_type": warmup_type}
        return {"type": DEEPSPEED_SCHEDULERS[self.kind], "params": params}

    def describe(self) -> str:
        warmup = f"warm-up {self.warmup_steps} steps" if self.warmup_steps > 1 else "no warm-up"
        end = "" if self.kind == "constant" else f" to {self.min_lr_ratio * self.peak:g}"
        return f"{self.kind} lr {self.peak:g}{end} over {self.total_steps} steps, {warmup}"


@dataclass(frozen=True)
class ScheduleSpec:
    """The LR schedule's settings, before the plan says how many steps the run has (:meth:`over`)."""

    kind: str  # --lr-scheduler: constant | linear | cosine
    warmup_steps: int
    warmup_ratio: float | None  # instead of warmup_steps: a fraction of the run's steps
    min_lr_ratio: float  # the floor of linear and cosine, and where the warm-up starts, as a fraction of --lr

    def __post_init__(self):
        if self.warmup_ratio is not None and self.warmup_steps:
            raise InputError("--warmup-steps and --warmup-ratio are exclusive; give one")
        if self.kind == "constant" and self.min_lr_ratio:
            raise InputError(f"--min-lr-ratio {self.min_lr_ratio} has no effect with --lr-scheduler constant (it is the "
                             f"floor of linear and cosine); set it to 0 or pick one of them")

    def over(self, peak: float, total_steps: int) -> Schedule:
        """The schedule of a run of ``total_steps`` optimizer steps peaking at ``peak`` (--warmup-ratio rounds up, as
        transformers does)."""
        warmup = self.warmup_steps if self.warmup_ratio is None else math.ceil(self.warmup_ratio * total_steps)
        return Schedule(self.kind, peak, warmup, total_steps, self.min_lr_ratio)


def start_schedule(engine) -> None:
    """A fresh run's first optimizer step at iteration 1 (see the module docstring); sets the optimizer's LR."""
    if engine.lr_scheduler is not None:
        engine.lr_scheduler.step(FIRST_ITERATION)
