"""Prompt groups for the planner: which pairs share a prompt (same token ids) and which responses they share.

A group is the unit the plan shuffles into steps (``data/plan.py``): its pairs land in one step.  Within the step
its responses are the unit laid out on ranks and rows (``data/response_spread.py``): each computed once, its prompt
once per row that holds one of them (``model/collate.py``'s ``collate_groups``).  numpy only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PairGroups:
    """Per pair: its prompt group and the ids of its chosen and rejected responses (equal ids = the same tokens
    after the same prompt).  Group and response ids number first appearances in pair order."""

    group: np.ndarray     # int64 [N]
    chosen: np.ndarray    # int64 [N]
    rejected: np.ndarray  # int64 [N]

    @property
    def count(self) -> int:
        return int(self.group.max()) + 1 if self.group.size else 0


def group_permutation(groups: PairGroups, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(pair order, group boundary after each pair): the groups in a seeded order, each group's pairs together in
    pair order.  With every group a single pair this is ``rng.permutation(N)`` (the ungrouped composition)."""
    count = groups.count
    order = rng.permutation(count)
    rank = np.empty(count, dtype=np.int64)
    rank[order] = np.arange(count)
    pairs = np.lexsort((np.arange(groups.group.size), rank[groups.group]))
    ends = np.append(groups.group[pairs][1:] != groups.group[pairs][:-1], True)
    return pairs, ends
