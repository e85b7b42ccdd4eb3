"""Chaos: a 2-rank job killed at seeded random moments, resumed each time, ends where the uninterrupted run ends.

Four SIGKILLs (tests/fault_hooks.py), each of a random rank at a random step: inside a forward, inside a backward, in the
middle of a checkpoint save (every rank's files written, no manifest yet), and in the middle of the universal
conversion of a resume at another world size (--allow-new-layout, 1 rank).  After each the job is relaunched with
``--resume auto``.  The kill schedule is printed; ``DS_PACKDPO_CHAOS_SEED`` replays another one.
"""

from __future__ import annotations

import os
import random
import time

import pytest
import torch
from launching import cpu_env, rank_module, ranks_module, read_metrics, run
from test_checkpoint import RUN_SETTINGS, SCHEDULE, TIMING, flags

from ds_packdpo.run.checkpoint import LATEST
from ds_packdpo.run.manifest import MANIFEST_FILE

SEED = int(os.environ.get("DS_PACKDPO_CHAOS_SEED", "28"))
STEPS = 6
# how a step is laid out, not what it computes: differs between 2 ranks and 1
LAYOUT_KEYS = ("rows_per_rank", "max_rank_tokens", "mean_rank_tokens")
ACROSS_LAYOUTS = 1e-4  # relative: the trajectory bound of design invariant 2 (fp32), as test_checkpoint's resume


def kill_schedule(seed: int) -> list[tuple[str, int, int]]:
    """(point, rank, step) of the four kills: each lands after the previous one's resume has made progress."""
    rng = random.Random(seed)
    forward = rng.randint(2, 3)  # after the step-1 checkpoint at least: --resume auto needs one
    backward = rng.randint(forward + 1, 4)
    save = rng.randint(backward + 1, 5)
    return [("forward", rng.randrange(2), forward), ("backward", rng.randrange(2), backward),
            ("save", rng.randrange(2), save), ("universal", 0, save - 1)]  # converts the newest intact checkpoint


def fp32_weights(tag_dir) -> dict[str, torch.Tensor]:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name)


def without(record: dict, keys: tuple[str, ...]) -> dict:
    return {k: v for k, v in record.items() if k not in keys}


