"""What a run reads: its rows (a dataset, or the embedded synthetic set), its tokenizer, and the tokenized pairs.

Shared by every command that looks at data (train, bench, precompute-ref, check,
prepare, pack-stats), so they all see the same pairs for the same settings.  No torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from ..errors import InputError
from ..hub import check_likely_local, is_hub_id
from .heldout import EvalSpec, first_pairs, split_by_content
from .prepare import DataConfig, PreparedPairs, prepare_pairs
from .synthetic import default_tokenizer, synthetic_preference_rows
from .tokenizer import load_tokenizer


@dataclass(frozen=True)
class DataSpec:
    """What a run reads: its pairs (a dataset, or the embedded synthetic set), tokenized as ``tokenization`` says,
    and its tokenizer."""

    tokenization: DataConfig  # the dataset ('synthetic' for the embedded set) and how it is tokenized
    synthetic_pairs: int | None  # the embedded set's pairs; None when --dataset names the data
    tokenizer: str | None  # --tokenizer (a folder or a hub id); None: --model's, or a BPE of the synthetic set
    model: str | None  # --model, whose tokenizer is the run's without --tokenizer
    revision: str | None  # of a hub --model's tokenizer
    trust_remote_code: bool

    def __post_init__(self):
        if self.tokenizer is not None and not Path(self.tokenizer).is_dir():
            if not is_hub_id(self.tokenizer):
                raise InputError(f"--tokenizer {self.tokenizer}: no such folder, and not a hub id")
            check_likely_local(self.tokenizer, "--tokenizer", "tokenizer_config.json")


def tokenizer_and_rows(data: DataSpec) -> tuple[object, list[dict] | None]:
    """The tokenizer (--tokenizer, else --model's, else a local BPE for the synthetic set) and the in-memory rows
    of the synthetic set (None when --dataset names the data)."""
    rows = synthetic_preference_rows(data.synthetic_pairs, seed=0) if data.synthetic_pairs is not None else None
    if data.tokenizer is not None:
        return load_tokenizer(data.tokenizer, trust_remote_code=data.trust_remote_code), rows
    if data.model is not None:
        return load_tokenizer(data.model, trust_remote_code=data.trust_remote_code, revision=data.revision), rows
    if rows is not None:
        return default_tokenizer(rows), rows
    raise InputError("--tokenizer is required with --dataset when no --model provides one")


def prepare_run_data(data_cfg: DataConfig, tokenizer, rows: list[dict] | None) -> PreparedPairs:
    """The tokenized pairs of ``data_cfg``, tokenized once per node: the first process to take the lock fills the
    cache, the others then read it."""
    cache_dir = data_cfg.cache_path
    cache_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache_dir / "prepare.lock")):
        prepared = prepare_pairs(data_cfg, tokenizer, rows=rows)
    if len(prepared.chosen_lengths) == 0:
        raise InputError(f"--dataset {data_cfg.dataset}: no pairs left after validation and truncation")
    return prepared


def split_held_out(evaluation: EvalSpec, tokenizer, prepared: PreparedPairs
                   ) -> tuple[PreparedPairs, PreparedPairs | None]:
    """(training pairs, held-out pairs or None): --eval-fraction of ``prepared`` by content, or --eval-dataset tokenized
    like --dataset (its first --eval-max-pairs pairs)."""
    if evaluation.fraction is not None:
        train, held_out = split_by_content(prepared, evaluation.fraction)
        return train, first_pairs(held_out, evaluation.max_pairs)
    if evaluation.dataset is not None:
        return prepared, prepare_run_data(evaluation.dataset, tokenizer, None)
    return prepared, None
