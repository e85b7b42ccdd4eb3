"""Checkpoints: DeepSpeed shards plus the trainer's own state, committed atomically, and exact resume.

Layout of ``--save-dir`` (default ``OUTPUT_DIR/checkpoints``)::

    global_step{N}/                 one checkpoint ("tag")
        *_model_states.pt, *_optim_states.pt   DeepSpeed's files; under ZeRO-3 every rank writes its shard
        ds_packdpo_state.json       plan position, fingerprint, bad-step counter, parallel layout (rank 0)
        rng_rank{r}.pt              RNG states of rank r: plain tensors/ints, loads with weights_only=True
        reference_rank{r}.safetensors  --sync-ref-model (TR-DPO) only: the mixed reference, rank r's ZeRO-3
                                    partitions (under ZeRO 0-2 rank 0's whole copy); run/reference_sync.py
        hf/                         model config + tokenizer (save_pretrained), and a LoRA run's adapter_config.json
                                    (its base model's folder in base_model_name_or_path): export needs nothing else
        manifest.json               every file above with its size and checksum, written last (run/manifest.py)
        universal/                  made by the first resume at another layout (--allow-new-layout)
    latest                          tag of the newest *complete* checkpoint

DeepSpeed writes the tag with ``save_latest=False``; after its closing barrier every rank
fsyncs the files it wrote (its RNG file, its ZeRO shards), and rank 0 checks that every
rank's files are there, fsyncs the whole folder (our state, hf/, every shard), writes the
manifest from what is on the disk, syncs it and the folder's entry, and only then replaces
``latest`` (temporary file, fsync, ``os.replace``, fsync of the folder: ``files.atomic_write``).
A crash during a save therefore leaves ``latest`` on the previous complete checkpoint and
the new tag without a manifest, and a power loss cannot leave ``latest`` naming files that
never reached the disk.

Before anything loads a checkpoint (resume, in phase one on every rank; export) it is
verified: every file of its manifest there, of its size and checksum, every rank's files
present, and no pickle that names a global beyond tensors, containers and DeepSpeed's few
types (``run/safe_load.py``; DeepSpeed's own loads are then forced to ``weights_only=True``).
``--resume auto`` takes the newest checkpoint that passes, saying why it passed over newer ones.

A checkpoint loads at the layout that wrote it; with ``--allow-new-layout`` at any other
(``run/universal.py``: DeepSpeed's universal format, converted once into ``universal/``).

The position and the fingerprint also travel in DeepSpeed's ``client_state``, but
resume reads them from the JSON file: that needs no ``torch.load`` and happens in
phase one, so an incompatible checkpoint fails before any process group starts.
"""

from __future__ import annotations

import errno
import hashlib
import json
import random
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from ..data.plan import PlanConfig
from ..errors import DiskFullError, InputError
from ..files import atomic_write, fsync_dir, fsync_tree
from ..model.build import ModelSpec
from ..model.lora import parameter_counts, save_adapter_config
from . import hooks
from .layout import ParallelLayout, describe_sizes
from .manifest import has_manifest, manifest_problem, read_manifest, total_bytes, write_manifest
from .reference_sync import REFERENCE_FILE, RefSync, reference_files
from .safe_load import code_in_pickle, weights_only_loading
from .universal import UNIVERSAL_FOLDER, check_convertible, load_universal, seed_new_rank

STATE_FILE = "ds_packdpo_state.json"
HF_FOLDER = "hf"
LATEST = "latest"
TAG_PREFIX = "global_step"
CLIENT_STATE_KEY = "ds_packdpo"
STATE_VERSION = 2  # 2: the parallel layout (world, data-parallel and sequence-parallel sizes)
# a first checkpoint's size, for the disk-full message: ZeRO's fp32 master weights and Adam's two moments of each
# trained parameter
BYTES_PER_PARAMETER = 12


def tag_name(global_step: int) -> str:
    return f"{TAG_PREFIX}{global_step}"


def _tag_step(path: Path) -> int | None:
    match = re.fullmatch(rf"{TAG_PREFIX}(\d+)", path.name)
    return int(match.group(1)) if match and path.is_dir() else None


