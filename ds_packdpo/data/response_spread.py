"""Prompt groups at cluster width: a step's responses spread over the ranks, each prompt copied where it is needed.

The DPO loss needs one number per response, its log-prob sum, so a prompt group need not stay on one rank: every
rank computes the prompt of each group it holds a response of (once per row), the sums are exchanged after the
forward (``run/response_exchange.py``) and every rank evaluates the loss of all the step's pairs.  The unit of the
layout is the response; the step's pairs do not change (they are whole groups, ``data/plan.py``).

:func:`step_responses` lists the step's distinct responses (a response in several pairs is computed once).
:func:`spread_step` lays them out in ``world x slots`` rows: a group's pairs stay in one slot (row index i on
every rank), so that the exchange after slot i's forward gives every sum its pairs need and each row is
backpropagated before the next one runs (no second forward, no row's activations kept past its slot).  Within a slot
the responses are dealt to the ``world`` rows to minimise the largest row (what the step's time follows under
ZeRO-3's lock-step), counting each prompt once per row that holds one of its responses:

1. a target L is searched between a lower bound (the mean row, the largest response with its prompt) and the row
   budget; for a target, groups are placed largest first, whole into the fullest row they fit (best fit), else
   split over the fullest rows that still take a response with its prompt copy, each row taking the largest of the
   group's responses that fit.  Filling the fullest rows first is what balances wide steps: lock-step utilization
   0.971 and 0.963 on the 10- and 12-answer sets at 64 ranks against 0.950 and 0.945 filling the emptiest first
   (0.979 either way on the demo at 8 ranks; docs/packing.md's pack-stats settings);
2. then the largest row gives a response to another row, or swaps one, while that lowers the largest of the two
   (demo: 0.979 against 0.974 without this step; 64 ranks: +0.001 and +0.002).

So a group is split over more rows only where no row takes it whole under the lowest target the search reaches
(the prompt copies counted in the loads it compares): balance and copies are weighed by the step's largest row,
what its time follows.  A group larger than three quarters of a slot (``world x budget``) is cut, in pair order,
into runs of whole pairs first (:func:`cut_units`); a response in two runs is then computed twice.  numpy; no torch.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass

import numpy as np

from .prompt_groups import PairGroups

_SEARCH_TOLERANCE = 0.002  # the target's search stops within 0.2 % of the best found
_MARGINS = (1.0, 1.03, 1.1, 1.3, 2.0, None)  # targets tried above the lower bound before bisecting (None: budget only)
_POLISH_ROUNDS_PER_ROW = 2  # local search: at most 2 x rows improving moves per slot (each lowers the largest row)


@dataclass(frozen=True)
class StepResponses:
    """The distinct responses of one step, each a sequence ``[prompt | response]`` to compute once.

    Response m is side ``side[m]`` (0 chosen, 1 rejected) of pair ``source[m]`` (a positional pair index); its
    prompt group in this step is ``unit[m]``.  ``pair_sides[k]`` are the responses of the step's k-th pair (the
    order of ``StepPlan.pairs``), chosen then rejected."""

    source: np.ndarray      # int64 [M]
    side: np.ndarray        # int64 [M]
    unit: np.ndarray        # int64 [M], 0 .. units - 1
    length: np.ndarray      # int64 [M] completion tokens
    prompt: np.ndarray      # int64 [M] prompt tokens of its unit
    pair_sides: np.ndarray  # int64 [N, 2]

    @property
    def count(self) -> int:
        return int(self.source.size)


def cut_units(step_pairs: np.ndarray, groups: PairGroups, chosen: np.ndarray, rejected: np.ndarray,
              prompt: np.ndarray, cap: float) -> np.ndarray:
    """The prompt group of each of the step's pairs in this step (``[N]``, numbered 0..): its data group, or where
    the group's tokens (the prompt once, each distinct response once) exceed ``cap``, a run of its pairs in pair
    order that stays within it (a pair alone always counts as fitting)."""
    group = groups.group[step_pairs]
    _, unit = np.unique(group, return_inverse=True)
    ids = np.stack([groups.chosen[step_pairs], groups.rejected[step_pairs]], 1)
    lengths = np.stack([chosen[step_pairs], rejected[step_pairs]], 1) - prompt[step_pairs, None]
    _, first = np.unique(ids.reshape(-1), return_index=True)
    unit_tokens = np.bincount(unit.repeat(2)[first], weights=lengths.reshape(-1)[first],
                              minlength=unit.max() + 1)
    unit_tokens += np.bincount(unit, weights=prompt[step_pairs], minlength=unit.max() + 1) / np.bincount(unit)
    over = np.flatnonzero(unit_tokens > cap)
    if not over.size:
        return unit
    unit = unit.copy()
    next_unit = int(unit.max()) + 1
    for u in over.tolist():
        members = np.flatnonzero(unit == u)
        members = members[np.argsort(step_pairs[members], kind="stable")]
        p, seen, tokens, current = int(prompt[step_pairs[members[0]]]), set(), 0, u
        for k in members.tolist():
            new = {int(ids[k, s]): int(lengths[k, s]) for s in (0, 1) if int(ids[k, s]) not in seen}
            added = sum(new.values())
            if seen and p + tokens + added > cap:
                current, seen, tokens, next_unit = next_unit, set(), 0, next_unit + 1
                new = {int(ids[k, s]): int(lengths[k, s]) for s in (0, 1)}
                added = sum(new.values())
            unit[k] = current
            seen.update(new)
            tokens += added
    return np.unique(unit, return_inverse=True)[1]


def step_responses(step_pairs: np.ndarray, groups: PairGroups, chosen: np.ndarray, rejected: np.ndarray,
                   prompt: np.ndarray, cap: float) -> StepResponses:
    """The step's distinct responses (per prompt group of the step, :func:`cut_units`) and each pair's two."""
    unit = cut_units(step_pairs, groups, chosen, rejected, prompt, cap)
    ids = np.stack([groups.chosen[step_pairs], groups.rejected[step_pairs]], 1)
    key = unit[:, None] * (int(ids.max()) + 1) + ids  # a response of a cut group is one per run of pairs
    _, first, inverse = np.unique(key.reshape(-1), return_index=True, return_inverse=True)
    pair_of, side = np.divmod(first, 2)
    lengths = np.stack([chosen[step_pairs], rejected[step_pairs]], 1) - prompt[step_pairs, None]
    return StepResponses(source=step_pairs[pair_of], side=side, unit=unit[pair_of],
                         length=lengths.reshape(-1)[first], prompt=prompt[step_pairs][pair_of],
                         pair_sides=inverse.reshape(-1, 2))


@dataclass
class _Slot:
    """One slot's responses as the search sees them: per response its unit, cost and tokens; per unit its prompt's
    cost and tokens and its responses by cost descending."""

    unit: np.ndarray          # [m] local unit 0..u-1
    cost: np.ndarray          # [m] float
    tokens: np.ndarray        # [m] int
    prompt_cost: np.ndarray   # [u] float
    prompt_tokens: np.ndarray  # [u] int
    members: list[np.ndarray]  # per unit, its responses by cost descending
    weighted: bool = False  # cost is not the token count (--attention-weight): the budget is a second limit

    def __post_init__(self):
        # Python copies for _fill's loops: per unit (responses, their costs, their tokens), sums and prompt
        self.member_lists = [(m.tolist(), self.cost[m].tolist(), self.tokens[m].tolist()) for m in self.members]
        self.unit_cost_list = [sum(costs) for _, costs, _ in self.member_lists]
        self.unit_tokens_list = [sum(tokens) for _, _, tokens in self.member_lists]
        self.prompt_cost_list = self.prompt_cost.tolist()
        self.prompt_tokens_list = self.prompt_tokens.tolist()

    @classmethod
    def of(cls, responses: StepResponses, index: np.ndarray, attention_weight: float) -> _Slot:
        _, unit = np.unique(responses.unit[index], return_inverse=True)
        length, prompt = responses.length[index], responses.prompt[index]
        cost = length + attention_weight * (length * (prompt + length)).astype(np.float64)
        units = int(unit.max()) + 1
        prompt_tokens = np.zeros(units, dtype=np.int64)
        prompt_tokens[unit] = prompt
        order = np.lexsort((-cost, unit))
        members = np.split(order, np.cumsum(np.bincount(unit, minlength=units))[:-1])
        return cls(unit, cost.astype(np.float64), length, prompt_tokens + attention_weight * prompt_tokens ** 2.0,
                   prompt_tokens, members, weighted=attention_weight > 0)

    def loads(self, row: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray]:
        """(cost, tokens) of each row: its responses and each of its units' prompt once."""
        held = np.unique(self.unit * rows + row)
        unit, at = np.divmod(held, rows)
        cost = (np.bincount(row, weights=self.cost, minlength=rows)
                + np.bincount(at, weights=self.prompt_cost[unit], minlength=rows))
        tokens = (np.bincount(row, weights=self.tokens, minlength=rows)
                  + np.bincount(at, weights=self.prompt_tokens[unit], minlength=rows))
        return cost, tokens.astype(np.int64)


