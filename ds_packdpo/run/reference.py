"""Where the reference log-probs of a step come from: a live reference model, or a file computed once.

The reference model is frozen, so its log-probs of a pair never change during
training: ``ds-packdpo precompute-ref`` computes them once (packed and under ZeRO-3
like training, :mod:`ds_packdpo.precompute_ref`) and ``train --ref-logps FILE``
looks them up by pair id instead of running and holding a second model.

The file is ``FILE`` (JSON lines, or Parquet for a name ending in ``.parquet``),
one record per pair: ``pair_id``, ``chosen_logps``, ``rejected_logps`` and the
completion token counts (IPO normalizes per token), the sums in fp64 (a JSON number written
with every digit of the double, a Parquet ``double`` column), next to ``FILE.meta.json``
holding the fingerprint of everything that decides those numbers: the reference
model (a folder: its config and weight files; a hub id: its commit; a built config:
the config and the seed), the tokenizer, the tokenized dataset (content, format, truncation), the
dtype and LD-DPO's ``--ld-alpha`` (the stored sums are weighted with it).  A run whose fingerprint differs, or a pair missing from the file, is an
:class:`InputError` before any process group starts.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import InitVar, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from ..data.prepare import tokenizer_fingerprint
from ..errors import InputError
from ..files import atomic_write, check_not_an_input
from ..hub import hub_commit, is_hub_id
from ..model.build import ModelSpec, load_model_config
from ..model.logps import SequenceLogps
from ..model.loss_registry import LossConfig
from .engines import zero_stage
from .reference_sync import RefSync

# 2: sums stored and read in fp64 (version 1 held their fp32 rounding, 2.6e-4 nats off at 512 tokens); a version-1
# file is refused by the fingerprint check rather than read as if exact.
FORMAT_VERSION = 2
RECORD_KEYS = ("pair_id", "chosen_logps", "rejected_logps", "chosen_tokens", "rejected_tokens")
OUTPUT_SUFFIXES = (".jsonl", ".parquet")
# Files of an HF model folder that decide its outputs (weights: all shards; configs).
_MODEL_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_HASH_BLOCK = 1 << 24


@dataclass(frozen=True)
class ReferenceSpec:
    """Where a run's reference log-probs come from besides the model: a precomputed file, the reference's parameters
    offloaded, the reference mixed toward the policy (TR-DPO).  Checked against what the rest of the run says of its
    reference (the ``InitVar`` facts, given when it is made)."""

    logps_file: str | None  # --ref-logps: no reference model at all
    offload: bool  # --ref-offload (ZeRO-3)
    sync: RefSync | None  # --sync-ref-model (None: a fixed reference)
    whole: bool = False  # --ref-whole: every parameter persistent under ZeRO-3 (run/engines.reference_ds_config)
    lora: InitVar[bool] = False  # the policy trains LoRA adapters (its reference: the policy with them off)
    separate_model: InitVar[bool] = False  # --ref-model names a reference model
    loss: InitVar[LossConfig | None] = None  # the run's loss (one that needs no reference: SimPO)
    held_out_dataset: InitVar[bool] = False  # --eval-dataset: held-out pairs of another dataset

    def __post_init__(self, lora: bool, separate_model: bool, loss: LossConfig | None, held_out_dataset: bool):
        if self.logps_file is not None and held_out_dataset:
            raise InputError(f"--eval-dataset with --ref-logps {self.logps_file}: the file holds the reference log-probs "
                             f"of --dataset only; evaluate on --eval-fraction of it, or drop --ref-logps")
        if lora and self.offload and not separate_model and self.logps_file is None:
            raise InputError("--ref-offload with --lora-r: the reference is the policy with its adapters off, there "
                             "is no reference model to offload (give --ref-model to use a separate one)")
        if self.whole and self.offload:
            raise InputError("--ref-whole with --ref-offload: the one keeps the reference's weights on every GPU, the "
                             "other on the CPU; drop one of them")
        if lora and self.whole and not separate_model and self.logps_file is None:
            raise InputError("--ref-whole with --lora-r: the reference is the policy with its adapters off, there "
                             "is no reference model to keep whole (give --ref-model to use a separate one)")
        if self.whole and self.sync is not None:
            raise InputError("--ref-whole with --sync-ref-model: TR-DPO mixes each rank's partition of the reference, "
                             "which a whole reference's forward does not read; drop one of them")
        if self.sync is not None:  # TR-DPO needs a reference model of its own to mix (TRL refuses the same)
            if lora:
                raise InputError("--sync-ref-model with --lora-r: LoRA's reference is the policy with its adapters off "
                                 "(or a --ref-model the adapters never reach), not a model to mix toward the policy; "
                                 "TRL refuses it too; train every weight to use TR-DPO")
            if self.logps_file is not None:
                raise InputError(f"--sync-ref-model with --ref-logps {self.logps_file}: precomputed log-probs are of a "
                                 f"fixed reference, which TR-DPO moves; drop one of them")
            if loss is not None and not loss.needs_reference:
                raise InputError(f"--sync-ref-model with --loss {loss.loss_type}: {loss.specs[0].title} is "
                                 f"reference-free, there is no reference to mix")
        if self.logps_file is not None:
            if not Path(self.logps_file).is_file():
                raise InputError(f"--ref-logps {self.logps_file}: no such file")
            conflict = precomputed_conflict(loss, self.offload, self.whole)
            if conflict:
                raise InputError(f"--ref-logps {self.logps_file}: {conflict}; drop one of them")


def precomputed_conflict(loss: LossConfig | None, offload: bool, whole: bool = False) -> str | None:
    """Why a run takes no precomputed reference (None: it does): its loss needs none, or it places a reference
    model (offloads it or keeps it whole)."""
    if loss is not None and not loss.needs_reference:
        return f"--loss {loss.loss_type} is reference-free"
    placed = [flag for flag, given in (("--ref-offload", offload), ("--ref-whole", whole)) if given]
    return f"{placed[0]} needs a reference model" if placed else None


def meta_path(path) -> Path:
    return Path(f"{path}.meta.json")


def _sha256_json(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def model_fingerprint(model: ModelSpec, vocab_size: int, zero_init: bool) -> dict:
    """Identity of the reference model: a folder's config + weight files (content), a hub id's commit, or a built
    config + seed.

    Random weights built under ZeRO-3 (``deepspeed.zero.Init``) differ from those
    built without it for the same seed (seen here), hence ``zero_init``.

    Hashing the weight files reads them once (about 1 GB/s): the price of never
    training against log-probs of another checkpoint saved at the same path.
    """
    folder = model.reference or model.path
    if folder is None:
        config = load_model_config(model.built_config, vocab_size).to_dict()
        config.pop("transformers_version", None)
        return {"config_sha256": _sha256_json(config), "seed": model.seed, "zero_init": zero_init}
    if is_hub_id(folder):  # a hub commit names its files exactly; phase one has its config.json in the hub cache
        revision = model.revision if folder == model.path else None
        where = "--ref-model" if model.reference else "--model"
        return {"hub_id": folder, "commit": hub_commit(folder, revision, where)}
    digest = hashlib.sha256()
    for path in sorted(Path(folder).iterdir()):
        if path.name == "config.json" or path.suffix in _MODEL_FILE_SUFFIXES:
            digest.update(path.name.encode() + b"\0")
            with open(path, "rb") as handle:
                while block := handle.read(_HASH_BLOCK):
                    digest.update(block)
    return {"folder_sha256": digest.hexdigest()}


def reference_fingerprint(setup) -> dict:
    """Everything that changes a pair's reference log-probs (of an assemble.RunSetup); the row layout and the
    parallel layout do not (invariant 2)."""
    spec = setup.spec
    return {
        "format_version": FORMAT_VERSION,
        "model": model_fingerprint(spec.model, len(setup.tokenizer), zero_stage(setup.ds_config) == 3),
        "tokenizer": tokenizer_fingerprint(setup.tokenizer),
        "dataset": setup.prepared.fingerprint,  # content, tokenizer, format, max_length, max_prompt_length
        "dtype": spec.model.dtype,
        "max_length": spec.data.tokenization.max_length,
        "max_prompt_length": spec.data.tokenization.max_prompt_length,
        "ld_alpha": spec.loss.ld_alpha,  # LD-DPO weighs the stored sums (None, off, matches a file written without it)
    }


# ----------------------------------------------------------------------------- writing
def check_output_path(out: str | None, overwrite: bool, reads=()) -> Path:
    """``--out`` of precompute-ref, checked before any work: suffix, not an input, folder, no silent overwrite."""
    if not out:
        raise InputError("--out is required: the file to write the reference log-probs to (.jsonl or .parquet)")
    path = Path(out)
    if path.suffix not in OUTPUT_SUFFIXES:
        raise InputError(f"--out {out}: the name must end in {' or '.join(OUTPUT_SUFFIXES)}")
    check_not_an_input(path, "--out", reads)
    if path.parent.exists() and not path.parent.is_dir():
        raise InputError(f"--out {out}: {path.parent} is not a folder")
    if (path.exists() or meta_path(path).exists()) and not overwrite:
        raise InputError(f"--out {out}: file exists (pass --overwrite to replace it)")
    return path


def write_reference(path, columns: dict[str, list], fingerprint: dict, info: dict) -> None:
    """The records (``RECORD_KEYS`` columns, one entry per pair) and then their fingerprint.

    An older ``.meta.json`` is removed first: if anything stops midway, the file has
    no fingerprint and training refuses it, rather than matching new numbers to an
    old fingerprint.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta_path(path).unlink(missing_ok=True)
    if path.suffix == ".parquet":
        atomic_write(path, lambda tmp: pq.write_table(pa.table(columns), tmp))
    else:
        def write_lines(tmp):
            with open(tmp, "w") as handle:
                for values in zip(*(columns[k] for k in RECORD_KEYS)):
                    handle.write(json.dumps(dict(zip(RECORD_KEYS, values))) + "\n")

        atomic_write(path, write_lines)
    meta = {"fingerprint": fingerprint, "info": info}
    atomic_write(meta_path(path), lambda tmp: Path(tmp).write_text(json.dumps(meta, indent=2) + "\n"))


