"""Checkpoints, exact resume, a killed rank, NaN steps and the Hugging Face export, end to end.

Launches are slow (~20-25 s each with 2 ranks), so each test checks several things.
Runs of one rank go without a launcher (``python -m ds_packdpo.train``).
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from pathlib import Path

import pytest
import torch
from launching import BIN, cpu_env, free_port, rank_module, ranks_module, read_metrics, run, two_node_launch
from test_scale import closed_form
import specs

from ds_packdpo import cli
from ds_packdpo.run.checkpoint import LATEST, STATE_FILE
from ds_packdpo.run.manifest import MANIFEST_FILE
from ds_packdpo.run.process_group import ROLL_CALL_S

COMMON = ["--synthetic-pairs", "48", "--global-batch-pairs", "8", "--max-length", "96", "--lr", "1e-3",
          "--dtype", "fp32", "--no-progress", "--max-steps", "6"]
# What the engine runs with, in the first record of each run (a resumed one too: trainer.engine_settings)
RUN_SETTINGS = frozenset({"dtype", "optimizer", "weight_decay", "max_grad_norm", "adam_betas", "adam_epsilon"})
TIMING = ("step_time_s", "tokens_per_s", "pairs_per_s", "peak_mem_mb")  # measured, not computed
RESUME_TOL = 1e-6  # the bound for fp32 on CPU (measured: 0.0, bitwise identical)


def flags(tmp_path: Path, out: str, *extra: str) -> list[str]:
    return ["--output-dir", str(tmp_path / out), "--cache-dir", str(tmp_path / "cache"), *COMMON, *extra]


def assert_same_steps(got: list[dict], want: list[dict], steps: range) -> float:
    """Every metric of ``steps`` (1-based) agrees to RESUME_TOL, timings excepted; returns the largest difference."""
    by_step = {r["step"]: r for r in got}
    largest = 0.0
    for step in steps:
        ref, new = want[step - 1], by_step[step]
        assert ref["step"] == step and set(new) - RUN_SETTINGS == set(ref) - RUN_SETTINGS
        for key, value in ref.items():
            if key in TIMING or (key in RUN_SETTINGS and key not in new):
                continue
            if isinstance(value, float):
                assert new[key] == pytest.approx(value, rel=RESUME_TOL, abs=RESUME_TOL), (step, key)
                largest = max(largest, abs(new[key] - value))
            else:
                assert new[key] == value, (step, key)
    return largest


@pytest.mark.multirank
def test_zero2_resume_continues_exactly_one_rank(tmp_path):
    """A run of 3 steps resumed with --max-steps 6 equals a run of 6 steps: exact with a constant LR (a decaying
    schedule spans the run's own total steps, which --max-steps changes; its resume: the two-rank test below).  The
    run prints its plan summary before anything else on stdout.  Under ZeRO-2 (ZeRO-3's resumes: the 2-rank tests
    below): its optimizer files pickle parameter slice addresses (``fragment_address``), which the weights-only scan
    and load take, so a ZeRO-2 run resumes (it used to find "no intact checkpoint") and continues the uninterrupted
    one."""
    constant = ("--ds-config", "zero2", "--lr-scheduler", "constant")
    straight = tmp_path / "straight"
    proc = run(rank_module("ds_packdpo.train", *flags(tmp_path, "straight", *constant)))
    first = proc.stdout.splitlines()[0]
    assert first.startswith("plan: 48 pairs in 6 steps (48 training pairs), 2 rows per rank on 1 rank (") and \
        "attention sdpa_varlen fp32 with prefix sharing and prompt groups, lock-step" in first and \
        first.endswith("no evaluation; schedule: constant lr 0.001 over 6 steps, no warm-up"), proc.stdout[:2000]
    split = tmp_path / "split"
    run(rank_module("ds_packdpo.train", *flags(tmp_path, "split", *constant, "--save-steps", "3", "--max-steps", "3")))
    state = json.loads((split / "checkpoints" / "global_step3" / STATE_FILE).read_text())
    assert state["position"] == {"epoch": 0, "epoch_step": 3, "global_step": 3}
    assert (split / "checkpoints" / LATEST).read_text() == "global_step3"
    # resuming into the run's own (non-empty) folder needs no --overwrite; the metrics file is continued
    run(rank_module("ds_packdpo.train", *flags(tmp_path, "split", *constant, "--save-steps", "3", "--resume", "auto",
                                               "--save-total-limit", "1")))
    resumed = read_metrics(split / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    print("1 rank ZeRO-2, resumed vs uninterrupted, largest metric difference:",
          assert_same_steps(resumed, read_metrics(straight / "metrics.jsonl"), range(1, 7)))
    assert (split / "checkpoints" / LATEST).read_text() == "global_step6"
    assert not (split / "checkpoints" / "global_step3").exists()  # --save-total-limit 1


@pytest.mark.multirank
def test_nan_steps_are_skipped_then_the_run_aborts(tmp_path):
    """NaN at steps 1, 3, 4 with --max-bad-steps 2: 1 is skipped, 2 trains, 3 and 4 are skipped, then abort."""
    env = cpu_env(DS_PACKDPO_FAULT_NAN_STEPS="1,3,4")
    proc = run(rank_module("ds_packdpo.train", *flags(tmp_path, "nan", "--max-bad-steps", "2")), check=False, env=env)
    assert proc.returncode == 4, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: 2 consecutive steps (up to step 4) had a non-finite loss or gradient (--max-bad-steps 2); aborting")
    assert "step 1 skipped: non-finite loss or gradient (1 in a row, --max-bad-steps 2)" in proc.stderr
    records = read_metrics(tmp_path / "nan" / "metrics.jsonl")
    assert [r["skipped"] for r in records] == [True, False, True, True]
    assert all(not math.isfinite(r["grad_norm"]) for r in records if r["skipped"])
    # step 1 changed nothing: at step 2 the policy still equals the reference (loss log 2, margin 0)
    assert records[1]["loss"] == pytest.approx(math.log(2), abs=1e-7)
    assert records[1]["rewards/margins"] == 0.0 and math.isfinite(records[1]["grad_norm"])


def step_logps(model, tmp_path: Path, step: int, tokenizer) -> tuple[float, float]:
    """Mean chosen/rejected log-probs of ``model`` over the pairs of optimizer ``step`` (one packed row)."""
    from ds_packdpo.config import parse_train_args
    from ds_packdpo.data.run_plan import run_plan
    from ds_packdpo.model.collate import collate_row
    from ds_packdpo.model.logps import forward_logps
    from ds_packdpo.run.assemble import prepare

    setup = prepare(parse_train_args(flags(tmp_path, "plan_only")))
    plan = next(iter(run_plan(setup.prepared, setup.spec.plan.config, 1, start_step=step - 1)))
    batch = collate_row(setup.prepared.dataset, plan.pairs, tokenizer.pad_token_id)
    with torch.no_grad():
        out = forward_logps(model, batch, "sdpa")
    return float(out.chosen_logps.mean()), float(out.rejected_logps.mean())


# A warm-up, then a cosine decay to a floor: the resumes below land in the middle of it.  Weight decay makes the
# optimizer's two parameter groups differ (a resume that decays the no-decay group moves the final weights).
SCHEDULE = ("--lr-scheduler", "cosine", "--warmup-steps", "2", "--min-lr-ratio", "0.1", "--weight-decay", "0.1")


@pytest.mark.multirank
def test_killed_rank_resume_and_export_two_ranks(tmp_path, capsys, two_rank_run):
    """A rank killed as step 5 begins (checkpoint at 3), the job resumed: steps 4-6 equal the uninterrupted run's,
    their LR included (the logged LRs follow the schedule's closed form); then the export."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # 1. the uninterrupted run (conftest.py), with a checkpoint after every step and the export at the end
    straight = two_rank_run
    reference = read_metrics(straight / "metrics.jsonl")
    assert [r["learning_rate"] for r in reference] == pytest.approx(
        [closed_form("cosine", s, 1e-3, 2, 6, 0.1) for s in range(1, 7)], rel=1e-12)

    # 2. two "nodes" of one rank each; rank 1 SIGKILLs itself as step 5 begins
    killed = tmp_path / "killed"
    timeout = 60
    node0, node1 = two_node_launch(tmp_path, "ds_packdpo.train",
                                   *flags(tmp_path, "killed", *SCHEDULE, "--save-steps", "3", "--collective-timeout-s",
                                          str(timeout)),
                                   env=cpu_env(DS_PACKDPO_FAULT_KILL="1:5"))
    assert node1.wait(timeout=600) == 256 - 9  # the launcher of the killed rank: Python's sys.exit(-SIGKILL)
    dead = time.monotonic()
    code0 = node0.wait(timeout=timeout + 30)
    survivor_seconds = time.monotonic() - dead
    log0 = (tmp_path / "node0.log").read_text()
    assert code0 == 5 and survivor_seconds < timeout, (code0, survivor_seconds, log0[-3000:])  # PeerFailureError
    # the one line names the dead rank, with the host and pid it left in the rendezvous store (run/process_group.py)
    assert re.search(r"error: rank 0: a collective failed after step 4: rank 1 \(\S+, pid \d+\) did not answer within "
                     rf"{ROLL_CALL_S:g} s: it died or stalled longer than --collective-timeout-s {timeout}; relaunch "
                     "with --resume auto", log0), log0[-3000:]
    assert (killed / "checkpoints" / LATEST).read_text() == "global_step3"
    assert_same_steps(read_metrics(killed / "metrics.jsonl"), reference, range(1, 5))

    # 3. relaunch through the front command: continues from step 3 in the run's own folder
    run([str(BIN / "ds-packdpo"), "train", "--num-procs", "2", "--master-port", str(free_port()),
         *flags(tmp_path, "killed", *SCHEDULE, "--save-steps", "3", "--resume", "auto")])
    resumed = read_metrics(killed / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]  # the lost step 4 is redone, not duplicated
    largest = assert_same_steps(resumed, reference, range(4, 7))
    with capsys.disabled():
        print(f"2 ranks, resumed vs uninterrupted, largest metric difference: {largest}; survivor exited "
              f"{survivor_seconds:.1f} s after the killed node's launcher")

    # 4. export the step-3 checkpoint: its log-probs on step 4's pairs are those the engine logged at step 4
    #    (logps/* of a step are the policy's before that step's update)
    exported = tmp_path / "hf_step3"
    assert cli.main(["export", "--checkpoint", str(straight / "checkpoints" / "global_step3"),
                     "--out", str(exported)]) == 0
    assert sorted(p.name for p in exported.glob("*.safetensors")) == ["model.safetensors"]
    model = AutoModelForCausalLM.from_pretrained(exported)
    tokenizer = AutoTokenizer.from_pretrained(exported)
    assert model.dtype == torch.float32
    chosen, rejected = step_logps(model.eval(), tmp_path, 4, tokenizer)
    with capsys.disabled():
        print("exported step-3 model vs engine at step 4, logps/chosen and logps/rejected:",
              chosen - reference[3]["logps/chosen"], rejected - reference[3]["logps/rejected"])
    # measured: 0.0 and 3e-5 on ~-330 (1e-7 relative; 2 ranks' packed rows vs one row here)
    assert chosen == pytest.approx(reference[3]["logps/chosen"], rel=1e-6)
    assert rejected == pytest.approx(reference[3]["logps/rejected"], rel=1e-6)
    # the folder is never overwritten without --overwrite
    assert cli.main(["export", "--checkpoint", str(straight / "checkpoints"), "--out", str(exported)]) == 2
    assert "folder is not empty" in capsys.readouterr().err

    # 5. --export-on-end wrote the final weights (in shards: --max-shard-size); a bf16 export of the latest
    #    checkpoint (one file) is their exact cast
    assert len(list((straight / "hf_model").glob("model-*-of-*.safetensors"))) > 1
    final = AutoModelForCausalLM.from_pretrained(straight / "hf_model")
    assert cli.main(["export", "--checkpoint", str(straight / "checkpoints"), "--out", str(tmp_path / "bf16"),
                     "--dtype", "bf16"]) == 0
    half = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    assert half.dtype == torch.bfloat16
    final_sd, half_sd = final.state_dict(), half.state_dict()
    assert final_sd.keys() == half_sd.keys()
    assert all(torch.equal(final_sd[k].to(torch.bfloat16), half_sd[k]) for k in final_sd)
    assert not all(torch.equal(final_sd[k], model.state_dict()[k]) for k in final_sd)  # steps 4-6 did train


@pytest.mark.multirank
def test_sharded_export_and_resume_on_another_layout(tmp_path, capsys, two_rank_run):
    """The 2-rank ZeRO-3 checkpoint of step 3: exported in shards of at most 200 KB it loads with from_pretrained
    and equals today's single-file export (zero_to_fp32's whole state dict -> save_pretrained); resumed on 1 rank
    with --allow-new-layout (DeepSpeed's universal format), steps 4-6 continue the 2-rank run, the middle of its cosine
    LR schedule and Adam's bias correction in both parameter groups included (run/universal.py load_universal)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    checkpoint = two_rank_run / "checkpoints" / "global_step3"
    whole_dir, one_file, shards = tmp_path / "whole", tmp_path / "one_file", tmp_path / "shards"
    config = AutoConfig.from_pretrained(checkpoint / "hf")
    with torch.device("meta"):
        whole = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    whole.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(str(checkpoint.parent), tag=checkpoint.name),
                          strict=True, assign=True)
    whole.save_pretrained(whole_dir)
    # the default --max-shard-size (5GB): one file, byte for byte the one save_pretrained writes
    assert cli.main(["export", "--checkpoint", str(checkpoint), "--out", str(one_file)]) == 0
    assert (one_file / "model.safetensors").read_bytes() == (whole_dir / "model.safetensors").read_bytes()
    assert cli.main(["export", "--checkpoint", str(checkpoint), "--out", str(shards), "--max-shard-size", "200KB"]) == 0
    index = json.loads((shards / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 4 and files == sorted(p.name for p in shards.glob("*.safetensors"))
    with safe_open(whole_dir / "model.safetensors", "pt") as single:
        assert set(index["weight_map"]) == set(single.keys())
    loaded, want = AutoModelForCausalLM.from_pretrained(shards).state_dict(), whole.state_dict()
    assert loaded.keys() == want.keys() and all(torch.equal(loaded[k], want[k]) for k in want)
    assert cli.main(["export", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "bad"),
                     "--max-shard-size", "5XB"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        "error: --max-shard-size 5XB: not a size such as 5GB")

    # 1 rank from the 2-rank checkpoint: converted once into global_step3/universal, then the same trajectory
    one_rank = tmp_path / "one_rank"
    run(rank_module("ds_packdpo.train", *flags(tmp_path, "one_rank", *SCHEDULE, "--save-steps", "3", "--resume",
                                               str(checkpoint), "--allow-new-layout")))
    assert (checkpoint / "universal" / "zero").is_dir() and not list(checkpoint.glob(".universal.*"))
    resumed, reference = read_metrics(one_rank / "metrics.jsonl"), read_metrics(two_rank_run / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [4, 5, 6]
    largest = 0.0
    for got in resumed:
        want_step = reference[got["step"] - 1]
        assert (got["pairs"], got["tokens"]) == (want_step["pairs"], want_step["tokens"])
        for key in ("loss", "grad_norm", "rewards/margins", "logps/chosen", "learning_rate"):  # the schedule too
            assert got[key] == pytest.approx(want_step[key], rel=1e-4, abs=1e-6), (got["step"], key)
            largest = max(largest, abs(got[key] - want_step[key]) / abs(want_step[key]))
    # the optimizer state carried over too: the final weights are those of the 2-rank run
    assert cli.main(["export", "--checkpoint", str(one_rank / "checkpoints"), "--out", str(tmp_path / "one_hf")]) == 0
    mine = AutoModelForCausalLM.from_pretrained(tmp_path / "one_hf").state_dict()
    theirs = AutoModelForCausalLM.from_pretrained(two_rank_run / "hf_model").state_dict()
    weight_diff = max(float((mine[k] - theirs[k]).abs().max()) for k in theirs)
    with capsys.disabled():
        print(f"2 ranks -> 1 rank (--allow-new-layout), steps 4-6: largest relative metric difference {largest:.1e}, "
              f"final weights {weight_diff:.1e}")
    assert weight_diff <= 1e-6


@pytest.mark.multirank
def test_front_command_exits_5_when_a_rank_is_killed(tmp_path, monkeypatch, capsys):
    """The deepspeed launcher exits 247 when a rank is SIGKILLed (and stops its peers); ``ds-packdpo train`` 5."""
    tests = Path(__file__).resolve().parent
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    started = time.monotonic()
    assert cli._launch([], 2, free_port(), "killed_rank") == 5  # tests/killed_rank.py: rank 1 kills itself
    assert time.monotonic() - started < 60  # rank 0 (asleep for 120 s) was stopped by the launcher
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: a rank was killed by SIGKILL (the deepspeed launcher exited 247) and the launcher stopped the "
        "others; relaunch with --resume auto to continue from the last complete checkpoint")
    assert [cli.launcher_status(code) for code in (0, 1, 2, 4, 5)] == [0, 1, 2, 4, 5]  # a rank's own code


def fake_checkpoint(tag_dir: Path, world_size: int, ranks_written: int, **state) -> Path:
    """A tag folder with the files of ``ranks_written`` of ``world_size`` ranks (small tensors) and its manifest."""
    from ds_packdpo.run.manifest import write_manifest

    (tag_dir / "hf").mkdir(parents=True)
    (tag_dir / "hf" / "config.json").write_text("{}")
    full_state = {"version": 2, "layout": {"world_size": world_size, "dp_size": world_size, "sp_size": 1},
                  "zero_stage": 3, **state}
    (tag_dir / STATE_FILE).write_text(json.dumps(full_state))
    for rank in range(ranks_written):
        for name in (f"rng_rank{rank}.pt", f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt",
                     f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"):
            torch.save({"rank": rank, "tensor": torch.arange(4)}, tag_dir / name)
    write_manifest(tag_dir)
    return tag_dir


def test_latest_only_moves_to_a_complete_checkpoint(tmp_path):
    """A save interrupted before every rank's files are there leaves ``latest`` on the previous checkpoint."""
    from ds_packdpo.run.checkpoint import missing_files, resolve_checkpoint, write_latest
    from ds_packdpo.errors import InputError

    save_dir = tmp_path / "ckpt"
    complete = fake_checkpoint(save_dir / "global_step3", 2, 2)
    partial = fake_checkpoint(save_dir / "global_step6", 2, 1)  # rank 1's files never came
    assert missing_files(complete, 2, 3) == []
    assert missing_files(partial, 2, 3) == ["rng_rank1.pt", "the ZeRO optimizer shard of rank 1"]
    write_latest(save_dir, "global_step3")
    assert resolve_checkpoint(save_dir, "--resume")[0] == complete
    with pytest.raises(InputError, match=r"global_step6: incomplete checkpoint \(missing rng_rank1.pt"):
        resolve_checkpoint(partial, "--resume")
    assert sorted(p.name for p in save_dir.iterdir()) == ["global_step3", "global_step6", LATEST]  # no temp left


def test_rng_state_round_trips_with_weights_only(tmp_path):
    import random

    import numpy as np

    from ds_packdpo.run.checkpoint import rng_state, set_rng_state

    torch.save(rng_state(), tmp_path / "rng.pt")
    expected = (torch.rand(3), np.random.rand(3), random.random())
    torch.rand(5), np.random.rand(5), random.random()  # move every generator on
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    restored = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(restored[0], expected[0]) and np.array_equal(restored[1], expected[1])
    assert restored[2] == expected[2]


def test_prune_keeps_the_newest_intact(tmp_path):
    """--save-total-limit counts whole checkpoints (with a manifest) only: partial saves of a crashed run never push
    an intact one out; those older than 'latest' go, a newer one (the next save replaces it) stays."""
    from ds_packdpo.run.checkpoint import prune

    for step in (3, 6, 9, 12, 15):
        (tmp_path / f"global_step{step}").mkdir()
    for step in (3, 6, 12):
        (tmp_path / f"global_step{step}" / MANIFEST_FILE).write_text("{}")
    assert prune(tmp_path, 2, "global_step12") == ["global_step3", "global_step9"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step12", "global_step15", "global_step6"]
    assert prune(tmp_path, 1, "global_step12") == ["global_step6"]


def test_trim_metrics_drops_undone_and_torn_records(tmp_path):
    from ds_packdpo.run.metrics import trim_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 0.5}) + "\n" for s in range(1, 6)) + '{"step": 6, "lo')
    assert trim_metrics(path, 3) == 3
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]
    assert trim_metrics(tmp_path / "absent.jsonl", 3) == 0


