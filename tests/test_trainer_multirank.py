"""End-to-end multi-rank runs (slow start-up: few launches, each checking several things)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from launching import SMALL_RUN, main_per_case, ranks_module, read_metrics, run
from test_bad_input import assert_one_line_error


def launch(tmp_path: Path, name: str, procs: int, *flags: str) -> list[dict]:
    out = tmp_path / name
    run(ranks_module(procs, "ds_packdpo.train", "--output-dir", str(out), "--cache-dir", str(tmp_path / "cache"),
                         *SMALL_RUN, *flags))
    return read_metrics(out / "metrics.jsonl")


# A quarter of the 48 pairs held out by content (12: 36 train in 3 steps of 12), evaluated after steps 2 and 3.
HELD_OUT = ("--eval-fraction", "0.25", "--eval-steps", "2")
EVAL_KEYS = ("eval_loss", "eval_rewards/accuracies", "eval_rewards/margins", "eval_rewards/chosen",
             "eval_rewards/rejected", "eval_logps/chosen", "eval_logps/rejected", "eval_logits/chosen")


@pytest.mark.multirank
def test_trajectory_independent_of_layout(tmp_path):
    """Invariant 2: world size 1 vs 2, packed vs padded, prefix sharing on or off, row budget and sequence parallelism
    give one trajectory, and the same held-out evaluation figures.  The reference runs every prompt twice
    (--no-prefix-sharing); the packed layouts share each pair's prompt (the default), the padded one cannot."""
    reference = launch(tmp_path, "w1_packed", 1, "--max-tokens-per-row", "1024", "--no-prefix-sharing", *HELD_OUT)
    layouts = {
        # --profile-steps: step 2 under torch.profiler (the trajectory stays the reference's: checked below)
        "w2_packed": launch(tmp_path, "w2_packed", 2, "--max-tokens-per-row", "1024", "--profile-steps", "1",
                            *HELD_OUT),
        "w2_small_rows": launch(tmp_path, "w2_small", 2, "--max-tokens-per-row", "200", *HELD_OUT),
        "w2_padded": launch(tmp_path, "w2_padded", 2, "--no-packing", "--micro-batch-pairs", "2", *HELD_OUT),
        # Sequence parallelism: one group of 2 ranks shares every row of 2 x 100 tokens; most pairs need more
        # than 100 (test_sequence_parallel.py checks that S=1 refuses this budget).
        "w2_sp2_small_rows": launch(tmp_path, "w2_sp2", 2, "--max-tokens-per-row", "100",
                                    "--sequence-parallel-size", "2", *HELD_OUT),
    }
    assert [r["step"] for r in reference] == [1, 2, 3]
    assert reference[0]["loss"] == pytest.approx(0.693147, abs=1e-5)  # policy == reference at step 1
    assert reference[-1]["loss"] < reference[0]["loss"]
    # the default schedule, linear decay without warm-up over the 3 steps: (T + 1 - s) / (T - 1) from step 2
    assert [r["learning_rate"] for r in reference] == pytest.approx([1e-3, 1e-3, 5e-4], rel=1e-12)
    summary = json.loads((tmp_path / "w1_packed" / "plan_summary.json").read_text())
    assert (summary["pairs"], summary["steps"], summary["eval_pairs"], summary["eval_steps"]) == (36, 3, 12, 2)
    assert ["eval_loss" in r for r in reference] == [False, True, True]  # every 2 steps and after the last
    assert reference[1]["eval_pairs"] == 12 and reference[-1]["eval_loss"] < reference[1]["eval_loss"]
    assert not (tmp_path / "w1_packed" / "profile.json").exists()
    profiled = json.loads((tmp_path / "w2_packed" / "profile.json").read_text())
    assert (profiled["device"], profiled["steps"], profiled["profiled_steps"]) == ("cpu", 1, [2, 2])
    shares = {row["category"]: row["share"] for row in profiled["categories"]}
    assert shares["zero3_gather"] > 0 and shares["reduce_scatter"] > 0 and shares["gemm"] > 0  # ZeRO-3 on 2 ranks
    largest = 0.0
    for name, records in layouts.items():
        for ref, got in zip(reference, records, strict=True):
            assert got["pairs"] == ref["pairs"] == 12, name
            assert got["tokens"] == ref["tokens"], name
            for key in ("loss", "grad_norm", "rewards/margins", "logps/chosen"):
                assert got[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), (name, key, got[key], ref[key])
            assert ("eval_loss" in got) == ("eval_loss" in ref) and got.get("eval_pairs") == ref.get("eval_pairs")
            for key in EVAL_KEYS if "eval_loss" in ref else ():
                assert got[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-6), (name, key, got[key], ref[key])
                largest = max(largest, abs(got[key] - ref[key]) / max(abs(ref[key]), 1e-6))
    print("eval figures over the layouts, largest relative difference:", largest)
    # the small budget really splits rows; padding never computes fewer tokens than packing
    assert max(r["rows_per_rank"] for r in layouts["w2_small_rows"]) > max(r["rows_per_rank"] for r in layouts["w2_packed"])
    padded = layouts["w2_padded"]
    assert all(r["computed_tokens"] >= r["tokens"] for r in padded)
    assert any(r["computed_tokens"] > r["tokens"] for r in padded)  # --no-packing really ran padded micro-batches
    assert all(r["computed_tokens"] == r["tokens"] and r["prompt_tokens_shared"] == 0 for r in reference)
    assert all(r["prompt_tokens_shared"] == 0 for r in padded)
    for name in ("w2_packed", "w2_small_rows", "w2_sp2_small_rows"):  # each prompt computed once
        assert all(0 < r["prompt_tokens_shared"] < r["tokens"] // 2 for r in layouts[name]), name
        assert all(r["computed_tokens"] == r["tokens"] - r["prompt_tokens_shared"] for r in layouts[name]), name
    for key in ("step", "epoch", "loss", "grad_norm", "learning_rate", "pairs", "tokens", "tokens_per_s", "rewards/chosen",
                "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected",
                "logits/chosen", "logits/rejected"):
        assert key in reference[0]
    assert all(50 < r["peak_mem_mb"] < 20_000 for r in reference)  # this rank's peak RSS (CPU), MiB


@pytest.mark.multirank
def test_combined_trl_losses_independent_of_layout(tmp_path):
    """A weighted combination of TRL 1.16 losses (model/loss_registry.py) gives one trajectory on 1 rank and on 2 ranks
    with sequence parallelism and small rows (the layouts furthest apart), padded, and with 200-token rows."""
    combo = ("--loss", "sigmoid,bco_pair,ipo,nca_pair,apo_zero", "--loss-weights", "1,0.5,0.25,0.5,0.3")
    reference = launch(tmp_path, "w1_combo", 1, "--max-tokens-per-row", "1024", "--no-prefix-sharing", *combo)
    layouts = {
        "w2_sp2_small_rows": launch(tmp_path, "w2_sp2_combo", 2, "--max-tokens-per-row", "100",
                                    "--sequence-parallel-size", "2", *combo),
        "w2_padded": launch(tmp_path, "w2_padded_combo", 2, "--no-packing", "--micro-batch-pairs", "2", *combo),
        "w2_rows_200": launch(tmp_path, "w2_200_combo", 2, "--max-tokens-per-row", "200", *combo),
    }
    # --loss/--loss-weights reached the loss: the default sigmoid loss is log 2 at step 1 of this run (policy ==
    # reference; test_trajectory_independent_of_layout's reference, these flags, checks it to 1e-5)
    assert reference[0]["loss"] != pytest.approx(math.log(2), rel=1e-3)
    assert reference[-1]["loss"] < reference[0]["loss"]
    assert_same_trajectory(reference, layouts)


def assert_same_trajectory(reference: list[dict], layouts: dict[str, list[dict]], eval_keys=()) -> None:
    """Every layout's 3 steps (and held-out figures) equal the reference's within the trajectory test's bounds."""
    for name, records in layouts.items():
        for ref, got in zip(reference, records, strict=True):
            assert got["pairs"] == ref["pairs"] and got["tokens"] == ref["tokens"], name
            for key in ("loss", "grad_norm", "rewards/margins", "logps/chosen", "entropy", "mean_token_accuracy"):
                assert got[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), (name, key, got[key], ref[key])
            for key in eval_keys if "eval_loss" in ref else ():
                assert got[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-6), (name, key, got[key], ref[key])


@pytest.mark.multirank
def test_batch_coupled_losses_independent_of_layout(tmp_path):
    """aot, aot_unpaired and sft sort or token-average over the whole optimizer step (run/step_statistics.py), and
    the held-out figures over the whole held-out set: one big row on 1 rank, and on 2 ranks S=2 with 100-token rows,
    padded micro-batches of 2 pairs, and 200-token rows, give one trajectory.  TRL's per-micro-batch statistic would
    not (the rows of a step differ in every layout)."""
    combo = ("--loss", "sigmoid,aot,aot_unpaired,sft", "--loss-weights", "1,0.5,0.7,0.3", "--label-smoothing", "0.1",
             *HELD_OUT)
    reference = launch(tmp_path, "w1_one_row", 1, "--max-tokens-per-row", "4096", "--no-prefix-sharing", *combo)
    layouts = {
        "w2_sp2_small_rows": launch(tmp_path, "w2_sp2", 2, "--max-tokens-per-row", "100", "--sequence-parallel-size",
                                    "2", *combo),
        "w2_padded": launch(tmp_path, "w2_padded", 2, "--no-packing", "--micro-batch-pairs", "2", *combo),
        "w2_rows_200": launch(tmp_path, "w2_200", 2, "--max-tokens-per-row", "200", *combo),
    }
    assert all(r["rows_per_rank"] == 1 for r in reference)  # the whole step in one row: TRL's batch is the step
    assert all(r["rows_per_rank"] > 1 for name in ("w2_sp2_small_rows", "w2_padded") for r in layouts[name])
    assert ["eval_loss" in r for r in reference] == [False, True, True]
    assert reference[-1]["loss"] < reference[0]["loss"] and reference[-1]["eval_loss"] < reference[1]["eval_loss"]
    assert_same_trajectory(reference, layouts, EVAL_KEYS)


@pytest.mark.multirank
def test_ld_alpha_and_use_weighting_independent_of_layout(tmp_path):
    """LD-DPO and WPO (model/token_weights.py) with a length-normalized loss beside: one trajectory on 1 rank with
    one big unshared row and on 2 ranks with sequence parallelism, small prefix-shared rows (the LD sums and WPO's
    statistic summed over the slices).  At step 1 the policy is the reference, so the loss is log 2 times the mean
    WPO weight: below log 2, which shows --use-weighting reached the loss."""
    flags = ("--ld-alpha", "0.5", "--use-weighting", "--loss", "sigmoid,ipo", "--loss-weights", "1,0.5")
    reference = launch(tmp_path, "w1_weighted", 1, "--max-tokens-per-row", "1024", "--no-prefix-sharing", *flags)
    sp2 = launch(tmp_path, "w2_sp2_weighted", 2, "--max-tokens-per-row", "100", "--sequence-parallel-size", "2",
                 *flags)
    ipo_at_start = 0.5 * (1 / (2 * 0.1)) ** 2  # IPO's loss at policy = reference, weighted 0.5
    assert 0 < reference[0]["loss"] < 0.693147 + ipo_at_start - 1e-3
    assert reference[-1]["loss"] < reference[0]["loss"]
    largest = 0.0
    for ref, got in zip(reference, sp2, strict=True):
        for key in ("loss", "grad_norm", "rewards/margins", "logps/chosen"):
            assert got[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), (key, got[key], ref[key])
            largest = max(largest, abs(got[key] - ref[key]) / max(abs(ref[key]), 1e-6))
    print("LD-DPO + WPO over the layouts, step-1 loss", reference[0]["loss"], "largest relative difference", largest)


@pytest.mark.multirank
def test_uneven_data_finishes_without_hang(tmp_path):
    """3 pairs on 2 ranks: one rank runs a dummy row so both run the same number of forwards.  The same launch shows
    --loss and --warmup-steps in the metrics: IPO's step-1 loss (policy = reference) is (1 / (2 beta))^2, and the LR
    climbs by --lr / 4 a step, from the first step on (DeepSpeed's own start ran the first two at 0)."""
    runs = launch(tmp_path, "uneven", 2, "--synthetic-pairs", "3", "--global-batch-pairs", "3", "--max-steps", "3",
                  "--epochs", "3", "--loss", "ipo", "--warmup-steps", "4")
    assert [r["pairs"] for r in runs] == [3, 3, 3]
    assert all(r["rows_per_rank"] >= 1 for r in runs)
    assert runs[0]["loss"] == pytest.approx((1 / (2 * 0.1)) ** 2, rel=1e-6)
    assert [r["learning_rate"] for r in runs] == pytest.approx([2.5e-4, 5e-4, 7.5e-4], rel=1e-12)


BAD_CONFIGURATIONS = [
    (["--max-length", "256", "--max-tokens-per-row", "64"], "--max-tokens-per-row"),
    (["--attn", "nonsense"], "--attn"),
    (["--attn", "flash_attention_2"], "flash_attention_2"),
    (["--ds-config", "BATCH", "--global-batch-pairs", "4"],
     "'gradient_accumulation_steps': 8 (x micro-batch 4 x 1 data-parallel ranks = 32 pairs) and --global-batch-pairs"),
    (["--ds-config", "NOTJSON"], "not valid JSON"),
    (["--model", "/nonexistent/model"], "--model /nonexistent/model"),
    (["--global-batch-pairs", "4", "--tokens-per-step", "100"], "exclusive"),
]


def test_bad_configuration_fails_before_process_group(tmp_path):
    """Each case ends a rank in phase one: exit code 2, one line naming the flag, no output folder."""
    batch = tmp_path / "batch.json"
    batch.write_text(json.dumps({"gradient_accumulation_steps": 8, "zero_optimization": {"stage": 3}}))
    notjson = tmp_path / "bad.json"
    notjson.write_text("{ not json")
    cases = []
    for case, (flags, _) in enumerate(BAD_CONFIGURATIONS):
        flags = [str(batch) if f == "BATCH" else str(notjson) if f == "NOTJSON" else f for f in flags]
        cases.append((["--output-dir", str(tmp_path / f"out{case}"), "--cache-dir", str(tmp_path / "cache"),
                       *flags], {}))
    results = main_per_case("ds_packdpo.train", cases)
    for case, ((flags, message), (code, stderr)) in enumerate(zip(BAD_CONFIGURATIONS, results, strict=True)):
        assert_one_line_error(code, stderr, message)
        assert not (tmp_path / f"out{case}").exists(), flags  # nothing written