# ----------------------------------------------------------------------------- reading
def _read_records(path: Path) -> dict[str, list]:
    label = f"--ref-logps {path}"
    if path.suffix == ".parquet":
        try:
            table = pq.read_table(path).to_pydict()
        except Exception as error:  # pyarrow raises several types for a damaged file
            raise InputError(f"{label}: not a readable Parquet file ({str(error).splitlines()[0]})") from None
        missing = [k for k in RECORD_KEYS if k not in table]
        if missing:
            raise InputError(f"{label}: missing column(s) {', '.join(missing)}")
        return {k: table[k] for k in RECORD_KEYS}
    columns = {k: [] for k in RECORD_KEYS}
    with open(path) as handle:
        for number, line in enumerate(handle, start=1):
            try:
                record = json.loads(line)
                values = [record[k] for k in RECORD_KEYS]
            except (json.JSONDecodeError, KeyError, TypeError) as error:
                raise InputError(f"{label} line {number}: expected a JSON object with keys "
                                 f"{', '.join(RECORD_KEYS)} ({type(error).__name__}: {error})") from None
            if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
                raise InputError(f"{label} line {number}: every value must be a number, got {record}")
            for key, value in zip(RECORD_KEYS, values):
                columns[key].append(value)
    return columns


class PrecomputedReference:
    """Reference log-probs of every pair of the run, aligned with the dataset's positional pair index."""

    def __init__(self, values: torch.Tensor):
        self.values = values  # [pairs, 4] float64: chosen, rejected logps; chosen, rejected token counts

    @classmethod
    def load(cls, path, fingerprint: dict, pair_ids) -> PrecomputedReference:
        """Reads ``path`` for the run whose fingerprint and dataset ``pair_ids`` (in positional order) are given."""
        path = Path(path)
        label = f"--ref-logps {path}"
        meta_file = meta_path(path)
        if not meta_file.is_file():
            raise InputError(f"{label}: no fingerprint file {meta_file.name} beside it (was it written by "
                             f"'ds-packdpo precompute-ref'?)")
        try:
            stored = json.loads(meta_file.read_text())["fingerprint"]
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise InputError(f"{label}: unreadable {meta_file.name} ({type(error).__name__}: {error})") from None
        differing = sorted(k for k in set(stored) | set(fingerprint) if stored.get(k) != fingerprint.get(k))
        if differing:
            # the settings' own values said (a model or data hash would say nothing)
            values = "".join(f"{key}: file {_setting(stored.get(key))}, this run {_setting(fingerprint.get(key))}; "
                             for key in differing if key not in HASHED_FINGERPRINT_KEYS)
            raise InputError(f"{label}: computed for a different {', '.join(differing)} than this run "
                             f"({values}run 'ds-packdpo precompute-ref' with this run's settings)")
        columns = _read_records(path)
        position = {}
        for row, pair_id in enumerate(columns["pair_id"]):
            if position.setdefault(int(pair_id), row) != row:
                raise InputError(f"{label}: pair_id {int(pair_id)} appears more than once")
        missing = [int(pair_id) for pair_id in pair_ids if int(pair_id) not in position]
        if missing:
            raise InputError(f"{label}: no reference log-probs for pair_id {missing[0]} "
                             f"({len(missing)} of the run's {len(pair_ids)} pairs are missing)")
        rows = np.asarray([position[int(pair_id)] for pair_id in pair_ids], dtype=np.int64)
        table = np.stack([np.asarray(columns[k], dtype=np.float64)[rows] for k in RECORD_KEYS[1:]], axis=1)
        return cls(torch.from_numpy(table))

    def sequence_logps(self, batch) -> SequenceLogps:
        """The row's pairs in canonical order (sequence 2p chosen, 2p+1 rejected), as a forward would give them."""
        return self.pair_logps(batch.pair_indices, batch.input_ids.device)

    def pair_logps(self, pair_indices, device) -> SequenceLogps:
        """The pairs ``pair_indices`` (positional) in canonical order: a row's, or with prompt groups spread over
        ranks a row slot's (its pairs' sides lie on several ranks; the file holds each pair whole)."""
        rows = self.values[torch.as_tensor(pair_indices, dtype=torch.long).cpu()].to(device)
        return SequenceLogps(logps=rows[:, 0:2].reshape(-1), tokens=rows[:, 2:4].reshape(-1),
                             logits_sum=torch.zeros(2 * rows.shape[0], dtype=torch.float64, device=device))


HASHED_FINGERPRINT_KEYS = ("model", "tokenizer", "dataset")


def _setting(value) -> str:
    return "none" if value is None else str(value)


def load_precomputed_reference(setup) -> PrecomputedReference | None:
    """The ``--ref-logps`` file checked against this run (None without it); phase one, before any process group."""
    path = setup.spec.reference.logps_file
    if path is None:
        return None
    return PrecomputedReference.load(path, reference_fingerprint(setup), setup.prepared.pair_ids)
