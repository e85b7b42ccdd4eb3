"""What a run reads: its rows (a dataset, or the embedded synthetic set), its tokenizer, and the tokenized pairs.

Shared by every command that looks at data (train, bench, precompute-ref, check,
prepare, pack-stats), so they all see the same pairs for the same settings.  No torch.
"""

from __future__ import annotations

from filelock import FileLock

from ..errors import InputError
from .heldout import first_pairs, split_by_content
from .prepare import DataConfig, PreparedPairs, prepare_pairs
from .synthetic import default_tokenizer, synthetic_preference_rows
from .tokenizer import load_tokenizer


def tokenizer_and_rows(cfg) -> tuple[object, list[dict] | None]:
    """The tokenizer (--tokenizer, else --model's, else a local BPE for the synthetic set) and the in-memory rows
    of the synthetic set (None when --dataset names the data)."""
    rows = synthetic_preference_rows(cfg.synthetic_pairs, seed=0) if cfg.dataset is None else None
    if cfg.tokenizer is not None:
        return load_tokenizer(cfg.tokenizer, trust_remote_code=cfg.trust_remote_code), rows
    if cfg.model is not None:
        return load_tokenizer(cfg.model, trust_remote_code=cfg.trust_remote_code, revision=cfg.revision), rows
    if rows is not None:
        return default_tokenizer(rows), rows
    raise InputError("--tokenizer is required with --dataset when no --model provides one")


def prepare_run_data(cfg, tokenizer, rows: list[dict] | None, data_cfg: DataConfig | None = None) -> PreparedPairs:
    """The run's tokenized pairs (or those of ``data_cfg``), tokenized once per node: the first process to take the
    lock fills the cache, the others then read it."""
    data_cfg = data_cfg or cfg.data_config()
    cache_dir = data_cfg.cache_path
    cache_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache_dir / "prepare.lock")):
        prepared = prepare_pairs(data_cfg, tokenizer, rows=rows)
    if len(prepared.chosen_lengths) == 0:
        raise InputError(f"--dataset {data_cfg.dataset}: no pairs left after validation and truncation")
    return prepared


def split_held_out(cfg, tokenizer, prepared: PreparedPairs) -> tuple[PreparedPairs, PreparedPairs | None]:
    """(training pairs, held-out pairs or None): --eval-fraction of ``prepared`` by content, or --eval-dataset tokenized
    like --dataset (its first --eval-max-pairs pairs)."""
    if cfg.eval_fraction is not None:
        train, held_out = split_by_content(prepared, cfg.eval_fraction)
        return train, first_pairs(held_out, cfg.eval_max_pairs)
    if cfg.eval_dataset is not None:
        data_cfg = DataConfig.from_settings(cfg, dataset=cfg.eval_dataset, max_pairs=cfg.eval_max_pairs)
        return prepared, prepare_run_data(cfg, tokenizer, None, data_cfg)
    return prepared, None
