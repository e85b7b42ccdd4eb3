"""Precomputed reference log-probs: one 2-rank precompute, checked against an independent padded forward, then
training with the file against training with the live reference engine (the layout test's small run, its loss sigmoid
and the batch-coupled aot_unpaired and sft)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from launching import SMALL_DATA, SMALL_RUN, cpu_env, ranks_module, ranks_script, read_metrics, run

from ds_packdpo.config import parse_train_args
from ds_packdpo.errors import InputError
from ds_packdpo.run.reference_parts import check_parts, kept_steps, parts_folder, read_shards, write_shard

BUDGET = ["--max-tokens-per-row", "400"]


def save_tiny_model(folder: Path, seed: int) -> Path:
    """A tiny random model with the embedded data's tokenizer, as an HF folder.

    A folder rather than ``--model-config tiny``: random weights built under ZeRO-3
    differ from those built without it for the same seed, and the padded check below
    runs without DeepSpeed.
    """
    from ds_packdpo.model.build import build_model
    from ds_packdpo.data.synthetic import default_tokenizer, synthetic_preference_rows

    tokenizer = default_tokenizer(synthetic_preference_rows(48, seed=0))
    build_model(None, "tiny", len(tokenizer), torch.float32, "sdpa", seed=seed).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def padded_reference_logps(flags: list[str]) -> dict[int, tuple[float, float, int, int]]:
    """Independent of packing, chunking and lean log-probs: the model loaded without DeepSpeed, padded rows,
    a full log_softmax and a masked sum per row."""
    from ds_packdpo.model.collate import collate_padded
    from ds_packdpo.data.tokenizer import pad_token_id
    from ds_packdpo.model.build import build_model
    from ds_packdpo.data.source import prepare_run_data, tokenizer_and_rows

    cfg = parse_train_args(flags)
    data = cfg.data_spec()
    tokenizer, rows = tokenizer_and_rows(data)
    prepared = prepare_run_data(data.tokenization, tokenizer, rows)
    model = build_model(cfg.model, None, len(tokenizer), torch.float32, "sdpa").eval()
    pad = pad_token_id(tokenizer)
    columns = prepared.dataset
    result = {}
    for start in range(0, len(columns), 8):
        indices = list(range(start, min(start + 8, len(columns))))
        cols = columns[indices]
        pairs = [{"prompt_ids": p, "chosen_ids": c, "rejected_ids": r}
                 for p, c, r in zip(cols["prompt_ids"], cols["chosen_ids"], cols["rejected_ids"])]
        batch = collate_padded(pairs, indices, pad)
        with torch.no_grad():
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
        mask = batch.labels != -100
        token_logps = torch.log_softmax(logits.double(), -1).gather(-1, batch.labels.clamp_min(0)[..., None])[..., 0]
        sums, counts = (token_logps * mask).sum(1), mask.sum(1)  # fp64 log-probs and sums, as model.logps
        n = len(indices)
        for i, pair_id in enumerate(cols["pair_id"]):
            result[pair_id] = (sums[i].item(), sums[n + i].item(), int(counts[i]), int(counts[n + i]))
    return result


def train_main(*flags: str) -> int:
    from ds_packdpo.train import main

    return main(list(flags))


@pytest.mark.multirank
def test_precomputed_reference_matches_padded_forward_and_live_training(tmp_path, capsys):
    model = save_tiny_model(tmp_path / "model", seed=0)
    cache = ["--cache-dir", str(tmp_path / "cache"), "--model", str(model)]
    out = tmp_path / "ref" / "reference.jsonl"
    run(ranks_module(2, "ds_packdpo.precompute_ref", "--out", str(out), *cache, *BUDGET, *SMALL_DATA))

    # 1. the file: one line per pair, the same pair ids as `prepare --out`, values of an independent padded forward
    records = [json.loads(line) for line in out.read_text().splitlines()]
    meta = json.loads(Path(f"{out}.meta.json").read_text())
    assert meta["info"]["world_size"] == 2 and meta["fingerprint"]["dtype"] == "fp32"
    from ds_packdpo.data.prepare import run_prepare
    from ds_packdpo.data.source import tokenizer_and_rows

    data = parse_train_args([*cache, *SMALL_RUN]).data_spec()
    tokenizer, rows = tokenizer_and_rows(data)
    run_prepare(data.tokenization, tokenizer, tmp_path / "pairs.jsonl", rows=rows)
    prepared_ids = [json.loads(line)["pair_id"] for line in (tmp_path / "pairs.jsonl").read_text().splitlines()]
    assert [r["pair_id"] for r in records] == sorted(prepared_ids) and len(records) == 48
    expected = padded_reference_logps([*cache, *SMALL_RUN])
    worst = 0.0
    for record in records:
        chosen, rejected, chosen_tokens, rejected_tokens = expected[record["pair_id"]]
        assert (record["chosen_tokens"], record["rejected_tokens"]) == (chosen_tokens, rejected_tokens)
        # Sums are fp64 on both sides, in the file too; what is left is the kernels' per-token rounding (packed
        # per-sequence sdpa + lean chunks against padded sdpa + full log_softmax: 1e-7 per token).  With the file's
        # fp32 values of format version 1 this needed another 2.4e-7 x |sum| (2.2e-5 nats at 661 nats).
        for got, want, tokens in ((record["chosen_logps"], chosen, chosen_tokens),
                                  (record["rejected_logps"], rejected, rejected_tokens)):
            worst = max(worst, abs(got - want) / (1e-7 * tokens))
    assert worst <= 1.0, worst

    # 2. training with the file = training with the live reference engine (fp32, 1e-5)
    def launch(name: str, *flags: str) -> list[dict]:
        run(ranks_module(2, "ds_packdpo.train", "--output-dir", str(tmp_path / name), *cache, *BUDGET, *SMALL_RUN,
                             *flags))
        return read_metrics(tmp_path / name / "metrics.jsonl")

    # Both evaluate a held-out quarter after steps 2 and 3: the file (of all 48 pairs) serves the held-out ones too.
    # One pair of runs for the plain and the batch-coupled paths: sigmoid's per-row loss and the rewards read the
    # reference's sums as a sigmoid-only run does (Run.reference_logps, called at the row's backward there, in the
    # pre-pass here), and the whole-step pre-pass of aot/aot_unpaired (run/step_statistics.py) reads the file instead
    # of running the reference, in training and on the held-out set.
    held_out = ("--eval-fraction", "0.25", "--eval-steps", "2")
    coupled = ("--loss", "sigmoid,aot_unpaired,sft", "--loss-weights", "1,0.5,0.3", *held_out)
    live = launch("live", *coupled)
    precomputed = launch("precomputed", "--ref-logps", str(out), *coupled)
    # policy == reference at step 1 (a sigmoid-only run's loss is log 2 there): the rewards are 0; --loss reached the
    # loss, which falls
    assert live[0]["rewards/margins"] == pytest.approx(0.0, abs=2e-5)
    assert live[0]["rewards/chosen"] == pytest.approx(0.0, abs=2e-5)
    assert live[0]["loss"] != pytest.approx(math.log(2), rel=1e-3) and live[-1]["loss"] < live[0]["loss"]
    assert ["eval_loss" in r for r in precomputed] == [False, True, True]
    for want, got in zip(live, precomputed, strict=True):
        for key in ("loss", "grad_norm", "rewards/chosen", "rewards/margins", "logps/chosen", "logits/chosen",
                    *(("eval_loss", "eval_rewards/margins", "eval_rewards/chosen", "eval_logps/rejected")
                      if "eval_loss" in want else ())):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), (key, got[key], want[key])

    # 3. a file that does not fit the run is refused before any process group, in one line
    base = ["--output-dir", str(tmp_path / "refused"), *cache, *BUDGET, *SMALL_RUN]
    missing = tmp_path / "missing.jsonl"
    missing.write_text("\n".join(out.read_text().splitlines()[1:]) + "\n")
    shutil.copy(f"{out}.meta.json", f"{missing}.meta.json")
    no_meta = tmp_path / "no_meta.jsonl"
    shutil.copy(out, no_meta)
    for flags, message in [
        (["--ref-logps", str(out), "--max-length", "90"], "computed for a different dataset, max_length"),
        (["--ref-logps", str(out), "--ref-model", str(save_tiny_model(tmp_path / "other", seed=1))],
         "computed for a different model"),
        (["--ref-logps", str(missing)], f"no reference log-probs for pair_id {records[0]['pair_id']}"),
        (["--ref-logps", str(no_meta)], "no fingerprint file"),
        (["--ref-logps", str(out), "--loss", "simpo"], "reference-free"),
    ]:
        assert train_main(*base, *flags) == 2, flags
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last.startswith("error: --ref-logps") and message in last, last
    assert not (tmp_path / "refused").exists()

    # 4. killed half-way (rank 0, once the results of step 2 are kept) and rerun: the files of the uninterrupted run
    resumed = tmp_path / "ref" / "resumed.jsonl"
    settings = [*cache, *BUDGET, *[flag for flag in SMALL_DATA if flag != "--overwrite"]]
    killed = run(ranks_module(2, "ds_packdpo.precompute_ref", "--out", str(resumed), *settings), check=False,
                 env=cpu_env(DS_PACKDPO_FAULT_KILL="0:2:reference"))
    assert killed.returncode != 0 and not resumed.exists()
    manifest = json.loads((parts_folder(resumed) / "manifest.json").read_text())
    assert manifest["steps"] == 4 and manifest["steps_per_shard"] == 1 and manifest["max_tokens_per_row"] == 400
    assert sorted(p.name for p in parts_folder(resumed).iterdir()) == [
        "manifest.json", "steps-0000001-0000001.npz", "steps-0000002-0000002.npz"]
    from ds_packdpo.cli import main as cli_main

    assert cli_main(["precompute-ref", "--out", str(resumed), *settings, "--max-tokens-per-row", "500"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == (f"error: --out {resumed}: resumed.jsonl.parts holds work of an interrupted run under another "
                     f"max_tokens_per_row (kept 400, this run 500); rerun with its settings to continue, or pass "
                     f"--overwrite to start over"), last
    rerun = run(ranks_module(2, "ds_packdpo.precompute_ref", "--out", str(resumed), *settings))
    assert rerun.stdout.count(f"continuing after step 2 of 4") == 1, rerun.stdout
    assert resumed.read_bytes() == out.read_bytes()
    assert Path(f"{resumed}.meta.json").read_bytes() == Path(f"{out}.meta.json").read_bytes()
    assert not parts_folder(resumed).exists()


@pytest.mark.multirank
def test_lean_gradients_reach_zero3_partitions(tmp_path):
    """2 ranks, ZeRO-3 with every parameter partitioned, untied and tied embeddings, ranks with different
    chunk counts and a dummy row: every parameter's gradient assembled from DeepSpeed's partitions after
    engine.backward is the same with lean, fused (its wiring, through a stand-in kernel on CPU) and plain
    log-probs (see tests/zero3_lean_check.py); and the
    V x H lm_head is all-gathered once per row in forward and once in backward, whatever the chunk count
    (it was once per chunk and twice per chunk: 15 and 30 at 71 tokens in chunks of 5).  Fused runs after every
    row's plain and lean (a third forward per row without an optimizer step changes ZeRO-3's prefetch trace, and
    the counts with it); its gather counts (the same head call as lean's) are not compared.  --ref-whole's reference
    engine: every parameter persistent, no gather of the head in its forward (the partitioned one gathers it), the
    same log-probs."""
    out = tmp_path / "report.json"
    run(ranks_script(2, "tests/zero3_lean_check.py", str(out)))
    report = json.loads(out.read_text())
    for model in ("untied", "tied"):
        worst = report[model]
        assert worst["grad_scale"] > 1e-3, worst  # the check has gradients to compare
        assert worst["grad"] <= 1e-5 * worst["grad_scale"], (model, worst)
        assert worst["logps"] <= 1e-5 * worst["logps_scale"], (model, worst)
        rows = [row for rank in worst["head_gathers"] for row in rank]
        assert max(r["completion_tokens"] for r in rows) > 10 * 5 and min(r["completion_tokens"] for r in rows) == 0
        for row in rows:
            lean, plain = row["lean"], row["plain"]
            # a tied weight is also the input embedding: its own gathers (plain: 2 and 2) come on top of the head's
            assert lean["forward"] == 1 and lean["backward"] == plain["backward"] == (2 if model == "tied" else 1), row
    for whole in report["whole_reference"]:  # each rank's
        assert whole["persistent"] == [False, True] and whole["gathers"][0] >= 2 and whole["gathers"][1] == 0, whole
        assert whole["logps"] <= 1e-6 * whole["logps_scale"] and whole["logps_scale"] > 1.0, whole


def test_kept_reference_work_is_continued_refused_or_started_over(tmp_path, capsys):
    """run/reference_parts.py without a model: the steps kept are the unbroken run of shards from step 1; work under
    other settings is refused without --overwrite and removed with it (said once); the shards read back exactly."""
    out = tmp_path / "ref.jsonl"
    settings = {"reference": {"model": "x" * 64}, "steps": 9, "steps_per_shard": 2, "max_tokens_per_row": 400}
    assert kept_steps(out, settings) == 0 and capsys.readouterr().out == ""
    columns = {"pair_id": np.array([3, 1]), "chosen_logps": np.array([-1 / 3, -1e5 / 7])}
    write_shard(out, 1, 2, columns)
    write_shard(out, 3, 4, {"pair_id": np.array([0]), "chosen_logps": np.array([-2.5])})
    write_shard(out, 7, 8, {"pair_id": np.array([9]), "chosen_logps": np.array([-9.0])})  # past a gap: not used
    assert kept_steps(out, settings) == 4
    assert "continuing after step 4 of 9" in capsys.readouterr().out
    kept = read_shards(out, ("pair_id", "chosen_logps"), 4)
    assert kept["pair_id"].tolist() == [3, 1, 0] and kept["chosen_logps"].tolist() == [-1 / 3, -1e5 / 7, -2.5]
    check_parts(out, lambda: settings, overwrite=False)  # the same settings: nothing to say
    other = {**settings, "max_tokens_per_row": 500, "reference": {"model": "y" * 64}}
    with pytest.raises(InputError, match=r"under another max_tokens_per_row \(kept 400, this run 500\), reference;"):
        check_parts(out, lambda: other, overwrite=False)
    check_parts(out, lambda: other, overwrite=True)
    assert kept_steps(out, other) == 0
    assert capsys.readouterr().out.count("starting over") == 1
    assert sorted(p.name for p in parts_folder(out).iterdir()) == ["manifest.json"]