SP2 = ["--sequence-parallel-size", "2", "--max-tokens-per-row", "100"]  # most pairs need more than one rank's 100


@pytest.mark.multirank
def test_resume_under_sequence_parallelism_continues_exactly(tmp_path, capsys, monkeypatch):
    """Both ranks share every row (1 data-parallel x 2 sequence-parallel): a rank killed after the step-2
    checkpoint, the job resumed at the same layout, continues the uninterrupted run exactly; another layout is
    refused before any process group, naming both."""
    straight = tmp_path / "straight"
    run(ranks_module(2, "ds_packdpo.train", *flags(tmp_path, "straight", *SP2, "--max-steps", "4")))
    reference = read_metrics(straight / "metrics.jsonl")
    killed = tmp_path / "killed"
    proc = run(ranks_module(2, "ds_packdpo.train", *flags(tmp_path, "killed", *SP2, "--max-steps", "4",
                                                               "--save-steps", "2")),
               check=False, env=cpu_env(DS_PACKDPO_FAULT_KILL="1:3"))
    assert proc.returncode != 0
    assert (killed / "checkpoints" / LATEST).read_text() == "global_step2"
    state = json.loads((killed / "checkpoints" / "global_step2" / STATE_FILE).read_text())
    assert state["layout"] == {"world_size": 2, "dp_size": 1, "sp_size": 2}
    run(ranks_module(2, "ds_packdpo.train", *flags(tmp_path, "killed", *SP2, "--max-steps", "4",
                                                       "--save-steps", "2", "--resume", "auto")))
    resumed = read_metrics(killed / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4] and all(r["pairs"] == 8 for r in resumed)
    largest = assert_same_steps(resumed, reference, range(1, 5))
    with capsys.disabled():
        print(f"2 ranks at S=2, resumed vs uninterrupted, largest metric difference: {largest}")
    # the same world with one rank per row is another layout: refused in phase one (no launch needed: rank 0 of 2
    # in this process)
    from ds_packdpo.train import main as train_main

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    capsys.readouterr()
    assert train_main(flags(tmp_path, "killed", "--max-steps", "4", "--resume", "auto")) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == (f"error: --resume {killed / 'checkpoints' / 'global_step4'}: written by 2 ranks (1 data-parallel x "
                    "2 sequence-parallel), this run is 2 ranks (2 data-parallel x 1 sequence-parallel); DeepSpeed ZeRO "
                    "shards load only into the same layout (pass --allow-new-layout to load it at this one through "
                    "DeepSpeed's universal format)"), last


