"""The held-out pairs of a run: a split of --dataset by pair content, or a separate --eval-dataset.

``--eval-fraction F`` holds out a pair when a hash of its tokens (prompt, chosen and
rejected ids) falls in the lowest F of the hash range.  A pair's side therefore depends
on nothing but its own content: not on the seed, the layout, the order of the rows or the
other pairs of the file, so adding rows never moves a held-out pair into training, and an
exact duplicate of a held-out pair is held out with it (never trained on under another
row).  The pairs made from one row of several responses are placed by their prompt's ids
alone, so a group is held out whole: none of its responses trains in another pair.  The
count is F x pairs up to sampling noise; the plan summary says how many.
No torch.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

from ..errors import InputError
from .prepare import PreparedPairs

_HASH_SPAN = float(2 ** 64)  # the first 8 bytes of a SHA-256, as an unsigned integer


def content_positions(prepared: PreparedPairs) -> np.ndarray:
    """Each pair's place in [0, 1): a hash of its prompt, chosen and rejected token ids (of its prompt's alone for
    pairs made from groups of responses), uniform and deterministic."""
    grouped = "multi_response" in prepared.summary
    columns = ["prompt_ids"] if grouped else ["prompt_ids", "chosen_ids", "rejected_ids"]
    keys = []
    for batch in prepared.dataset.iter(batch_size=4096):
        for ids in zip(*(batch[column] for column in columns)):
            digest = hashlib.sha256(np.asarray([len(part) for part in ids] + [i for part in ids for i in part],
                                               dtype=np.int64).tobytes()).digest()
            keys.append(int.from_bytes(digest[:8], "little") / _HASH_SPAN)
    return np.asarray(keys, dtype=np.float64)


def select_pairs(prepared: PreparedPairs, positions: np.ndarray) -> PreparedPairs:
    """The pairs at ``positions`` (in dataset order).  The fingerprint stays the whole dataset's: it names the tokenized
    data the pair ids come from (a precomputed reference of --dataset serves both parts); which part trains is part
    of the plan's fingerprint (run/checkpoint.py)."""
    positions = np.asarray(positions, dtype=np.int64)
    return dataclasses.replace(prepared, dataset=prepared.dataset.select(positions),
                               chosen_lengths=prepared.chosen_lengths[positions],
                               rejected_lengths=prepared.rejected_lengths[positions],
                               prompt_lengths=prepared.prompt_lengths[positions])


def split_by_content(prepared: PreparedPairs, fraction: float) -> tuple[PreparedPairs, PreparedPairs]:
    """(training pairs, held-out pairs) of ``--eval-fraction fraction``; both parts must hold a pair."""
    held = content_positions(prepared) < fraction
    count, total = int(held.sum()), held.size
    if count == 0 or count == total:
        part = "no pair" if count == 0 else "every pair"
        raise InputError(f"--eval-fraction {fraction}: holds out {part} of the {total} pairs of "
                         f"{prepared.summary['dataset']}; {'raise' if count == 0 else 'lower'} it")
    return select_pairs(prepared, np.flatnonzero(~held)), select_pairs(prepared, np.flatnonzero(held))


def first_pairs(prepared: PreparedPairs, limit: int | None) -> PreparedPairs:
    """--eval-max-pairs: the first ``limit`` pairs in dataset order (all when None or when there are fewer)."""
    if limit is None or limit >= len(prepared.chosen_lengths):
        return prepared
    return select_pairs(prepared, np.arange(limit))