@dataclass(frozen=True)
class CheckpointSpec:
    """Where a run saves, how often, how many it keeps; what it resumes from; its export at the end; how many
    non-finite steps in a row it survives (the counter is saved state)."""

    output_dir: Path  # the run's folder: a checkpoint saved from it resumes there without --overwrite
    save_dir: Path  # --save-dir, default OUTPUT_DIR/checkpoints
    save_dir_named: bool  # --save-dir given: a stopped run saves there even without --save-steps
    save_steps: int | None  # every N optimizer steps and at the end (None: no periodic save)
    total_limit: int | None  # keep the newest K
    resume: str | None  # 'auto' or a checkpoint folder
    allow_new_layout: bool  # load a checkpoint of another layout through the universal form
    overwrite: bool  # may start afresh over the save folder's checkpoints
    export_on_end: bool  # a Hugging Face folder at the end (export_dir)
    max_shard_size: str  # its largest safetensors file
    max_bad_steps: int  # consecutive non-finite steps before the run aborts

    def __post_init__(self):
        if self.total_limit is not None and not self.save_steps:
            raise InputError("--save-total-limit needs --save-steps (nothing is saved without it)")
        if self.allow_new_layout and self.resume is None:
            raise InputError("--allow-new-layout needs --resume (it says how to load a checkpoint)")
        if self.resume is not None and self.resume != "auto" and not Path(self.resume).exists():
            raise InputError(f"--resume {self.resume}: no such checkpoint folder (or pass 'auto')")

    @property
    def export_dir(self) -> Path:
        """The Hugging Face folder --export-on-end writes (replacing it) once the run has ended."""
        return self.output_dir / "hf_model"

    @property
    def saves_on_stop(self) -> bool:
        """A stop signal saves the run (checkpoints were asked for)."""
        return bool(self.save_steps) or self.save_dir_named

    def due(self, global_step: int, last: bool) -> bool:
        """A checkpoint after this step: every --save-steps, and after the last one."""
        return bool(self.save_steps) and (global_step % self.save_steps == 0 or last)


def plan_fingerprint(plan: PlanConfig, eval_fraction: float | None, data_fingerprint: str) -> str:
    """What decides which pairs make up step s: the data (content, tokenizer, truncation) and the plan settings.

    World size, row budget and packing only change the layout of a step, never its pairs; --eval-fraction decides
    which pairs train at all.
    """
    key = {"data": data_fingerprint, "seed": plan.seed, "global_batch_pairs": plan.global_batch_pairs,
           "tokens_per_step": plan.tokens_per_step, "drop_last": plan.drop_last}
    if eval_fraction is not None:  # absent otherwise: checkpoints of runs without a split keep their fingerprint
        key["eval_fraction"] = eval_fraction
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]


# ----------------------------------------------------------------------------- finding checkpoints
def missing_files(tag_dir: Path, world_size: int, zero_stage: int, reference: bool = False) -> list[str]:
    """What a complete checkpoint written by ``world_size`` ranks lacks (empty: complete); ``reference``: a TR-DPO
    run's, which holds the mixed reference too."""
    missing = [name for name in (STATE_FILE, f"{HF_FOLDER}/config.json") if not (tag_dir / name).is_file()]
    missing += [f"rng_rank{r}.pt" for r in range(world_size) if not (tag_dir / f"rng_rank{r}.pt").is_file()]
    if reference:
        missing += [name for name in reference_files(world_size, zero_stage) if not (tag_dir / name).is_file()]
    if not list(tag_dir.glob("*model_states.pt")):
        missing.append("*_model_states.pt")
    if zero_stage > 0:
        for rank in range(world_size):
            if not list(tag_dir.glob(f"*zero_pp_rank_{rank}_mp_rank_*_optim_states.pt")):
                missing.append(f"the ZeRO optimizer shard of rank {rank}")
    return missing