class _FakeEngine:
    """What Checkpointer.save asks of a DeepSpeed engine: the module's config, and shard files written on save."""

    def __init__(self):
        from ds_packdpo.model.build import tiny_config

        self.module = type("Module", (), {"config": tiny_config()})()

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        for name in ("zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
            (Path(save_dir) / tag / name).write_bytes(b"shard")


def test_save_syncs_every_file_before_latest_moves(tmp_path, monkeypatch):
    """Every file of a checkpoint (ours and DeepSpeed's), its folders and its entry are fsynced before 'latest' is
    replaced, and 'latest' itself (with its folder) after; the manifest, listing every other file of the tag with its
    size and checksum, is the last file written (synced, renamed into place) before 'latest' moves."""
    from types import SimpleNamespace

    from ds_packdpo.config import parse_train_args
    from ds_packdpo.run import checkpoint as ckpt
    from ds_packdpo.run.assemble import checkpoint_spec, model_spec
    from ds_packdpo.run.layout import ParallelLayout

    synced, when_latest_moved, replaced = [], [], []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        replaced.append(Path(dst).name)
        if Path(dst).name == LATEST:
            when_latest_moved.append(list(synced))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(ckpt.dist, "barrier", lambda: None)
    cfg = parse_train_args(["--output-dir", str(tmp_path / "run"), "--save-steps", "1"])
    tokenizer = SimpleNamespace(save_pretrained=lambda folder: (Path(folder) / "tokenizer.json").write_text("{}"))
    layout = ParallelLayout(world_size=1)
    spec = SimpleNamespace(layout=layout, checkpoint=checkpoint_spec(cfg), model=model_spec(cfg, "fp32", "cpu"),
                           plan=cfg.plan_spec(layout, cfg.row_layout))
    setup = SimpleNamespace(spec=spec, prepared=SimpleNamespace(fingerprint="data"), plan_fingerprint="plan",
                            tokenizer=tokenizer)
    tag_dir = ckpt.Checkpointer(SimpleNamespace(setup=setup)).save(_FakeEngine(), 1, 0, 1, 0)
    everything = {tag_dir, *tag_dir.rglob("*")}
    assert {p.name for p in everything} >= {STATE_FILE, "rng_rank0.pt", "hf", "config.json", "tokenizer.json",
                                             "zero_pp_rank_0_mp_rank_00_optim_states.pt"}
    [before] = when_latest_moved
    manifest = tag_dir / MANIFEST_FILE
    assert (everything - {manifest}) | {tag_dir.parent} <= set(before), everything - set(before)
    assert replaced == [MANIFEST_FILE, LATEST]  # the manifest's temporary file was synced, then renamed
    assert any(p.name.startswith(f".{MANIFEST_FILE}.") for p in before)
    listed = json.loads(manifest.read_text())["files"]
    assert set(listed) == {str(p.relative_to(tag_dir)) for p in everything if p.is_file() and p != manifest}
    assert listed["zero_pp_rank_0_mp_rank_00_optim_states.pt"]["size"] == len(b"shard")
    assert synced[-1] == tag_dir.parent and (tag_dir.parent / LATEST).read_text() == tag_dir.name


def test_rng_of_ranks_new_to_the_checkpoint(tmp_path):
    """A rank the checkpoint had continues its saved stream; a new rank's stream depends on (seed, step, rank) only."""
    from ds_packdpo.run.checkpoint import ResumePoint, restore_rng, rng_state

    torch.save(rng_state(), tmp_path / "rng_rank0.pt")
    saved = torch.rand(4)
    point = ResumePoint(tmp_path, epoch=0, epoch_step=3, global_step=3, bad_steps=0, saved_world_size=1,
                        universal=True)

    def draws(rank: int, seed: int = 0, at: ResumePoint = point) -> torch.Tensor:
        torch.rand(7)  # whatever came before
        restore_rng(at, rank, seed)
        return torch.rand(4)

    assert torch.equal(draws(0), saved)
    assert torch.equal(draws(1), draws(1)) and torch.equal(draws(2), draws(2))
    later = ResumePoint(tmp_path, 0, 4, 4, 0, 1, True)
    others = [draws(2), draws(1, seed=1), draws(1, at=later), saved]
    assert all(not torch.equal(draws(1), other) for other in others)


def test_resume_at_another_layout_needs_the_flag_and_zero3(tmp_path):
    """Phase one: a checkpoint of 2 ranks resumed by 1 is refused naming --allow-new-layout; with it, a ZeRO-3
    checkpoint is loaded through the universal format, another stage is refused; the flag needs --resume."""
    from ds_packdpo.config import parse_train_args
    from ds_packdpo.errors import InputError
    from ds_packdpo.run.assemble import checkpoint_spec
    from ds_packdpo.run.layout import ParallelLayout

    def resume(stage: int, *extra: str):
        run_flags = ["--output-dir", str(tmp_path / "out"), "--dtype", "fp32"]  # as phase one resolves auto on CPU
        tag_dir = tmp_path / f"stage{stage}" / "global_step4"
        if not tag_dir.exists():
            fake_checkpoint(tag_dir, 2, 2, zero_stage=stage, dtype="fp32", bad_steps=0,
                            plan_fingerprint=specs.fingerprint(parse_train_args(run_flags), "data"),
                            position={"epoch": 0, "epoch_step": 4, "global_step": 4})
        cfg = parse_train_args([*run_flags, "--resume", str(tag_dir), *extra])
        return specs.resume(cfg, "data", ParallelLayout(world_size=1, zero_stage=stage))

    with pytest.raises(InputError, match=r"this run is 1 rank .*\(pass --allow-new-layout to load it at this one"):
        resume(3)
    point = resume(3, "--allow-new-layout")
    assert (point.universal, point.saved_world_size, point.global_step) == (True, 2, 4)
    with pytest.raises(InputError, match=r"ZeRO stage 2; loading at another layout is supported for ZeRO-3"):
        resume(2, "--allow-new-layout")
    with pytest.raises(InputError, match="--allow-new-layout needs --resume"):
        checkpoint_spec(parse_train_args(["--allow-new-layout"]))


def test_the_end_of_a_run_meets_its_peers_before_the_group_goes(monkeypatch):
    """close_process_group: a barrier (no collective pending at interpreter exit), then the teardown; a peer that
    died after the last step is one line and exit 5, any other error is not ours to rename."""
    from ds_packdpo.errors import PeerFailureError
    from ds_packdpo.run import process_group

    calls = []
    monkeypatch.setattr(process_group.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(process_group.dist, "get_rank", lambda: 1)
    monkeypatch.setattr(process_group.dist, "barrier", lambda: calls.append("barrier"))
    monkeypatch.setattr(process_group.dist, "destroy_process_group", lambda: calls.append("destroy"))
    process_group.close_process_group()
    assert calls == ["barrier", "destroy"]

    def peer_gone():
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer\nmore")

    monkeypatch.setattr(process_group.dist, "barrier", peer_gone)
    with pytest.raises(PeerFailureError, match=r"^rank 1: another rank died or stalled after the last step "
                                               r"\(\[.*gloo.*Connection closed by peer\)$") as raised:
        process_group.close_process_group()
    assert raised.value.exit_code == 5 and calls == ["barrier", "destroy"]  # no teardown after a failure

    def bug():
        raise RuntimeError("something else")

    monkeypatch.setattr(process_group.dist, "barrier", bug)
    with pytest.raises(RuntimeError, match="^something else$"):
        process_group.close_process_group()


def test_the_roll_call_names_who_did_not_answer(monkeypatch):
    """lost_peers in rank 0 of 3 with a rendezvous store here: rank 2 answers, rank 1 does not and is named with what
    it left at start-up; once every rank answered, no name; in rank 1 with the store's port closed (rank 0's process
    gone), rank 0 is named."""
    from datetime import timedelta

    import torch.distributed as dist

    from ds_packdpo.run import process_group
    from ds_packdpo.run.layout import free_port

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setattr(process_group.dist, "get_world_size", lambda: 3)
    monkeypatch.setattr(process_group.dist, "get_rank", lambda: 0)
    server.set(f"{process_group.ROLL_CALL}/who/1", "node2, pid 4242")
    server.set(f"{process_group.ROLL_CALL}/here/2", "")
    assert process_group.lost_peers() == "rank 1 (node2, pid 4242) did not answer within 2 s: it died or stalled"
    server.set(f"{process_group.ROLL_CALL}/here/1", "")
    assert process_group.lost_peers() == "another rank died or stalled"
    del server
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setattr(process_group.dist, "get_rank", lambda: 1)
    assert process_group.lost_peers() == "rank 0 (on 127.0.0.1, whose rendezvous store is unreachable) died or stalled"


def test_a_rank_process_ends_with_its_code_after_the_exit_handlers(tmp_path):
    """exit_rank skips the interpreter's finalization (where gloo's teardown aborted finished ranks), not the exit
    handlers (logging, monitors) nor what the streams still hold."""
    script = ("import atexit, sys\n"
              "from ds_packdpo.run.process_group import exit_rank\n"
              "atexit.register(lambda: print('exit handler ran'))\n"
              "print('buffered', end='')\n"
              "sys.stderr.write('to stderr')\n"
              "exit_rank(3)\n")
    proc = run([sys.executable, "-c", script], check=False)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert proc.stdout == "bufferedexit handler ran\n" and proc.stderr.endswith("to stderr")