def _fill(slot: _Slot, rows: int, target: float, budget: int, order: list[int]) -> np.ndarray | None:
    """Row of each response with every row's cost <= ``target`` and tokens <= ``budget``, or None where this greedy
    cannot: units in ``order``, whole into the fullest row that takes them, else their responses (largest first)
    over the fullest rows that take one with its prompt.  The rows are a list kept sorted by room, searched with
    bisect: at 1,024 ranks a try places ~200 units, and numpy calls over every row per unit were most of a step's
    planning time (CPU 18 ms a step, against ~7 ms with the sorted list)."""
    weighted = slot.weighted  # else cost is tokens: one limit
    limit = float(target) if weighted else min(float(target), budget)
    free = [(limit, at) for at in range(rows)]  # (room, row) ascending
    space = [budget] * rows
    row = [0] * slot.unit.size
    for u in order:
        members, costs, tokens = slot.member_lists[u]
        p_cost, p_tokens = slot.prompt_cost_list[u], slot.prompt_tokens_list[u]
        need_cost, need_tokens = p_cost + slot.unit_cost_list[u], p_tokens + slot.unit_tokens_list[u]
        whole = None
        for index in range(bisect_left(free, (need_cost, -1)), len(free)):
            if not weighted or space[free[index][1]] >= need_tokens:
                whole = index
                break
        if whole is not None:
            room, at = free.pop(whole)
            insort(free, (room - need_cost, at))
            space[at] -= need_tokens
            for i in members:
                row[i] = at
            continue
        left = list(range(len(members)))  # positions in the unit's lists, by cost descending
        taken_rows = []
        for index in range(bisect_left(free, (p_cost + costs[-1], -1)), len(free)):
            room, at = free[index]
            free_cost, free_tokens = room - p_cost, space[at] - p_tokens
            rest = []
            for k in left:
                if costs[k] <= free_cost and (not weighted or tokens[k] <= free_tokens):
                    free_cost -= costs[k]
                    free_tokens -= tokens[k]
                    row[members[k]] = at
                else:
                    rest.append(k)
            if len(rest) < len(left):
                taken_rows.append((index, free_cost, at))
                space[at] = free_tokens
                left = rest
            if not left:
                break
        if left:
            return None
        for index, _, _ in reversed(taken_rows):  # rooms only shrank: re-sort the rows this unit took
            del free[index]
        for _, room, at in taken_rows:
            insort(free, (room, at))
    return np.asarray(row, dtype=np.int64)