def tag_problem(tag_dir: Path) -> tuple[dict | None, str | None]:
    """(its state, None) for a checkpoint that can be loaded, else (None, why not): whole (every file of its manifest
    there, of its size and checksum), ours, complete (every rank's files) and holding no code in any pickle."""
    if not (tag_dir / STATE_FILE).is_file():
        return None, f"not a ds_packdpo checkpoint (no {STATE_FILE})"
    problem = manifest_problem(tag_dir)
    if problem:
        return None, problem
    try:
        state = json.loads((tag_dir / STATE_FILE).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return None, f"unreadable {STATE_FILE} ({exc})"
    if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
        version = state.get("version") if isinstance(state, dict) else None
        return None, f"{STATE_FILE} has an unknown layout (version {version!r})"
    missing = missing_files(tag_dir, state["layout"]["world_size"], state["zero_stage"],
                            reference=state.get("ref_sync") is not None)
    if missing:
        return None, f"incomplete checkpoint (missing {', '.join(missing)})"
    # universal/ too (a resume at another layout loads it), not the staging folder of a conversion that died
    for path in sorted(p for p in tag_dir.rglob("*.pt") if not p.relative_to(tag_dir).parts[0].startswith(".")):
        why = code_in_pickle(path)
        if why:
            return None, f"{path.relative_to(tag_dir)}: {why}; refused"
    return state, None


def intact_tag_dir(tag_dir: Path, where: str) -> tuple[Path, dict]:
    """(tag folder, its state) after checking that it can be loaded (``tag_problem``)."""
    state, problem = tag_problem(tag_dir)
    if problem:
        raise InputError(f"{where} {tag_dir}: {problem}")
    return tag_dir, state


def resolve_checkpoint(path: str | Path, where: str) -> tuple[Path, dict]:
    """A tag folder, or a save folder whose ``latest`` names one -> (intact tag folder, its state)."""
    path = Path(path)
    if (path / STATE_FILE).is_file():
        return intact_tag_dir(path, where)
    if (path / LATEST).is_file():
        tag = (path / LATEST).read_text().strip()
        return intact_tag_dir(path / tag, where)
    if not path.exists():
        raise InputError(f"{where} {path}: no such checkpoint folder")
    raise InputError(f"{where} {path}: neither a checkpoint (no {STATE_FILE}) nor a save folder (no '{LATEST}' file)")


def tag_dirs(save_dir: Path) -> list[Path]:
    """The checkpoint folders of a save folder, oldest step first."""
    if not save_dir.is_dir():
        return []
    steps = {path: _tag_step(path) for path in save_dir.iterdir()}
    return sorted((path for path, step in steps.items() if step is not None), key=steps.get)


@dataclass
class Found:
    """What ``--resume auto`` found in a save folder: the newest intact checkpoint (None: none is), and why each
    newer one was passed over."""

    tag_dir: Path | None
    state: dict | None
    skipped: list[str]


def newest_intact(save_dir: Path) -> Found:
    """The newest checkpoint of ``save_dir`` that ``tag_problem`` passes (newer than ``latest`` too: a save that
    died between its manifest and ``latest`` is whole), and the reasons the newer ones failed."""
    skipped = []
    for tag_dir in reversed(tag_dirs(save_dir)):
        state, problem = tag_problem(tag_dir)
        if problem is None:
            return Found(tag_dir, state, skipped)
        skipped.append(f"{tag_dir.name}: {problem}")
    return Found(None, None, skipped)


def verify_checkpoint(path: str | Path) -> tuple[list[str], int]:
    """``ds-packdpo verify-checkpoint``: one line per checkpoint of a save folder (newest first) or for one tag
    folder, and the exit code: 0 every one intact, 1 a damaged one (a resume would pass it over: the line says which
    it takes), 2 none intact."""
    path = Path(path)
    if (path / STATE_FILE).is_file():
        tags = [path]
    elif tag_dirs(path):
        tags = list(reversed(tag_dirs(path)))
    elif path.is_dir():
        raise InputError(f"verify-checkpoint {path}: neither a checkpoint (no {STATE_FILE}) nor a save folder (no "
                         f"{TAG_PREFIX}* folder)")
    else:
        raise InputError(f"verify-checkpoint {path}: no such checkpoint folder")
    lines, intact = [], []
    for tag_dir in tags:
        started = time.perf_counter()
        _, problem = tag_problem(tag_dir)
        if problem:
            lines.append(f"{tag_dir}: DAMAGED: {problem}")
            continue
        intact.append(tag_dir)
        files, seconds = read_manifest(tag_dir)["files"], time.perf_counter() - started
        lines.append(f"{tag_dir}: intact ({len(files)} files, {total_bytes(tag_dir):,} bytes verified in "
                     f"{seconds:.2f} s)")
    if not intact:
        raise InputError(f"verify-checkpoint {path}: no intact checkpoint ({'; '.join(lines)})")
    if len(intact) == len(tags):
        return lines, 0
    lines.append(f"--resume auto would load {intact[0]}")
    return lines, 1


def checkpoint_to_resume(checkpoint: CheckpointSpec) -> Found | None:
    """The checkpoint ``--resume`` asks for; None to start fresh (no --resume, or auto and no checkpoint yet)."""
    if checkpoint.resume is None:
        return None
    if checkpoint.resume == "auto":
        found = newest_intact(checkpoint.save_dir)
        return found if found.tag_dir is not None or found.skipped else None
    return Found(*resolve_checkpoint(checkpoint.resume, "--resume"), skipped=[])


def resumes_in_place(checkpoint: CheckpointSpec) -> bool:
    """True when --resume continues the run that lives in --output-dir (its own folder: no --overwrite needed).

    Reads the state files alone: ``check_resume`` verifies the checkpoint it takes, once (it reads every byte).
    """
    if checkpoint.resume is None:
        return False
    path = checkpoint.save_dir if checkpoint.resume == "auto" else Path(checkpoint.resume)
    own = checkpoint.output_dir.resolve()
    for tag_dir in [path] if (path / STATE_FILE).is_file() else tag_dirs(path):
        try:
            state = json.loads((tag_dir / STATE_FILE).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(state, dict) and state.get("output_dir") and Path(state["output_dir"]).resolve() == own:
            return True
    return False


def holds_checkpoints(save_dir: Path) -> bool:
    return save_dir.is_dir() and ((save_dir / LATEST).exists() or any(save_dir.glob(f"{TAG_PREFIX}*")))


@dataclass
class ResumePoint:
    tag_dir: Path
    epoch: int          # plan position of the next step to run
    epoch_step: int
    global_step: int    # optimizer steps done
    bad_steps: int      # consecutive skipped steps so far
    saved_world_size: int = 1  # ranks that wrote the checkpoint (their RNG files exist)
    universal: bool = False    # written at another layout: loaded from its universal form
    skipped: tuple[str, ...] = ()  # --resume auto: the newer checkpoints passed over, each with its reason


def lora_record(model: ModelSpec) -> dict | None:
    """What a checkpoint records of a run's LoRA settings (None: full fine-tuning); a resume must match it."""
    return model.lora.as_dict() if model.lora is not None else None


def check_resume(checkpoint: CheckpointSpec, fingerprint: str, layout: ParallelLayout, model: ModelSpec,
                 sync: RefSync | None) -> ResumePoint | None:
    """Phase one: the checkpoint to resume, checked against this run (its plan's ``fingerprint``, layout, precision,
    LoRA and TR-DPO settings); None = fresh start."""
    found = checkpoint_to_resume(checkpoint)
    save_dir = checkpoint.save_dir
    if found is None or found.tag_dir is None:
        if holds_checkpoints(save_dir) and not checkpoint.overwrite:
            hint = (f"holds no intact checkpoint to resume ({'; '.join(found.skipped)})" if found
                    else "holds no complete checkpoint to resume, only partial saves" if checkpoint.resume == "auto"
                    else "holds checkpoints of an earlier run (pass --resume auto to continue it)")
            raise InputError(f"--save-dir {save_dir}: {hint}; pass --overwrite to start afresh")
        return None
    tag_dir, state = found.tag_dir, found.state
    where = f"--resume {tag_dir}"
    if state["plan_fingerprint"] != fingerprint:
        raise InputError(f"{where}: the checkpoint was written for other data or plan settings (dataset, tokenizer, "
                         "--max-length, --seed, --global-batch-pairs/--tokens-per-step, --drop-last, --eval-fraction "
                         "differ); resume "
                         "with the run's own settings")
    new_layout = state["layout"] != layout.as_dict()
    if new_layout and not checkpoint.allow_new_layout:
        raise InputError(f"{where}: written by {describe_sizes(state['layout'])}, this run is "
                         f"{layout.describe()}; DeepSpeed ZeRO shards load only into the same layout (pass "
                         "--allow-new-layout to load it at this one through DeepSpeed's universal format)")
    lora = lora_record(model)
    if state.get("lora") != lora:
        raise InputError(f"{where}: written with {describe_training(state.get('lora'))}, this run trains "
                         f"{describe_training(lora)}; resume with the run's own --lora-* settings")
    if state["zero_stage"] != layout.zero_stage or state["dtype"] != model.dtype:
        raise InputError(f"{where}: written with ZeRO stage {state['zero_stage']} and --dtype {state['dtype']}, this "
                         f"run uses stage {layout.zero_stage} and --dtype {model.dtype}")
    if state.get("ref_sync") != (sync.record() if sync else None):
        raise InputError(f"{where}: written with {describe_sync(state.get('ref_sync'))}, this run has "
                         f"{describe_sync(sync.record() if sync else None)}; resume with the run's own "
                         f"--sync-ref-model settings")
    if new_layout:
        if sync is not None:
            raise InputError(f"{where}: its TR-DPO reference is saved as the partitions of "
                             f"{describe_sizes(state['layout'])}; --allow-new-layout cannot load it at another layout")
        check_convertible(tag_dir, state["zero_stage"])
    position = state["position"]
    return ResumePoint(tag_dir, position["epoch"], position["epoch_step"], position["global_step"],
                       state["bad_steps"], state["layout"]["world_size"], universal=new_layout,
                       skipped=tuple(found.skipped))


def describe_sync(record: dict | None) -> str:
    """A checkpoint's TR-DPO record in words."""
    if record is None:
        return "a fixed reference (no --sync-ref-model)"
    return f"--sync-ref-model alpha {record['alpha']:g} every {record['every']} steps"


def describe_training(lora: dict | None) -> str:
    """What a run trains, from a checkpoint's ``lora`` record (None: every weight)."""
    if lora is None:
        return "every weight (no LoRA)"
    return (f"LoRA r={lora['r']} alpha={lora['alpha']:g} dropout={lora['dropout']:g} on "
            f"{lora['target_modules']}")


# ----------------------------------------------------------------------------- RNG
def rng_state() -> dict:
    """Every RNG a step may draw from, as plain ints, lists and tensors (safe for weights_only=True)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, py_gauss = random.getstate()
    state = {"python": [version, list(internal), py_gauss], "numpy": [kind, torch.from_numpy(keys.astype(np.int64)),
                                                                     pos, has_gauss, gauss],
             "torch": torch.get_rng_state()}
    accel = get_accelerator()
    if accel.device_name() != "cpu":
        state["accelerator"] = accel.get_rng_state()
    return state


def restore_rng(point: ResumePoint, rank: int, seed: int) -> None:
    """This rank's saved RNG streams, or, for a rank the checkpoint's layout did not have, fresh ones from (seed,
    step, rank)."""
    if rank < point.saved_world_size:
        set_rng_state(torch.load(point.tag_dir / f"rng_rank{rank}.pt", weights_only=True))  # ours: no DeepSpeed type
    else:
        seed_new_rank(seed, point.global_step, rank)


def set_rng_state(state: dict) -> None:
    version, internal, py_gauss = state["python"]
    random.setstate((version, tuple(internal), py_gauss))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "accelerator" in state:
        get_accelerator().set_rng_state(state["accelerator"])


# ----------------------------------------------------------------------------- saving
def write_latest(save_dir: Path, tag: str) -> None:
    """Points ``latest`` at ``tag`` atomically and durably: a reader sees the old tag or the new one, never a torn
    file, and after a power loss the one it saw."""
    atomic_write(save_dir / LATEST, lambda temporary: Path(temporary).write_text(tag))


def files_of_rank(tag_dir: Path, rank: int) -> list[Path]:
    """The files rank ``rank`` writes into a checkpoint: its RNG file and its ZeRO shards (named by partition rank,
    which is the global rank when ZeRO partitions over the whole world, as ZeRO-3 here does)."""
    return [tag_dir / f"rng_rank{rank}.pt", *tag_dir.glob(f"*zero_pp_rank_{rank}_*"),
            *tag_dir.glob(REFERENCE_FILE.format(rank=rank))]


def prune(save_dir: Path, keep: int, latest_tag: str) -> list[str]:
    """Deletes the checkpoints beyond the newest ``keep`` whole ones (those with a manifest) and the partial saves
    older than ``latest``; never ``latest`` (the save that calls this has just written its manifest: it is the
    newest intact one).  Returns the deleted names."""
    tags = tag_dirs(save_dir)
    whole = [path for path in tags if has_manifest(path)]
    kept = {path.name for path in whole[-keep:]} | {latest_tag}
    latest_step = _tag_step(save_dir / latest_tag)
    doomed = [path for path in tags if path.name not in kept and (has_manifest(path) or _tag_step(path) < latest_step)]
    for path in doomed:
        shutil.rmtree(path)
    return [path.name for path in doomed]


class Checkpointer:
    """Saves and restores the policy engine plus what the trainer needs to continue exactly."""

    def __init__(self, run, reference_sync=None):
        spec = run.setup.spec
        self.settings = spec.checkpoint
        self.model = spec.model
        self.seed = spec.plan.config.seed  # of the RNG of a rank new to a checkpoint
        self.run = run
        self.reference_sync = reference_sync  # a TR-DPO run's (run/reference_sync.py): its reference is state too
        self.layout = spec.layout
        self.save_dir = self.settings.save_dir
        self.fingerprint = run.setup.plan_fingerprint
        self.saved_step: int | None = None  # global step of the newest checkpoint of this run (same on every rank)

    def due(self, global_step: int, last: bool) -> bool:
        return self.settings.due(global_step, last)

    def save(self, engine, global_step: int, next_epoch: int, next_epoch_step: int, bad_steps: int) -> Path:
        """All ranks: write the tag; then rank 0 checks it, writes its manifest and moves ``latest`` (plus retention).

        A disk that fills up on the way ends the job (``DiskFullError``) with ``latest`` on the previous checkpoint.
        """
        rank = self.layout.rank
        tag = tag_name(global_step)
        tag_dir = self.save_dir / tag
        if rank == 0:
            self.save_dir.mkdir(parents=True, exist_ok=True)
            latest = self.save_dir / LATEST
            if latest.is_file() and latest.read_text().strip() == tag:
                raise RuntimeError(f"checkpoint {tag_dir} exists already and is 'latest'; refusing to rewrite it")
            if tag_dir.exists():
                shutil.rmtree(tag_dir)  # a partial save of a crashed run, or a step undone by a resume
            tag_dir.mkdir()
        dist.barrier()
        state = {
            "version": STATE_VERSION,
            "position": {"epoch": next_epoch, "epoch_step": next_epoch_step, "global_step": global_step},
            "bad_steps": bad_steps,
            "plan_fingerprint": self.fingerprint,
            "data_fingerprint": self.run.setup.prepared.fingerprint,
            "layout": self.layout.as_dict(),
            "zero_stage": self.layout.zero_stage,
            "dtype": self.model.dtype,
            "output_dir": str(self.settings.output_dir.resolve()),
            "lora": lora_record(self.model),  # its adapter config is in hf/ too
        }
        if self.reference_sync is not None:  # absent otherwise: a checkpoint without TR-DPO is unchanged
            state["ref_sync"] = self.reference_sync.settings.record()
        try:
            with hooks.installed().saving(rank, global_step):
                self._write(engine, tag_dir, state)
        except OSError as error:
            if error.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise self._disk_full(engine, tag_dir, error) from error
        self.saved_step = global_step
        return tag_dir

    def _write(self, engine, tag_dir: Path, state: dict) -> None:
        rank, tag = self.layout.rank, tag_dir.name
        torch.save(rng_state(), tag_dir / f"rng_rank{rank}.pt")
        if self.reference_sync is not None:
            self.reference_sync.save(tag_dir, rank)
        if rank == 0:
            engine.module.config.save_pretrained(tag_dir / HF_FOLDER)
            if self.model.lora is not None:
                save_adapter_config(engine, tag_dir / HF_FOLDER)  # export rebuilds the adapters from it
            self.run.setup.tokenizer.save_pretrained(tag_dir / HF_FOLDER)
            (tag_dir / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")
        engine.save_checkpoint(str(self.save_dir), tag=tag, client_state={CLIENT_STATE_KEY: state},
                               save_latest=False)  # ends with a barrier: every rank's files are written
        hooks.installed().saved(rank, state["position"]["global_step"])
        for path in files_of_rank(tag_dir, rank):
            fsync_tree(path)  # by the rank that wrote it: on a shared file system only its node holds the dirty pages
        dist.barrier()
        if rank == 0:
            missing = missing_files(tag_dir, self.layout.world_size, self.layout.zero_stage,
                                    reference=self.reference_sync is not None)
            if missing:
                raise RuntimeError(f"checkpoint {tag_dir} is incomplete after saving (missing {', '.join(missing)}); "
                                   f"'{LATEST}' still names the previous one")
            fsync_tree(tag_dir)  # our state, hf/, and (on one node) every rank's files
            write_manifest(tag_dir)  # last: read back from the disk, synced with its folder
            fsync_dir(self.save_dir)  # the tag folder's own entry, before 'latest' names it
            write_latest(self.save_dir, tag)
            if self.settings.total_limit:
                prune(self.save_dir, self.settings.total_limit, tag)

    def _disk_full(self, engine, tag_dir: Path, error: OSError) -> DiskFullError:
        """The one line of a save that ran out of space; rank 0 removes the partial tag (no manifest: never
        resumed) to give the space back."""
        latest = self.save_dir / LATEST
        previous = latest.read_text().strip() if latest.is_file() else None
        needed = (total_bytes(self.save_dir / previous) if previous else None) or \
            BYTES_PER_PARAMETER * parameter_counts(engine.module)[0]
        if self.layout.rank == 0:
            shutil.rmtree(tag_dir, ignore_errors=True)
        free = shutil.disk_usage(self.save_dir).free
        kept = f"'{LATEST}' still names {previous}, intact" if previous else "no earlier checkpoint"
        return DiskFullError(f"rank {self.layout.rank}: no space left on the device of {self.save_dir} for checkpoint "
                             f"{tag_dir.name}: it needs about {needed:,} bytes, {free:,} are free ({error.strerror});"
                             f" {kept}; free space and relaunch with --resume auto")

    def restore(self, engine, point: ResumePoint) -> None:
        """Loads the DeepSpeed state (weights, optimizer, LR schedule, step counters) and this rank's RNG.

        At a new layout the engine (configured with ``load_universal``) reads the universal form that phase one made.
        """
        if self.layout.rank == 0 and point.skipped:
            # 'latest' named a damaged checkpoint: it now names the one loaded, so the next save may replace the other
            write_latest(point.tag_dir.parent, point.tag_dir.name)
        load_dir, tag = (point.tag_dir, UNIVERSAL_FOLDER) if point.universal else (point.tag_dir.parent,
                                                                                   point.tag_dir.name)
        if not (load_dir / tag).is_dir():
            raise RuntimeError(f"checkpoint {load_dir / tag} is missing (phase one on rank 0 converts it)")
        with weights_only_loading():
            if point.universal:
                load_path, client_state = load_universal(engine, load_dir)
            else:
                load_path, client_state = engine.load_checkpoint(str(load_dir), tag=tag, load_optimizer_states=True,
                                                                 load_lr_scheduler_states=True)
        if load_path is None or CLIENT_STATE_KEY not in (client_state or {}):
            raise RuntimeError(f"DeepSpeed could not load the checkpoint {load_dir / tag}")
        if client_state[CLIENT_STATE_KEY]["position"]["global_step"] != point.global_step:
            raise RuntimeError(f"checkpoint {point.tag_dir}: DeepSpeed's client_state disagrees with {STATE_FILE}")
        if self.reference_sync is not None:
            self.reference_sync.load(point.tag_dir, self.layout.rank)
        restore_rng(point, self.layout.rank, self.seed)
        self.saved_step = point.global_step

