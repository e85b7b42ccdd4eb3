"""What a step costs: its wall time, the peak memory of a stretch of the run, its model FLOPs."""

from __future__ import annotations

import resource
import threading
import time

import psutil
import torch
from deepspeed.accelerator import get_accelerator

from ..model.flops import FlopModel, ThroughputMeter


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

    On CUDA ``torch.cuda.max_memory_allocated`` (reset at start).  On CPU the RSS,
    sampled every 10 ms by a thread: ``ru_maxrss`` is the peak of the process's
    whole life, so it cannot tell a bench's second configuration from its first.
    """

    def __init__(self, device_type: str, interval_s: float = 0.01):
        self.device_type = device_type
        self.interval_s = interval_s
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread = None

    @property
    def kind(self) -> str:
        return "cuda_max_allocated" if self.device_type == "cuda" else "rss"

    def __enter__(self):
        if self.device_type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        else:
            process = psutil.Process()

            def sample():
                while True:
                    self.peak_bytes = max(self.peak_bytes, process.memory_info().rss)
                    if self._stop.wait(self.interval_s):
                        return

            self._thread = threading.Thread(target=sample, name="peak-rss", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self.device_type == "cuda":
            self.peak_bytes = int(torch.cuda.max_memory_allocated())
        else:
            self._stop.set()
            self._thread.join()
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
