"""Rows of near-equal cost within a token budget, dealt to ranks so that each row slot is balanced: the numerical
core of the planner's layers 2-3 (``data/plan.py`` builds a step's rows with it).

Items are a step's pairs, each with tokens (what the budget limits) and a cost (tokens plus an optional attention
term: what a row's time follows).  :func:`slot_count_floor` bounds the slots from below, :func:`aligned_rows` puts
every item in one of ``world x slots`` rows (None when this greedy cannot keep every row within the budget: the
planner tries one slot more), :func:`deal_slots` gives each slot's rows to ranks.  Arrays in, arrays out: numpy only,
no plan types, so the algorithm can be changed and tested alone.
"""

from __future__ import annotations

import heapq

import numpy as np

POLISH_PASSES = 4  # measured on dpo_en_demo (W=8): lockstep 0.975 -> 0.982 at 4 passes, no gain beyond


def slot_count_floor(tokens: np.ndarray, world: int, budget: int) -> int:
    """No layout has fewer slots: the tokens must fit, and pairs over half the budget cannot share a row."""
    return max(1, -(-int(tokens.sum()) // (world * budget)), -(-int(np.count_nonzero(2 * tokens > budget)) // world))


def _fill_slot(order: np.ndarray, cost: np.ndarray, tokens: np.ndarray, world: int, budget: int,
                limit: int) -> tuple[np.ndarray, np.ndarray]:
    """One slot around the largest pending pairs: the ``world`` largest seed a row each, then smaller pairs top
    the rows up to the largest one's cost (each row, most room first, takes the largest pair that fits), at
    most ``limit`` of them.

    Used while a pair is at least the mean row of what is left: it sets this slot's time anyway, so the other
    rows of the slot are filled to it for free.  Returns (row of each pair or -1, pairs left over, by cost
    descending).  Every round matches all rows at once (a search in the pending costs); a pair wanted by two
    rows goes to the one with more room, the other tries again next round.
    """
    seeds, pending = order[:world], order[world:]
    level = cost[seeds[0]]
    load = np.zeros(world)
    room = np.full(world, budget, dtype=np.int64)
    load[:seeds.size] = cost[seeds]
    room[:seeds.size] -= tokens[seeds]
    row = np.full(cost.size, -1, dtype=np.int64)
    row[seeds] = np.arange(seeds.size)
    while limit > 0 and pending.size:
        rows = np.argsort(load, kind="stable")  # most room first
        ascending = pending[::-1]
        at = np.searchsorted(cost[ascending], level - load[rows], side="right") - 1
        rows, picks = rows[at >= 0], ascending[at[at >= 0]]
        fits = tokens[picks] <= room[rows]
        rows, picks = rows[fits], picks[fits]
        first = np.sort(np.unique(picks, return_index=True)[1])[:limit]
        if not first.size:
            break
        rows, picks = rows[first], picks[first]
        row[picks] = rows
        load[rows] += cost[picks]
        room[rows] -= tokens[picks]
        limit -= picks.size
        pending = pending[row[pending] < 0]
    return row, pending


def round_karmarkar_karp(order: np.ndarray, cost: np.ndarray, k: int) -> np.ndarray:
    """Partition the pairs (``order``: by cost descending) into k rows of near-equal cost.

    Returns the members as [places, k] (column j = row j, -1 = no pair).  Karmarkar-Karp's largest
    differencing, started from *rounds* instead of single pairs: round j is the j-th block of k pairs by
    size, already a sorted k-vector, so there are ~pairs/k partial partitions to merge instead of one per
    pair, and every merge is one numpy sort.  Written by hand: no library offers k-way KK.  With at least k
    pairs every row gets one from the first round, so no row is empty.
    """
    rounds = -(-order.size // k)
    members = np.full(rounds * k, -1, dtype=np.int64)
    members[:order.size] = order
    members = members.reshape(rounds, k)
    sums = np.where(members >= 0, cost[members], 0.0)
    heap = [(sums[j, -1] - sums[j, 0], j, sums[j], members[j:j + 1]) for j in range(rounds)]
    heapq.heapify(heap)
    created = rounds
    while len(heap) > 1:
        _, _, a_sums, a_members = heapq.heappop(heap)
        _, _, b_sums, b_members = heapq.heappop(heap)
        merged = a_sums + b_sums[::-1]
        by_sum = np.argsort(-merged, kind="stable")
        merged = merged[by_sum]
        heapq.heappush(heap, (merged[-1] - merged[0], created, merged,
                              np.vstack([a_members, b_members[:, ::-1]])[:, by_sum]))
        created += 1
    return heap[0][3]


def polish(members: np.ndarray, cost: np.ndarray, tokens: np.ndarray, budget: int) -> np.ndarray:
    """Pairwise exchange after KK on [places, rows] members: each heavy row and a light row partner swap the
    two pairs (or move the one) that bring their costs closest, all partners at once in one
    [places, places, rows/2] array; the partners alternate between mirror (heaviest with lightest) and
    shifted (i with i + rows/2) so that a pass finds new swaps.  A swap only narrows a partnership's gap, so
    the heaviest row never grows."""
    k = members.shape[1]
    half = k // 2
    cost0, tokens0 = np.append(cost, 0.0), np.append(tokens, 0)  # index -1: no pair
    # With tokens as the cost a swap that narrows a gap cannot break the budget; with an attention term it can.
    weighted = bool((cost != tokens).any())
    mirror, shifted = np.arange(k - 1, k - 1 - half, -1), np.arange(k - half, k)
    for sweep in range(POLISH_PASSES if half else 0):
        if (members[-1] >= 0).any():  # a free place in every row, so that a move is a swap with nothing
            members = np.vstack([members, np.full((1, k), -1, dtype=np.int64)])
        costs = cost0[members]
        by_sum = np.argsort(-costs.sum(axis=0), kind="stable")
        members, costs = members[:, by_sum], costs[:, by_sum]
        light = shifted if sweep % 2 else mirror  # light[i] > i: row i is the heavier partner
        heavy_costs, light_costs = costs[:, :half], costs[:, light]
        delta = heavy_costs[:, None, :] - light_costs[None, :, :]  # [given place, taken place, partnership]
        gap = heavy_costs.sum(axis=0) - light_costs.sum(axis=0)
        gain = (gap - np.abs(gap - 2 * delta)).reshape(-1, half)
        best = gain.argmax(axis=0)
        act = np.flatnonzero(gain[best, np.arange(half)] > 1e-9)
        at_heavy, at_light = np.divmod(best[act], members.shape[0])
        given, taken = members[at_heavy, act], members[at_light, light[act]]
        if weighted:  # the budget, on the chosen swaps only
            moved = tokens0[given] - tokens0[taken]
            keep = ((tokens0[members[:, act]].sum(axis=0) - moved <= budget)
                    & (tokens0[members[:, light[act]]].sum(axis=0) + moved <= budget))
            if not keep.any():
                break
            act, at_heavy, at_light, given, taken = act[keep], at_heavy[keep], at_light[keep], given[keep], taken[keep]
        members[at_heavy, act] = taken
        members[at_light, light[act]] = given
    return members


def aligned_rows(order: np.ndarray, tokens: np.ndarray, cost: np.ndarray, world: int, slots: int,
                 budget: int) -> np.ndarray | None:
    """Row (0 .. world*slots-1) of every pair (``order``: the pairs by cost descending), rows of near-equal
    cost; None when this greedy cannot keep every row within the budget with that many slots."""
    row = np.full(tokens.size, -1, dtype=np.int64)
    for slot in range(slots):
        rows_left = world * (slots - slot)
        if order.size and cost[order[0]] * rows_left >= cost[order].sum() and slot < slots - 1:
            # leave every later row at least one pair, so that a dummy row means a rank ran out of pairs
            limit = order.size - world - world * (slots - slot - 1)
            filled, order = _fill_slot(order, cost, tokens, world, budget, limit)
            placed = filled >= 0
            row[placed] = slot * world + filled[placed]
            continue
        members = polish(round_karmarkar_karp(order, cost, rows_left), cost, tokens, budget)
        place, column = np.nonzero(members >= 0)
        row[members[place, column]] = slot * world + column
        break
    row_tokens = np.bincount(row, weights=tokens, minlength=world * slots)
    return row if row_tokens.max() <= budget else None


def deal_slots(blocks: np.ndarray, row_cost: np.ndarray, world: int) -> np.ndarray:
    """Rank of each row: ``blocks[i]`` are the ``world`` rows of slot i (rank order: slot order), each slot's
    heaviest row to the rank with the least so far (rank balance)."""
    rank_of_row = np.empty(row_cost.size, dtype=np.int64)
    rank_load = np.zeros(world)
    for slot_rows in blocks:
        slot_rows = slot_rows[np.argsort(-row_cost[slot_rows], kind="stable")]
        ranks = np.argsort(rank_load, kind="stable")
        rank_of_row[slot_rows] = ranks
        rank_load[ranks] += row_cost[slot_rows]
    return rank_of_row
