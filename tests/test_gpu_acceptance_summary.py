"""scripts/gpu_acceptance.py summarize: acceptance.json's figures are the runs' own (steps after the first, ours over
TRL's pairs/s), and acceptance.md says what ran as the run's plan says it (a CPU smoke run is not a bf16 GPU run)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location(
    "gpu_acceptance", Path(__file__).resolve().parents[1] / "scripts" / "gpu_acceptance.py")
gpu_acceptance = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(gpu_acceptance)


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


@pytest.mark.parametrize("backend, dtype", [("torch_varlen", "bf16"), ("sdpa_varlen", "fp32")])
def test_the_summary_carries_the_runs_figures_and_names_what_ran(tmp_path, backend, dtype):
    write_jsonl(tmp_path / "stages.jsonl", [{"stage": "train", "rc": 0, "seconds": 40.5},
                                            {"stage": "bench", "rc": 124, "seconds": 210.0}])
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "plan_summary.json").write_text(json.dumps(
        {"layout": {"world_size": 1}, "attention": {"backend": backend, "dtype": dtype}}))
    write_jsonl(tmp_path / "train" / "metrics.jsonl", [
        {"step": step, "loss": 0.69, "tokens_per_s": tokens, "pairs_per_s": tokens / 2000, "mfu": mfu,
         "model_tflops_per_s": mfu * 989, "peak_mem_mb": peak}
        for step, tokens, mfu, peak in ((1, 1000.0, 0.01, 100.0), (2, 40000.0, 0.24, 49600.4), (3, 42000.0, 0.26, 49000.0))])
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "report.json").write_text(json.dumps({"runs": {"packed": {"attn": backend, "pairs_per_s": 25.0}}}))
    (tmp_path / "trl.json").write_text(json.dumps({"trl": "1.16.0", "pairs_per_s": 5.0, "peak_memory_gib": 30.7}))

    assert gpu_acceptance.summarize(tmp_path) == 0
    summary = json.loads((tmp_path / "acceptance.json").read_text())
    assert summary["train"]["measured_steps"] == 2  # the first step (allocation, kernel selection) left out
    assert summary["train"]["tokens_per_s"] == 41000.0 and summary["train"]["mfu"] == pytest.approx(0.25)
    assert summary["train"]["peak_memory"] == 49600.4 and summary["ours_over_trl_pairs_per_s"] == 5.0
    text = (tmp_path / "acceptance.md").read_text()
    assert "| bench | 124 | 210.0 |" in text
    assert (f"Training (1 rank, ZeRO-3, {dtype}, {backend}, 2 measured steps): 41,000 tokens/s, 20.5 pairs/s, "
            f"MFU 0.250, peak memory 49,600 MB") in text
    assert "ours (packed) / TRL: 5" in text
