"""Checkpoints that prove they are whole, loading that runs no code, and a save on a full disk.

The first two need no launch (checkpoint folders made here); the full disk is one rank without a launcher.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
from launching import cpu_env, rank_module, read_metrics, run
import specs
from test_bad_input import assert_one_line_error
from test_checkpoint import RUN_SETTINGS, TIMING, fake_checkpoint, flags

from ds_packdpo import cli
from ds_packdpo.config import parse_train_args
from ds_packdpo.errors import InputError
from ds_packdpo.run.checkpoint import LATEST, resolve_checkpoint, write_latest
from ds_packdpo.run.layout import ParallelLayout
from ds_packdpo.run.manifest import MANIFEST_FILE, total_bytes, write_manifest


def _resumable(tag_dir: Path, run_flags: list[str], step: int) -> Path:
    return fake_checkpoint(tag_dir, 1, 1, dtype="fp32", bad_steps=0, lora=None, output_dir=str(tag_dir),
                           plan_fingerprint=specs.fingerprint(parse_train_args(run_flags), "data"),
                           position={"epoch": 0, "epoch_step": step, "global_step": step})


def test_resume_auto_falls_back_to_the_newest_intact_checkpoint(tmp_path, capsys):
    """Four checkpoints, the three newest damaged three ways (a save that died before its manifest, a truncated
    file, a file altered in place at its size): --resume auto takes the oldest, naming each reason; an explicit
    --resume of a damaged one and export refuse it in one line; verify-checkpoint says the same, exit 1; with none
    intact --resume auto refuses, verify-checkpoint exits 2."""
    save_dir = tmp_path / "out" / "checkpoints"
    run_flags = ["--output-dir", str(tmp_path / "out"), "--dtype", "fp32", "--save-steps", "3"]
    tags = {step: _resumable(save_dir / f"global_step{step}", run_flags, step) for step in (3, 6, 9, 12)}
    write_latest(save_dir, "global_step9")
    (tags[12] / MANIFEST_FILE).unlink()  # killed mid-save: every file, no manifest
    shard = tags[9] / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    shard.write_bytes(shard.read_bytes()[:-100])  # a half-copied node
    rng = tags[6] / "rng_rank0.pt"
    damaged = bytearray(rng.read_bytes())
    damaged[-30] ^= 0xFF  # one byte flipped, same size
    rng.write_bytes(bytes(damaged))

    cfg = parse_train_args([*run_flags, "--resume", "auto"])
    point = specs.resume(cfg, "data", ParallelLayout(world_size=1))
    assert point.tag_dir == tags[3] and point.global_step == 3
    assert point.skipped == (f"global_step12: no {MANIFEST_FILE} (its save did not finish)",
                             "global_step9: zero_pp_rank_0_mp_rank_00_model_states.pt is truncated or grew "
                             f"({shard.stat().st_size} bytes, the manifest says {shard.stat().st_size + 100})",
                             "global_step6: rng_rank0.pt was altered (its checksum differs from the manifest's)")
    with pytest.raises(InputError, match=r"^--resume .*global_step9: zero_pp_rank_0_mp_rank_00_model_states.pt is "
                                         r"truncated or grew"):
        specs.resume(parse_train_args([*run_flags, "--resume", str(tags[9])]), "data", ParallelLayout(world_size=1))
    code = cli.main(["export", "--checkpoint", str(save_dir), "--out", str(tmp_path / "hf")])  # 'latest': step 9
    assert_one_line_error(code, capsys.readouterr().err, f"--checkpoint {tags[9]}: zero_pp_rank_0_mp_rank_00_model_"
                          "states.pt is truncated or grew")
    assert not (tmp_path / "hf").exists()

    assert cli.main(["verify-checkpoint", str(save_dir)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(": ")[:2] for line in lines[:3]] == [[str(tags[s]), "DAMAGED"] for s in (12, 9, 6)]
    assert lines[3].startswith(f"{tags[3]}: intact (5 files, ") and lines[4] == f"--resume auto would load {tags[3]}"
    assert cli.main(["verify-checkpoint", str(tags[3])]) == 0
    assert capsys.readouterr().out.startswith(f"{tags[3]}: intact (5 files, {total_bytes(tags[3]):,} bytes verified")

    (tags[3] / "hf" / "config.json").unlink()
    with pytest.raises(InputError, match=r"holds no intact checkpoint to resume \(global_step12: .*global_step3: "
                                         r"hf/config.json is missing\); pass --overwrite to start afresh$"):
        specs.resume(cfg, "data", ParallelLayout(world_size=1))
    assert cli.main(["verify-checkpoint", str(save_dir)]) == 2
    assert_one_line_error(2, capsys.readouterr().err, f"verify-checkpoint {save_dir}: no intact checkpoint (")


class _WritesAFile:
    """A pickle that, unpickled without weights_only, creates a file (what a hostile checkpoint would do worse)."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return exec, (f"open({str(self.path)!r}, 'w').write('ran')",)