def _polish(slot: _Slot, row: np.ndarray, rows: int, budget: int) -> np.ndarray:
    """Local search on the largest row: the move of one of its responses, or the swap of one with a response of
    another row, that most lowers the larger of the two rows (prompt copies counted, the token budget kept)."""
    unit, cost, tokens = slot.unit, slot.cost, slot.tokens
    count = np.zeros((slot.prompt_cost.size, rows), dtype=np.int64)
    np.add.at(count, (unit, row), 1)
    load, used = slot.loads(row, rows)
    pc, pt = slot.prompt_cost, slot.prompt_tokens
    for _ in range(_POLISH_ROUNDS_PER_ROW * rows):
        a = int(np.argmax(load))
        top, best, move = load[a], load[a] - 1e-9 * max(load[a], 1.0), None
        others = np.flatnonzero(row != a)
        for i in np.flatnonzero(row == a).tolist():
            u = unit[i]
            last = count[u, a] == 1
            left_cost, left_tokens = top - cost[i] - last * pc[u], used[a] - tokens[i] - last * pt[u]
            new = count[u] == 0  # rows that would copy the prompt
            to_cost, to_tokens = load + cost[i] + new * pc[u], used + tokens[i] + new * pt[u]
            worst = np.where(to_tokens <= budget, np.maximum(to_cost, left_cost), np.inf)
            worst[a] = np.inf
            b = int(np.argmin(worst))
            if worst[b] < best:
                best, move = worst[b], (i, b, None)
            if not others.size:
                continue
            j, b_rows, v = others, row[others], unit[others]
            same = v == u
            a_cost = left_cost + cost[j] + ((count[v, a] - same) == 0) * pc[v]
            a_tokens = left_tokens + tokens[j] + ((count[v, a] - same) == 0) * pt[v]
            gone = count[v, b_rows] == 1
            b_cost = load[b_rows] - cost[j] - gone * pc[v] + cost[i] + ((count[u, b_rows] - same) == 0) * pc[u]
            b_tokens = used[b_rows] - tokens[j] - gone * pt[v] + tokens[i] + ((count[u, b_rows] - same) == 0) * pt[u]
            worst = np.where((a_tokens <= budget) & (b_tokens <= budget), np.maximum(a_cost, b_cost), np.inf)
            k = int(np.argmin(worst))
            if worst[k] < best:
                best, move = worst[k], (i, int(b_rows[k]), int(j[k]))
        if move is None:
            break
        i, b, j = move
        for item, to in ((i, b), (j, a)) if j is not None else ((i, b),):
            u, at = unit[item], row[item]
            count[u, at] -= 1
            count[u, to] += 1
            row[item] = to
            for holder, sign in ((at, -1), (to, 1)):
                copied = count[u, holder] == (0 if sign < 0 else 1)
                load[holder] += sign * (cost[item] + copied * pc[u])
                used[holder] += sign * (tokens[item] + copied * pt[u])
    return row


