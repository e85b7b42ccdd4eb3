"""What a step costs: its wall time, the peak memory of a stretch of the run, its model FLOPs."""

from __future__ import annotations

import resource
import time

import torch
from deepspeed.accelerator import get_accelerator

from ..model.flops import FlopModel, ThroughputMeter
from .cpu_memory import reset_resident_peak, resident_peak_bytes


class StepTimer:
    """Wall time of one optimizer step, synchronized with the accelerator."""

    def __init__(self):
        self._accel = get_accelerator()
        self.start = 0.0

    def begin(self):
        self._accel.synchronize()
        self.start = time.perf_counter()

    def seconds(self) -> float:
        self._accel.synchronize()
        return time.perf_counter() - self.start


class PeakMemory:
    """Peak memory of this process over a ``with`` block.

    On CUDA ``torch.cuda.max_memory_allocated`` (reset at start).  On CPU the kernel's peak resident set (VmHWM),
    reset at start: exact, and no thread samples it during the measured steps (a sampling thread took 2-3% of a
    core per rank).  Where the kernel cannot reset it, the peak of the process's whole life (``rss_process_peak``).
    """

    def __init__(self, device_type: str):
        self.device_type = device_type
        self.peak_bytes = 0
        self._reset = False

    @property
    def kind(self) -> str:
        if self.device_type == "cuda":
            return "cuda_max_allocated"
        return "rss" if self._reset else "rss_process_peak"

    def __enter__(self):
        if self.device_type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        else:
            self._reset = reset_resident_peak()
        return self

    def __exit__(self, *exc):
        if self.device_type == "cuda":
            self.peak_bytes = int(torch.cuda.max_memory_allocated())
        else:
            self.peak_bytes = resident_peak_bytes()
        return False


def peak_memory_mb(device_type: str) -> float:
    """This rank's peak memory so far, in MiB, for the per-step metrics: CUDA's peak allocated bytes (what the
    caching allocator handed out, the figure ZeRO sizes against), or on CPU the peak RSS of the process's life."""
    if device_type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def throughput_meter(run) -> ThroughputMeter:
    """Model TFLOP/s and MFU per step of an assembled run, counted alike in training and in the bench."""
    prepared, spec = run.setup.prepared, run.setup.spec
    model_reference = run.reference is not None and not run.reference_is_precomputed
    return ThroughputMeter(FlopModel.of(run.policy, with_reference=model_reference), prepared.chosen_lengths,
                           prepared.rejected_lengths, spec.plan.config.layout, world_size=spec.layout.world_size,
                           peak_tflops=spec.outputs.peak_tflops, prompt_lengths=prepared.prompt_lengths,
                           policy_prepass=spec.loss.needs_policy_prepass)
