"""Prompt groups for the planner: which pairs share a prompt (same token ids) and which responses they share.

A group is the unit the plan shuffles and places (``data/plan.py``): its pairs land in one step, and in one
row unless the group does not fit the row budget, when it is split, in pair order, into sub-groups of whole pairs,
each with its own prompt copy and never over the budget.  A sub-group takes ``P + sum of its distinct responses``
tokens in a grouped row (``model/collate.py``'s ``collate_groups``).  numpy only.
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


def pair_groups(prompt_ids, chosen_ids, rejected_ids) -> PairGroups:
    """The groups of pairs given as token-id sequences (columns of the tokenized dataset)."""
    groups: dict[tuple, int] = {}
    responses: dict[tuple, int] = {}
    group, chosen, rejected = [], [], []
    for prompt, good, bad in zip(prompt_ids, chosen_ids, rejected_ids):
        key = tuple(prompt)
        g = groups.setdefault(key, len(groups))
        group.append(g)
        chosen.append(responses.setdefault((g, tuple(good)), len(responses)))
        rejected.append(responses.setdefault((g, tuple(bad)), len(responses)))
    return PairGroups(*(np.asarray(values, dtype=np.int64) for values in (group, chosen, rejected)))


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


def group_units(step_pairs: np.ndarray, groups: PairGroups, chosen: np.ndarray, rejected: np.ndarray,
                prompt: np.ndarray, budget: int) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """The step's pairs cut into placement units: (members of each unit, tokens, attention term).

    A unit is a group's pairs, or, where they exceed ``budget``, a run of them in pair order that fits (a pair
    alone always fits: the plan checks it).  Tokens: the prompt once and every distinct response once; attention:
    (P + R1)^2 + sum over later responses of Rj (P + Rj), as the group kernel computes."""
    members, tokens, attention = [], [], []
    by_group = step_pairs[np.lexsort((step_pairs, groups.group[step_pairs]))]
    current: list[int] = []
    seen: dict[int, int] = {}

    def close():
        if current:
            p = int(prompt[current[0]])
            sizes = list(seen.values())
            members.append(np.asarray(current, dtype=np.int64))
            tokens.append(p + sum(sizes))
            attention.append((p + sizes[0]) ** 2 + sum(r * (p + r) for r in sizes[1:]))

    for pair in by_group.tolist():
        if current and groups.group[pair] != groups.group[current[0]]:
            close()
            current, seen = [], {}
        p = int(prompt[pair])
        new = {int(groups.chosen[pair]): int(chosen[pair]) - p, int(groups.rejected[pair]): int(rejected[pair]) - p}
        added = sum(size for response, size in new.items() if response not in seen)
        if current and p + sum(seen.values()) + added > budget:
            close()
            current, seen = [], {}
        current.append(pair)
        for response, size in new.items():
            seen.setdefault(response, size)
    close()
    return members, np.asarray(tokens, dtype=np.int64), np.asarray(attention, dtype=np.int64)