def spread_slot(slot: _Slot, rows: int, budget: int) -> np.ndarray | None:
    """Row (0 .. rows - 1) of each of a slot's responses, the largest row as low as the search finds; None when the
    slot's responses do not fit ``rows`` rows of ``budget`` tokens."""
    units = slot.prompt_cost.size
    unit_cost = slot.prompt_cost + np.bincount(slot.unit, weights=slot.cost, minlength=units)
    order = np.argsort(-unit_cost, kind="stable").tolist()
    single = slot.cost + slot.prompt_cost[slot.unit]
    bound = max(unit_cost.sum() / rows, float(single.max()))
    best, low = None, bound
    for margin in _MARGINS:  # a target just above the bound first: most steps end within a few per cent of it
        best = _fill(slot, rows, bound * margin if margin else np.inf, budget, order)
        if best is not None:
            break
        low = bound * margin if margin else low
    if best is None:
        return None
    high = float(slot.loads(best, rows)[0].max())
    while high - low > _SEARCH_TOLERANCE * high:
        target = (low + high) / 2
        found = _fill(slot, rows, target, budget, order)
        if found is None:
            low = target
        else:
            best, high = found, float(slot.loads(found, rows)[0].max())
    return _polish(slot, best, rows, budget)


def _deal(cost: np.ndarray, slots: int) -> np.ndarray:
    """Slot of each unit: largest first to the lightest slot (the slots' loads need not be equal: a step lasts the
    sum over slots of each slot's largest row, so only the rows within a slot must be balanced)."""
    slot = np.zeros(cost.size, dtype=np.int64)
    if slots == 1:
        return slot
    load = [0.0] * slots
    for u in np.argsort(-cost, kind="stable").tolist():
        s = load.index(min(load))
        slot[u] = s
        load[s] += cost[u]
    return slot


def spread_step(responses: StepResponses, world: int, budget: int, attention_weight: float = 0.0
                ) -> tuple[np.ndarray, int] | None:
    """(row of each response, numbered ``slot * world + place``; slots): the fewest slots whose rows hold the step's
    units within ``budget`` tokens, each unit in one slot, each slot spread by :func:`spread_slot`.  None when a
    unit alone cannot be spread over one slot (the caller cuts the units smaller)."""
    units = int(responses.unit.max()) + 1
    prompt = np.zeros(units)
    prompt[responses.unit] = responses.prompt
    unit_tokens = np.bincount(responses.unit, weights=responses.length, minlength=units) + prompt
    unit_cost = unit_tokens + attention_weight * (
        np.bincount(responses.unit, weights=responses.length * (responses.prompt + responses.length),
                    minlength=units) + prompt ** 2)
    slots = max(1, -(-int(unit_tokens.sum()) // (world * budget)))
    while slots <= units:
        slot_of_unit = _deal(unit_cost, slots)
        row = np.empty(responses.count, dtype=np.int64)
        for s in range(slots):
            members = np.flatnonzero(slot_of_unit[responses.unit] == s)
            placed = spread_slot(_Slot.of(responses, members, attention_weight), world, budget)
            if placed is None:
                break
            row[members] = s * world + placed
        else:
            return row, slots
        slots += 1
    return None


def row_sides(responses: StepResponses, members: np.ndarray) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """For a row's responses (``members``): the pair sides each one is (per member, the sides' positions ``2k + s``
    in the step's side vector: side s of the step's k-th pair), all those positions flat, and per position its
    pair's shorter completion (LD-DPO's length)."""
    flat = responses.pair_sides.reshape(-1)
    order = np.argsort(flat, kind="stable")
    counts = np.bincount(flat, minlength=responses.count)
    starts = np.cumsum(counts) - counts
    positions = [order[starts[m]:starts[m] + counts[m]] for m in np.asarray(members, dtype=np.int64).tolist()]
    shared = responses.length[responses.pair_sides].min(axis=1)
    every = np.concatenate(positions) if positions else np.zeros(0, dtype=np.int64)
    return positions, every, shared[every // 2]