@pytest.mark.multirank
def test_chaos_kills_and_resumes_end_where_the_uninterrupted_run_ends(tmp_path, capsys, two_rank_run):
    started = time.monotonic()
    schedule = kill_schedule(SEED)
    with capsys.disabled():
        print(f"\nchaos seed {SEED}: " + "; ".join(f"kill rank {rank} in the {point} of step {step}"
                                                  if point != "universal" else
                                                  f"kill rank 0 converting global_step{step} for 1 rank"
                                                  for point, rank, step in schedule))
    # the uninterrupted run (conftest.py): these flags, a checkpoint after every step (and an export at the end)
    argv = [*SCHEDULE, "--save-steps", "1", "--max-steps", str(STEPS)]
    reference = read_metrics(two_rank_run / "metrics.jsonl")
    assert [r["step"] for r in reference] == list(range(1, STEPS + 1))
    chaos = flags(tmp_path, "chaos", *argv, "--save-total-limit", "2")
    save_dir = tmp_path / "chaos" / "checkpoints"

    for i, (point, rank, step) in enumerate(schedule[:3]):
        proc = run(ranks_module(2, "ds_packdpo.train", *chaos, *(["--resume", "auto"] if i else [])), check=False,
                   env=cpu_env(DS_PACKDPO_FAULT_KILL=f"{rank}:{step}:{point}"))
        # the launcher exits with the first failed rank's code: the killed one's (sys.exit(-9)) or its peer's
        assert proc.returncode in (256 - 9, 5), (point, proc.returncode, proc.stderr[-3000:])
        if i:  # resumed from the checkpoint before the previous kill's step
            resumed = save_dir / f"global_step{schedule[i - 1][2] - 1}"
            assert f"resuming from {resumed} at step {schedule[i - 1][2] - 1}\n" in proc.stderr, proc.stderr[-3000:]
        logged = [r["step"] for r in read_metrics(tmp_path / "chaos" / "metrics.jsonl")]
        assert logged == list(range(1, step + (point == "save"))), (point, logged)  # a save follows its step's record
        assert (save_dir / LATEST).read_text() == f"global_step{step - 1}"
        if point == "save":  # the rank's files are there, the manifest is not: resume passes it over, saying why
            assert list((save_dir / f"global_step{step}").glob(f"*zero_pp_rank_{rank}_*optim_states.pt"))
            assert not (save_dir / f"global_step{step}" / MANIFEST_FILE).exists()

    # the 2-rank part is the uninterrupted run bitwise: every metric and the weights of its last checkpoint
    two_ranks = schedule[2][2] - 1
    logged = read_metrics(tmp_path / "chaos" / "metrics.jsonl")
    measured = (*TIMING, *RUN_SETTINGS)  # a resumed run's first record also reports the engine's settings
    assert [without(r, measured) for r in logged[:two_ranks]] == [without(r, measured) for r in reference[:two_ranks]]
    mine, theirs = (fp32_weights(root / "checkpoints" / f"global_step{two_ranks}") for root in
                    (tmp_path / "chaos", two_rank_run))
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in theirs)

    # 1 rank from the 2-rank checkpoint: killed while converting it, then resumed (the conversion redone)
    _, _, converted = schedule[3]
    proc = run(rank_module("ds_packdpo.train", *chaos, "--resume", "auto", "--allow-new-layout"), check=False,
               env=cpu_env(DS_PACKDPO_FAULT_KILL=f"0:{converted}:universal"))
    assert proc.returncode == -9, proc.stderr[-3000:]
    tag = save_dir / f"global_step{converted}"
    assert not (tag / "universal").exists() and list(tag.glob(".universal.*.tmp"))  # staged, never renamed in
    proc = run(rank_module("ds_packdpo.train", *chaos, "--resume", "auto", "--allow-new-layout"))
    assert f"resuming from {tag} at step {converted} (passed over global_step{converted + 1}: no {MANIFEST_FILE} " \
           "(its save did not finish))" in proc.stderr, proc.stderr[-3000:]

    logged = read_metrics(tmp_path / "chaos" / "metrics.jsonl")
    assert [r["step"] for r in logged] == list(range(1, STEPS + 1))  # every step logged once
    largest = 0.0
    for got, want in zip(logged[converted:], reference[converted:]):
        assert set(got) - RUN_SETTINGS == set(want) - RUN_SETTINGS
        for key, value in without(want, (*TIMING, *RUN_SETTINGS, *LAYOUT_KEYS)).items():
            if isinstance(value, float):
                assert got[key] == pytest.approx(value, rel=ACROSS_LAYOUTS, abs=1e-6), (got["step"], key)
                largest = max(largest, abs(got[key] - value) / max(abs(value), 1e-12))
            else:
                assert got[key] == value, (got["step"], key)
    mine, theirs = (fp32_weights(root / "checkpoints" / f"global_step{STEPS}") for root in
                    (tmp_path / "chaos", two_rank_run))
    weight_diff = max(float((mine[k] - theirs[k]).detach().abs().max()) for k in theirs)
    assert weight_diff <= 1e-6
    # --save-total-limit 2 kept the two newest whole checkpoints; the partial save and the converted one (its
    # universal/ and the staging of the dead conversion with it) went with the older ones
    assert sorted(p.name for p in save_dir.glob("global_step*")) == [f"global_step{STEPS - 1}", f"global_step{STEPS}"]
    seconds = time.monotonic() - started
    with capsys.disabled():
        print(f"chaos: 4 kills survived; steps 1-{two_ranks} (2 ranks) bitwise, steps {converted + 1}-{STEPS} (1 rank) "
              f"largest relative metric difference {largest:.1e}, final weights {weight_diff:.1e}; {seconds:.0f} s")
