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
    assert "| default | - | 40 | 1.000 |" in lines[2] and lines[-2] == "- x: timed out"
    with pytest.raises(SystemExit, match="TUNE_VARIANTS: nope, compile\\+nope unknown"):
        gpu_tune.variant_flags(["default", "nope", "compile+nope"])
    assert [gpu_tune.variant_timeout(name, 75) for name in ("default", "compile+row-budget=32k", "liger")] == [
        75, 150, 75]
    assert gpu_tune.stage_limit_s("default,compile+row-budget=32k liger", 75) == 300  # the tune stage's limit
    assert gpu_tune.variant_names("default, compile ,liger") == ["default", "compile", "liger"]
    assert gpu_tune.variant_flags(["compile+row-budget=32k"]) == [
        ("compile+row-budget=32k", ("--compile-layers", "--max-tokens-per-row", "32768"))]


def test_step_one_is_compared_with_the_first_rows_and_a_large_difference_is_drawn_bold():
    def run(chosen, rejected, grad_norm, tokens_per_s=100.0):
        metrics = [{"step": 1, "loss": 0.69, "logps/chosen": chosen, "logps/rejected": rejected,
                    "grad_norm": grad_norm, "tokens_per_s": 1.0},
                   {"step": 2, "loss": 0.6, "tokens_per_s": tokens_per_s}]
        return gpu_tune.measure(metrics)

    rows = [{"variant": name, "flags": [], "rc": 0, "seconds": 1.0, **measured} for name, measured in (
        ("default", run(-1000.0, -2000.0, 4.0)), ("liger", run(-1000.5, -2000.0, 4.004)),
        ("broken", run(-1100.0, -2000.0, 4.0)), ("failed", gpu_tune.measure([])))]
    gpu_tune.first_step_differences(rows)
    assert [r["first_step_logps_rel_diff"] for r in rows[:3]] == [0.0, 0.5 / 1000, 100 / 1000]
    assert rows[1]["first_step_grad_norm_rel_diff"] == pytest.approx(1e-3)
    assert rows[3]["first_step_logps_rel_diff"] is None and rows[3]["first_step_grad_norm_rel_diff"] is None
    lines = gpu_tune.describe(rows)
    cells = [[cell.strip() for cell in line.split("|")[1:-1]] for line in lines[2:6]]
    column = lines[0].split("|")[1:-1].index(" step-1 logps vs first ")
    assert [c[column] for c in cells] == ["-", "5.0e-04", "**1.0e-01**", "-"]
    assert [c[column + 1] for c in cells] == ["-", "1.0e-03", "0.0e+00", "-"]
