"""Resuming at another layout: DeepSpeed's universal checkpoint, made once and kept in the checkpoint's folder.

A ZeRO checkpoint holds, per rank, that rank's slice of the flattened fp32 weights and
optimizer moments, cut for the world it was written by; it loads only into the same
data-parallel layout.  DeepSpeed's ``ds_to_universal`` rewrites it per parameter
(``zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt`` plus the model-states files, which carry the
step counters, the LR schedule and our client state), and an engine whose config says
``"checkpoint": {"load_universal": true}`` cuts those into its own partitions at any world
size (deepspeed 0.19.8: ZeRO-3 supported, CPU/gloo included).  The conversion reads every
rank's shard, so it runs in one process before any process group: the front
``ds-packdpo train`` command before it launches, or global rank 0 of a launched job (the
other ranks wait in the process group's start, up to --collective-timeout-s).  Its result
``global_stepN/universal`` is written beside, synced and renamed into place, so a
conversion that dies leaves nothing a later resume would take for complete.

RNG streams: a rank that also existed in the checkpoint's layout continues its saved
stream; a rank the checkpoint did not have is seeded from (--seed, global step, rank).
"""

from __future__ import annotations

import shutil
from argparse import Namespace
from pathlib import Path

import numpy as np
import torch
from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal
from transformers import set_seed

from ..errors import InputError
from ..files import atomic_folder
from . import hooks
from .safe_load import weights_only_loading

UNIVERSAL_FOLDER = "universal"


def universal_dir(tag_dir: Path) -> Path:
    return Path(tag_dir) / UNIVERSAL_FOLDER


def check_convertible(tag_dir: Path, zero_stage: int) -> None:
    """Phase one: refuses what this conversion does not cover, before any work."""
    if zero_stage != 3:
        # ZeRO 1-2 conversion needs model metadata ("universal_checkpoint_info") that Hugging Face models lack
        raise InputError(f"--allow-new-layout: {tag_dir} was written with ZeRO stage {zero_stage}; loading at another "
                         "layout is supported for ZeRO-3 checkpoints")


def ensure_universal(tag_dir: Path, global_step: int) -> Path:
    """The universal form of the checkpoint ``tag_dir`` (of step ``global_step``): converted now (every file read with
    ``weights_only=True``), unless an earlier resume did it."""
    target = universal_dir(tag_dir)
    if target.is_dir():
        return target
    for stale in tag_dir.glob(f".{UNIVERSAL_FOLDER}.*.tmp"):
        shutil.rmtree(stale)  # a conversion that died (one process converts: rank 0, or the front command)

    def convert(staging: Path) -> None:
        # One worker each: DeepSpeed's worker pools fork this process, whose OpenMP threads may already run.
        with weights_only_loading():
            ds_to_universal(Namespace(input_folder=str(tag_dir), output_folder=str(staging), num_extract_workers=1,
                                      num_merge_workers=1, keep_temp_folder=False, strict=True,
                                      inject_missing_state=False))
        # it also points a 'latest_universal' file beside its output at it; we load by path
        (tag_dir / "latest_universal").unlink(missing_ok=True)
        hooks.installed().converted(global_step)

    atomic_folder(target, convert)
    return target


def with_universal_loading(ds_config: dict) -> dict:
    """The DeepSpeed config that makes ``engine.load_checkpoint`` read a universal checkpoint."""
    return {**ds_config, "checkpoint": {**ds_config.get("checkpoint", {}), "load_universal": True}}


def load_universal(engine, load_dir: Path) -> tuple:
    """``engine.load_checkpoint`` of a universal checkpoint, with the two things deepspeed 0.19.8's ZeRO-3 loader
    gets wrong when the optimizer has more than one parameter group (ours has two: with and without weight decay)
    put right.

    ``load_hp_checkpoint_state_from_checkpoint_dir_stage3`` hands every group's state one and the same ``step``
    tensor, which Adam increments in place once per group, so the bias correction of the resumed steps ran ahead
    (measured: the loss of the second resumed step 8e-4 apart from the uninterrupted run); and it copies group 0's
    hyperparameters into every group, weight decay included, so the no-decay group would decay.  Each group gets
    its own ``step`` and keeps the weight decay it was built with.
    """
    inner = engine.optimizer.optimizer  # the torch optimizer under DeepSpeed's ZeRO-3 wrapper
    decays = [group["weight_decay"] for group in inner.param_groups]
    loaded = engine.load_checkpoint(str(load_dir), tag=UNIVERSAL_FOLDER, load_optimizer_states=True,
                                    load_lr_scheduler_states=True)
    for group, decay in zip(inner.param_groups, decays):
        group["weight_decay"] = decay
    for state in inner.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()
    return loaded


def new_rank_seed(seed: int, global_step: int, rank: int) -> int:
    """The RNG seed of a rank the checkpoint's layout did not have: (--seed, global step, rank) alone decide it."""
    return int(np.random.SeedSequence([seed, global_step, rank]).generate_state(1)[0])


def seed_new_rank(seed: int, global_step: int, rank: int) -> None:
    """Seeds Python's, NumPy's and torch's generators (every device's) of a rank new to the checkpoint."""
    set_seed(new_rank_seed(seed, global_step, rank))
