"""The prompt groups of tokenized pairs read from their Arrow table in blocks: numpy keys, never Python lists of rows.

Numbering prompts and responses by their token ids held as Python tuples costs ~10 KB of host memory per pair (a
million pairs: ~10 GB, in every rank and the front process).  Here each token sequence becomes a 128-bit key, two
hashes ``length * w[L] + sum_i ids[i] * w[i] mod 2**64`` with random odd weights per position (two different
sequences share a hash with probability <= 2**-44, both with <= 2**-88: token ids and lengths differ by less than
2**20), computed from the memory-mapped table a block of rows at a time; the first-appearance numbering of groups
and responses is then done on the keys (the package's only numbering of them).  The groups of a tokenized cache file
are saved beside it (``prepare`` writes them, 24 bytes a pair) and memory-mapped by every later process, so a warm run
neither reads a token id nor sorts keys to plan: the sort's transient arrays (~160 MB at a million pairs) were paid by
every rank.  A selection of the pairs (drops, a held-out split) renumbers the saved ids (:func:`selected_groups`).
``tests/test_grouping.py`` checks the keys give the groups its tuple oracle gives, whole and selected.
"""

from __future__ import annotations

from pathlib import Path

import datasets
import numpy as np
import pyarrow.compute as pc

from ..files import atomic_write
from .prompt_groups import PairGroups

BLOCK_ROWS = 4096  # ~100 tokens a row: a few MB of numpy per block
_SEED = 20261207


def _weights(length: int) -> np.ndarray:
    """[2, length + 1] uint64 odd weights, the same in every process (a fixed seed): one per position, the last for
    the length."""
    return np.random.default_rng(_SEED).integers(0, 2**63, size=(length + 1, 2), dtype=np.uint64).T * 2 + 1


def _sequence_keys(column, weights: np.ndarray) -> np.ndarray:
    """[rows, 2] uint64: each row's two hashes of an Arrow list column, its length among the terms (so that a
    sequence and the same one followed by id 0 differ)."""
    lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False).astype(np.int64)
    flat = pc.list_flatten(column).to_numpy(zero_copy_only=False).astype(np.uint64)
    ends = np.cumsum(lengths)
    position = np.arange(flat.size) - np.repeat(ends - lengths, lengths)
    keys = np.empty((lengths.size, 2), dtype=np.uint64)
    for k in range(2):
        sums = np.concatenate([np.zeros(1, np.uint64), np.cumsum(flat * weights[k][position], dtype=np.uint64)])
        keys[:, k] = sums[ends] - sums[ends - lengths] + lengths.astype(np.uint64) * weights[k][-1]  # mod 2**64
    return keys


def _first_appearance_ids(keys: np.ndarray) -> np.ndarray:
    """int64 [rows]: equal rows of ``keys`` share an id; ids number the distinct rows in order of first appearance.
    (A stable lexsort and the runs of equal rows: ``np.unique(axis=0)`` holds several copies of the keys.)"""
    order = np.lexsort(keys.T[::-1])  # stable: a run of equal rows lists them in appearance order
    ordered = keys[order]
    starts = np.flatnonzero(np.concatenate([[True], (ordered[1:] != ordered[:-1]).any(axis=1)]))
    del ordered
    run = np.repeat(np.arange(starts.size), np.diff(np.append(starts, keys.shape[0])))
    rank = np.empty(starts.size, dtype=np.int64)
    rank[np.argsort(order[starts], kind="stable")] = np.arange(starts.size)  # order[starts]: each run's first row
    ids = np.empty(keys.shape[0], dtype=np.int64)
    ids[order] = rank[run]
    return ids


COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")


def content_keys(dataset: datasets.Dataset, longest: int) -> np.ndarray:
    """uint64 [pairs, 3, 2]: the keys of each pair's prompt, chosen and rejected ids; ``longest`` bounds every
    sequence's length."""
    weights = _weights(max(1, longest))
    parts = []
    for block in dataset.select_columns(list(COLUMNS)).with_format("arrow").iter(batch_size=BLOCK_ROWS):
        parts.append(np.stack([_sequence_keys(block.column(name), weights) for name in COLUMNS], axis=1))
    return np.concatenate(parts)


def cached_pair_groups(dataset: datasets.Dataset, longest: int, path: Path) -> PairGroups:
    """The groups of a tokenized cache file (:func:`groups_of_keys`), saved beside it by the first process that needs
    them as one int64 [pairs, 3] array and memory-mapped by the others (pages shared by the ranks of a node)."""
    if not path.is_file():
        groups = groups_of_keys(content_keys(dataset, longest))
        table = np.stack([groups.group, groups.chosen, groups.rejected], axis=1)

        def write(tmp):
            with open(tmp, "wb") as handle:  # a handle: np.save would add ".npy" to the temporary name
                np.save(handle, table)

        atomic_write(path, write)
    table = np.load(path, mmap_mode="r")
    return PairGroups(table[:, 0], table[:, 1], table[:, 2])


def _first_appearance_labels(labels: np.ndarray) -> np.ndarray:
    """int64 labels renumbered 0, 1, ... in order of first appearance."""
    _, first, inverse = np.unique(labels, return_index=True, return_inverse=True)
    rank = np.empty(first.size, dtype=np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(first.size)
    return rank[inverse.reshape(-1)]


def selected_groups(groups: PairGroups, positions: np.ndarray) -> PairGroups:
    """The groups of the pairs at ``positions`` (in that order), numbered as :func:`groups_of_keys` numbers them for
    those pairs alone: equal ids stay equal (the same prompt, the same response), renumbered by first appearance."""
    group = _first_appearance_labels(np.asarray(groups.group)[positions])
    responses = np.empty(2 * group.size, dtype=np.int64)  # chosen, rejected, next pair: the order responses number in
    responses[0::2], responses[1::2] = np.asarray(groups.chosen)[positions], np.asarray(groups.rejected)[positions]
    ids = _first_appearance_labels(responses)
    return PairGroups(group, ids[0::2].copy(), ids[1::2].copy())


def groups_of_keys(keys: np.ndarray) -> PairGroups:
    """The pairs' groups from their :func:`content_keys`: groups and responses numbered by first appearance."""
    group = _first_appearance_ids(np.asarray(keys[:, 0]))
    # a response is (its group, its tokens), numbered in the order they appear: chosen, rejected, next pair
    responses = np.empty((2 * group.size, 3), dtype=np.uint64)
    responses[0::2, 0] = responses[1::2, 0] = group
    responses[0::2, 1:], responses[1::2, 1:] = keys[:, 1], keys[:, 2]
    ids = _first_appearance_ids(responses)
    return PairGroups(group, ids[0::2].copy(), ids[1::2].copy())