def test_a_checkpoint_holding_code_is_refused_and_never_run(tmp_path, capsys):
    """A ZeRO shard whose pickle would create a file, its manifest made to match (a hostile checkpoint is whole):
    resume, export and verify-checkpoint refuse it in one line naming the file and the call; DeepSpeed's own
    torch.load(weights_only=False) inside weights_only_loading refuses it too; the file is never created."""
    from ds_packdpo.run.safe_load import weights_only_loading

    marker = tmp_path / "pwned"
    run_flags = ["--output-dir", str(tmp_path / "out"), "--dtype", "fp32"]
    tag = _resumable(tmp_path / "ckpt" / "global_step3", run_flags, 3)
    shard = tag / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    torch.save({"module": _WritesAFile(marker)}, shard)
    write_manifest(tag)
    want = "zero_pp_rank_0_mp_rank_00_model_states.pt: its pickle calls builtins.exec (loading it would run code); " \
           "refused"
    with pytest.raises(InputError, match=f"^--resume {tag}: {want}$".replace("(", r"\(").replace(")", r"\)")):
        specs.resume(parse_train_args([*run_flags, "--resume", str(tag)]), "data", ParallelLayout(world_size=1))
    assert cli.main(["export", "--checkpoint", str(tag), "--out", str(tmp_path / "hf")]) == 2
    assert_one_line_error(2, capsys.readouterr().err, f"--checkpoint {tag}: {want}")
    assert cli.main(["verify-checkpoint", str(tag)]) == 2
    assert_one_line_error(2, capsys.readouterr().err, f"verify-checkpoint {tag}: no intact checkpoint ({tag}: "
                          f"DAMAGED: {want})")
    with weights_only_loading(), pytest.raises(pickle.UnpicklingError, match="Unsupported global: GLOBAL exec"):
        torch.load(shard, weights_only=False)  # as DeepSpeed's loaders call it
    assert not marker.exists()
    torch.load(shard, weights_only=False)  # the control: outside, the same call runs the code
    assert marker.read_text() == "ran"


@pytest.mark.multirank
def test_a_full_disk_ends_the_save_in_one_line_and_keeps_the_last_checkpoint(tmp_path):
    """The step-4 save runs out of space in DeepSpeed's writer (injected): the job ends with exit 6 and one line naming
    the folder and the bytes needed (the step-2 checkpoint's size); 'latest' still names step 2, which verifies and
    resumes: the resumed run logs steps 3-4 again, bitwise those of the first attempt."""
    argv = flags(tmp_path, "full", "--save-steps", "2", "--max-steps", "4", "--lr-scheduler", "constant")
    proc = run(rank_module("ds_packdpo.train", *argv), check=False, env=cpu_env(DS_PACKDPO_FAULT_DISK_FULL="0:4"))
    save_dir = tmp_path / "full" / "checkpoints"
    assert proc.returncode == 6 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    needed = total_bytes(save_dir / "global_step2")
    assert last.startswith(f"error: rank 0: no space left on the device of {save_dir} for checkpoint global_step4: it "
                           f"needs about {needed:,} bytes, "), last
    assert last.endswith(f"(No space left on device); '{LATEST}' still names global_step2, intact; free space and "
                         "relaunch with --resume auto"), last
    assert (save_dir / LATEST).read_text() == "global_step2" and not (save_dir / "global_step4").exists()
    assert resolve_checkpoint(save_dir, "--resume")[0] == save_dir / "global_step2"
    timing = (*TIMING, *RUN_SETTINGS)  # measured, and the engine's settings a resumed run's first record reports
    first = [{k: v for k, v in r.items() if k not in timing} for r in read_metrics(tmp_path / "full" / "metrics.jsonl")]
    assert [r["step"] for r in first] == [1, 2, 3, 4]

    resumed = run(rank_module("ds_packdpo.train", *argv, "--resume", "auto"))
    assert f"resuming from {save_dir / 'global_step2'} at step 2" in resumed.stderr
    assert (save_dir / LATEST).read_text() == "global_step4" and (save_dir / "global_step4" / MANIFEST_FILE).is_file()
    again = [{k: v for k, v in r.items() if k not in timing} for r in read_metrics(tmp_path / "full" / "metrics.jsonl")]
    assert again == first  # steps 3-4 redone from the step-2 checkpoint: bitwise the first attempt's
