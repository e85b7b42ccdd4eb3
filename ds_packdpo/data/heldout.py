"""The held-out pairs of a run: a split of --dataset by pair content, or a separate --eval-dataset.

``--eval-fraction F`` holds out a pair when a hash of its tokens (prompt, chosen and
rejected ids) falls in the lowest F of the hash range.  A pair's side therefore depends
on nothing but its own content: not on the seed, the layout, the order of the rows or the
other pairs of the file, so adding rows never moves a held-out pair into training, and an
exact duplicate of a held-out pair is held out with it (never trained on under another
row).  The pairs made from one row of several responses are placed by their prompt's ids
alone, so a group is held out whole: none of its responses trains in another pair.  The
count is F x pairs up to sampling noise; the plan summary says how many.  Truncation can
make the prompts of distinct rows identical (a prompt keeps its end, often the same chat
template tail), merging their groups into one that falls on one side whole: the split then
holds out far more or fewer pairs than asked, which one ``warning:`` line says.
No torch.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass

import numpy as np
import pyarrow.compute as pc

from ..console import say_warning
from ..errors import InputError
from .pair_keys import selected_groups
from .prepare import DataConfig, PreparedPairs

_HASH_SPAN = float(2 ** 64)  # the first 8 bytes of a SHA-256, as an unsigned integer
BLOCK_ROWS = 4096  # pairs hashed from one Arrow block


@dataclass(frozen=True)
class EvalSpec:
    """The held-out evaluation of a run: which pairs (a fraction of --dataset by content, or --eval-dataset), how many
    of them, and how often it runs (run/evaluation.py)."""

    fraction: float | None  # --eval-fraction
    dataset: DataConfig | None  # --eval-dataset, tokenized like --dataset (its first max_pairs pairs)
    max_pairs: int | None  # --eval-max-pairs
    steps: int | None  # --eval-steps: every N optimizer steps (always after the last one too)

    def __post_init__(self):
        if self.fraction is not None and self.dataset is not None:
            raise InputError("--eval-dataset and --eval-fraction are exclusive: evaluate on another dataset or on "
                             "a held-out part of --dataset")
        if not self.held_out:
            for name, value in (("eval-steps", self.steps), ("eval-max-pairs", self.max_pairs)):
                if value is not None:
                    raise InputError(f"--{name} needs a held-out set: --eval-dataset or --eval-fraction")

    @property
    def held_out(self) -> bool:
        """Whether the run holds pairs out of training to evaluate on."""
        return self.fraction is not None or self.dataset is not None

    def due(self, global_step: int, last: bool) -> bool:
        """Evaluate after this step: every --eval-steps, and after the last step of the run."""
        return last or bool(self.steps) and global_step % self.steps == 0


def _pair_bytes(block, columns: list[str]) -> tuple[bytes, np.ndarray]:
    """Each pair of an Arrow block as int64 ``[len(column) for column in columns] + ids of each column in turn``, all
    pairs in one buffer, and the pairs' [start, end) byte offsets in it; numpy over the block, no Python list of ids."""
    lengths = [pc.list_value_length(block.column(name)).to_numpy(zero_copy_only=False).astype(np.int64)
               for name in columns]
    sizes = len(columns) + sum(lengths)
    ends = np.cumsum(sizes)
    starts = ends - sizes
    buffer = np.empty(int(ends[-1]) if ends.size else 0, dtype=np.int64)
    place = starts + len(columns)  # where the next column's ids of each pair go
    for j, name in enumerate(columns):
        buffer[starts + j] = lengths[j]
        ids = pc.list_flatten(block.column(name)).to_numpy(zero_copy_only=False).astype(np.int64)
        before = np.cumsum(lengths[j]) - lengths[j]  # ids of the block's earlier pairs in this column
        buffer[np.repeat(place - before, lengths[j]) + np.arange(ids.size)] = ids
        place = place + lengths[j]
    return buffer.tobytes(), np.stack([starts, ends], axis=1) * 8


def content_positions(prepared: PreparedPairs) -> np.ndarray:
    """Each pair's place in [0, 1): the first 8 bytes of a SHA-256 of its prompt, chosen and rejected token ids with
    their lengths (of its prompt's alone for pairs made from groups of responses), uniform and deterministic."""
    grouped = "multi_response" in prepared.summary
    columns = ["prompt_ids"] if grouped else ["prompt_ids", "chosen_ids", "rejected_ids"]
    positions = np.empty(len(prepared.chosen_lengths), dtype=np.float64)
    done = 0
    for block in prepared.dataset.select_columns(columns).with_format("arrow").iter(batch_size=BLOCK_ROWS):
        data, spans = _pair_bytes(block, columns)
        view = memoryview(data)
        for start, end in spans.tolist():
            positions[done] = int.from_bytes(hashlib.sha256(view[start:end]).digest()[:8], "little") / _HASH_SPAN
            done += 1
    return positions


