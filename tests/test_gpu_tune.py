"""scripts/gpu_tune.py (the tune stage of scripts/gpu_acceptance.sh): every variant is flags the trainer takes, each
changing a setting; the figures leave the first step out; an unknown variant is one line.  Its smoke run on CPU (two
variants, each its own process) is the acceptance script's: STAGES=tune scripts/gpu_acceptance.sh OUT --smoke."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from ds_packdpo.config import parse_train_args

SPEC = importlib.util.spec_from_file_location("gpu_tune", Path(__file__).resolve().parents[1] / "scripts" / "gpu_tune.py")
gpu_tune = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(gpu_tune)


@pytest.mark.parametrize("name", list(gpu_tune.VARIANTS))
def test_every_variant_is_flags_the_trainer_takes(name):
    flags = gpu_tune.VARIANTS[name]
    base, varied = parse_train_args([]), parse_train_args(list(flags))
    assert (not flags) == (base == varied), name  # the baseline alone changes nothing


def test_figures_leave_the_first_step_out_and_unknown_variants_are_refused():
    metrics = [{"step": 1, "loss": 0.7, "tokens_per_s": 10.0, "mfu": None, "peak_mem_mb": 5},
               {"step": 2, "loss": 0.6, "tokens_per_s": 30.0, "mfu": None, "peak_mem_mb": 7},
               {"step": 3, "loss": 0.5, "tokens_per_s": 50.0, "mfu": None, "peak_mem_mb": 6}]
    row = gpu_tune.measure(metrics)
    assert (row["tokens_per_s"], row["mfu"], row["peak_mem_mb"], row["measured_steps"]) == (40.0, None, 7, 2)
    lines = gpu_tune.describe([{"variant": "default", "flags": [], "rc": 0, "seconds": 1.0, **row},
                               {"variant": "x", "flags": ["--a"], "rc": 124, "seconds": 2.0, "error": "timed out",
                                **gpu_tune.measure([])}])
    assert "| default | - | 40 | 1.000 |" in lines[2] and lines[-1] == "- x: timed out"
    with pytest.raises(SystemExit, match="TUNE_VARIANTS: nope, compile\\+nope unknown"):
        gpu_tune.variant_flags(["default", "nope", "compile+nope"])
    assert gpu_tune.variant_flags(["compile+row-budget=32k"]) == [
        ("compile+row-budget=32k", ("--compile-layers", "--max-tokens-per-row", "32768"))]