def select_pairs(prepared: PreparedPairs, positions: np.ndarray) -> PreparedPairs:
    """The pairs at ``positions`` (in dataset order).  The fingerprint stays the whole dataset's: it names the tokenized
    data the pair ids come from (a precomputed reference of --dataset serves both parts); which part trains is part
    of the plan's fingerprint (run/checkpoint.py)."""
    positions = np.asarray(positions, dtype=np.int64)
    return dataclasses.replace(prepared, dataset=prepared.dataset.select(positions),
                               chosen_lengths=prepared.chosen_lengths[positions],
                               rejected_lengths=prepared.rejected_lengths[positions],
                               prompt_lengths=prepared.prompt_lengths[positions],
                               groups=selected_groups(prepared.groups, positions), pair_ids=prepared.pair_ids[positions])


def split_by_content(prepared: PreparedPairs, fraction: float) -> tuple[PreparedPairs, PreparedPairs]:
    """(training pairs, held-out pairs) of ``--eval-fraction fraction``; both parts must hold a pair."""
    positions = content_positions(prepared)
    held = positions < fraction
    count, total = int(held.sum()), held.size
    if count == 0 or count == total:
        part = "no pair" if count == 0 else "every pair"
        raise InputError(f"--eval-fraction {fraction}: holds out {part} of the {total} pairs of "
                         f"{prepared.summary['dataset']}; {'raise' if count == 0 else 'lower'} it")
    warning = split_warning(prepared.summary, fraction, count, positions)
    if warning:
        say_warning(warning)
    return select_pairs(prepared, np.flatnonzero(~held)), select_pairs(prepared, np.flatnonzero(held))


# A held-out share this far from the asked one (relative to the smaller side), and beyond 3 standard deviations of
# a split of the rows' own groups, is truncation's doing (or duplicates'), not sampling noise.
FAR_FROM_ASKED = 0.5
NOISE_SIGMAS = 3.0


def pairs_per_row(groups: dict | None) -> int:
    """The most pairs one row makes (1 for a row of one pair): the largest group the split would place whole."""
    if not groups:
        return 1
    responses = groups["responses_per_group"]["max"]
    return {"best-vs-worst": 1, "best-vs-rest": responses - 1}.get(groups["pairs_from"],
                                                                    responses * (responses - 1) // 2)


def split_warning(summary: dict, fraction: float, held: int, positions: np.ndarray) -> str | None:
    """The line that says a split far from ``fraction`` (``held`` pairs of ``positions``, each pair's place), or
    prompts of several rows merged by truncation, and why; None when neither.  A grouped pair's place is its prompt's,
    so the distinct places are the distinct prompts after truncation."""
    total = positions.size
    actual = held / total
    groups = summary.get("multi_response")
    most = pairs_per_row(groups)
    # the split's spread if each row's pairs stayed one unit: sum of squared unit sizes <= pairs x the largest unit
    spread = np.sqrt(fraction * (1 - fraction) * total * most)
    far = (abs(actual - fraction) > FAR_FROM_ASKED * min(fraction, 1 - fraction)
           and abs(held - fraction * total) > NOISE_SIGMAS * spread)
    truncated = summary.get("prompt_truncated", 0)
    prompts, sizes = np.unique(positions, return_counts=True)
    rows = groups["groups"] - groups["groups_without_pairs"] if groups else None
    merged = bool(groups) and truncated > 0 and (prompts.size < rows or int(sizes.max()) > most)
    if not (far or merged):
        return None
    text = (f"--eval-fraction {fraction:g} held out {held} of {total} pairs ({actual:.0%}, {fraction:.0%} asked) of "
            f"{summary['dataset']}")
    if groups:
        text += (f": it holds out each prompt's pairs together, and after truncation ({truncated} of {total} prompts "
                 f"cut) the prompts of the {rows} rows with pairs are {prompts.size} distinct prompts, the largest "
                 f"shared by {int(sizes.max())} pairs (one row makes at most {most})")
    else:
        text += f": it holds out identical pairs together ({prompts.size} distinct pairs)"
    if truncated:
        text += "; a longer --max-length (and --max-prompt-length, if set) keeps more of each prompt, and them apart"
    return text


def first_pairs(prepared: PreparedPairs, limit: int | None) -> PreparedPairs:
    """--eval-max-pairs: the first ``limit`` pairs in dataset order (all when None or when there are fewer)."""
    if limit is None or limit >= len(prepared.chosen_lengths):
        return prepared
    return select_pairs(prepared, np.arange(limit))
