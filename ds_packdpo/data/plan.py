"""The step planner: which pairs form each optimizer step, and which rank runs them in which row.

Three layers, each a pure function of the one before, so that the training
trajectory never depends on how the work is laid out (DESIGN.md, invariants 2-4):

1. *Composition* (:func:`step_compositions`): a seeded permutation of the pairs cut
   into steps, by pair count (``global_batch_pairs``) or by tokens
   (``tokens_per_step``).  It depends on seed, epoch and that setting only -- never on
   world size, row budget or packing on/off.
2. *Slots*: under ZeRO-3 the ranks run row *i* together (every layer all-gathers), so a
   step lasts the sum over row slots of the largest row in the slot, and every extra
   forward pays the gathers again.  The step takes the fewest slots R such that its pairs
   (atomic: chosen and rejected travel together) fit world x R rows within
   ``max_tokens_per_row``; every rank runs R forwards (equal counts: ZeRO-3 hangs otherwise).
3. *Rows*: the pairs are partitioned into those world x R rows of near-equal cost (tokens
   plus an optional attention term), the budget a hard limit: while one pair is at least
   the mean row of what is left, a slot is built around the largest pairs and its rows are
   topped up to the largest; the rest is Karmarkar-Karp differencing over all remaining
   rows, then pairwise exchanges (``data/row_balance.py``).  Rows are sorted by cost, slot i is the i-th block of
   ``world`` rows, and each slot's heaviest row goes to the rank with the least so far,
   so slot i holds near-equal rows on every rank and the ranks stay balanced.  On
   dpo_en_demo at world 8 this reaches 0.98 lock-step utilization (0.95 when ranks were
   balanced first and each rank packed its own rows).  An empty dummy row only appears
   when a step has fewer pairs than rows: then every row holds a single pair.

Rows are ordered heaviest first on every rank, so the peak memory is hit on the first
micro-step.

How a row holds its pairs is one value, :class:`RowLayout`, decided once for the run and
carried here (``PlanConfig.layout``) and to the collate functions (``model/collate.py``
looks its function up by it).  With prefix sharing (packed rows hold each pair as
``[prompt | chosen | rejected]``) a pair takes P + C + R tokens of its row and attention
term (P + C)^2 + R (P + R) (:func:`pair_tokens`, :func:`pair_attention_sq`); with prompt
groups a row holds each prompt group's prompt and responses once; the steps' pairs
(layer 1) are the same in every layout.  In the prompt-groups layout a step whose prompts
repeat takes layers 2-3 from ``data/response_spread.py``: its distinct responses are the
items, spread over the ranks within row slots, each prompt copied per row holding one of
them; the step's rows are then in the spread-responses layout (``StepPlan.responses``,
``StepPlan.row_layout``).

Planning a step looks at that step's pairs only, so resuming from (epoch, step) is
skipping.  numpy only: no torch, nothing distributed.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from ..console import say_warning
from ..errors import InputError
from .prompt_groups import PairGroups, group_permutation
from .response_spread import StepResponses, spread_step, step_responses
from .row_balance import aligned_rows, deal_slots, slot_count_floor


class RowLayout(enum.Enum):
    """How a row holds its pairs: one value per run, decided in phase one (the flags, and whether the attention
    backend can run it), carried by the plan and the run's settings; each has its collate function."""

    PADDED = "padded"  # right-padded micro-batches of --micro-batch-pairs pairs, dealt by count (the baseline)
    PACKED = "packed"  # pairs concatenated padding-free under the row budget, every sequence whole
    PREFIX_SHARED = "prefix-shared"  # packed, each pair [prompt | chosen | rejected]: its prompt once
    PROMPT_GROUPS = "prompt-groups"  # prefix-shared, the pairs of a row with one prompt as [prompt | r1 | ... | rk]
    # A step's layout, never a run's: the prompt-groups layout's steps whose prompts repeat, their responses the unit
    # spread over ranks (data/response_spread.py); a row holds responses, each prompt once per row holding one of them,
    # and a pair's sides may sit on different ranks (their sums exchanged, run/response_exchange.py).
    SPREAD_RESPONSES = "spread-responses"

    @classmethod
    def of(cls, packing: bool, prefix_sharing: bool, prompt_groups: bool) -> RowLayout:
        """The layout the three flags ask for (sharing needs packing, groups need sharing)."""
        if not packing:
            return cls.PADDED
        if not prefix_sharing:
            return cls.PACKED
        return cls.PROMPT_GROUPS if prompt_groups else cls.PREFIX_SHARED

    @property
    def packed(self) -> bool:
        return self is not RowLayout.PADDED

    @property
    def shares_prefixes(self) -> bool:
        """Each prompt once per pair or group (the lengths functions then need the prompt lengths)."""
        return self in (RowLayout.PREFIX_SHARED, RowLayout.PROMPT_GROUPS, RowLayout.SPREAD_RESPONSES)

    @property
    def groups_prompts(self) -> bool:
        return self in (RowLayout.PROMPT_GROUPS, RowLayout.SPREAD_RESPONSES)

    @property
    def spreads_responses(self) -> bool:
        """A row holds responses, not whole pairs (``Row.responses``, ``StepPlan.responses``)."""
        return self is RowLayout.SPREAD_RESPONSES


@dataclass(frozen=True)
class PlanConfig:
    max_tokens_per_row: int
    dp_size: int = 1  # data-parallel shares of every step (world size / sequence-parallel size)
    seed: int = 0
    global_batch_pairs: int | None = 64
    tokens_per_step: int | None = None
    drop_last: bool = False
    attention_weight: float = 0.0
    layout: RowLayout = RowLayout.PACKED
    micro_batch_pairs: int = 1  # padded mode only


class Row(NamedTuple):  # immutable like a frozen dataclass, built ~2x faster (a plan makes ~10^6 of them)
    pairs: tuple[int, ...]  # positional pair indices; () = dummy row.  Prompt groups: the pairs it holds a side of
    tokens: int  # real tokens the row holds: both sequences of every pair (each prompt once with prefix sharing;
    #              prompt groups: each of its prompts once and each of its responses once)
    computed_tokens: int  # packed: tokens; padded: 2 * len(pairs) * longest sequence; dummy: 1
    responses: tuple[int, ...] = ()  # prompt groups: the step's responses it computes (StepPlan.responses)


DUMMY_ROW = Row(pairs=(), tokens=0, computed_tokens=1, responses=())
SIDES = ("chosen", "rejected")
_new_row = tuple.__new__  # Row's own __new__ minus a Python call frame: the planner builds ~10^6 rows


@dataclass(frozen=True)
class StepPlan:
    epoch: int
    step: int  # index of the step within its epoch
    pairs: tuple[int, ...]  # every pair of the step, in composition order
    ranks: tuple[tuple[Row, ...], ...]  # ranks[r] = the rows rank r runs; same length for every r
    # Prompt groups (data/response_spread.py): the step's responses, which its rows compute and whose sums every
    # rank exchanges after each row slot; the prompt tokens computed beyond one copy per prompt group of the step.
    responses: StepResponses | None = field(default=None, compare=False)
    prompt_copy_tokens: int = 0

    @property
    def num_pairs(self) -> int:
        return len(self.pairs)

    @property
    def rows_per_rank(self) -> int:
        return len(self.ranks[0])

    @property
    def rank_tokens(self) -> tuple[int, ...]:
        return tuple(sum([row.tokens for row in rows]) for rows in self.ranks)

    @property
    def rank_computed_tokens(self) -> tuple[int, ...]:
        return tuple(sum([row.computed_tokens for row in rows]) for rows in self.ranks)

    def row_layout(self, run_layout: RowLayout) -> RowLayout:
        """The layout of this step's rows in a run of ``run_layout``: spread responses where the plan spread them."""
        return RowLayout.SPREAD_RESPONSES if self.responses is not None else run_layout

    def side_rows(self) -> np.ndarray:
        """[N, 2] the row (``rank * rows_per_rank + index``) computing each pair's chosen and rejected, pairs in
        ``self.pairs`` order; -1 where no row does.  A pair's two sides share a row, or with prompt groups a slot."""
        found = np.full((self.num_pairs, 2), -1, dtype=np.int64)
        flat = [row for rows in self.ranks for row in rows]
        if self.responses is not None:
            row_of_response = np.full(self.responses.count, -1, dtype=np.int64)
            for index, row in enumerate(flat):
                row_of_response[list(row.responses)] = index
            return row_of_response[self.responses.pair_sides]
        position = {pair: k for k, pair in enumerate(self.pairs)}
        for index, row in enumerate(flat):
            found[[position[pair] for pair in row.pairs]] = index
        return found


# ----------------------------------------------------------------------------- validation


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _check_config(cfg: PlanConfig) -> None:
    """Impossible settings, named by their command-line flag."""

    def at_least(value, minimum: int, name: str) -> None:
        if not _is_int(value) or value < minimum:
            raise InputError(f"{name} is {value!r}; it must be an integer >= {minimum}")

    if (cfg.global_batch_pairs is None) == (cfg.tokens_per_step is None):
        got = "both" if cfg.global_batch_pairs is not None else "neither"
        raise InputError(f"set exactly one of --global-batch-pairs and --tokens-per-step (got {got})")
    if cfg.global_batch_pairs is not None:
        at_least(cfg.global_batch_pairs, 1, "--global-batch-pairs")
    else:
        at_least(cfg.tokens_per_step, 1, "--tokens-per-step")
    at_least(cfg.dp_size, 1, "data-parallel size (number of rank shares)")
    at_least(cfg.seed, 0, "--seed")
    at_least(cfg.micro_batch_pairs, 1, "--micro-batch-pairs")
    if cfg.layout.packed:
        at_least(cfg.max_tokens_per_row, 2, "--max-tokens-per-row")
    if not (isinstance(cfg.attention_weight, (int, float)) and math.isfinite(cfg.attention_weight)
            and cfg.attention_weight >= 0):
        raise InputError(f"--attention-weight is {cfg.attention_weight!r}; it must be a finite number >= 0")


def _as_lengths(chosen_lengths, rejected_lengths) -> tuple[np.ndarray, np.ndarray]:
    chosen = np.asarray(chosen_lengths)
    rejected = np.asarray(rejected_lengths)
    if chosen.ndim != 1 or chosen.shape != rejected.shape:
        raise ValueError(f"chosen and rejected lengths must be 1-D of equal size, got {chosen.shape} and {rejected.shape}")
    if chosen.size and not (np.issubdtype(chosen.dtype, np.integer) and np.issubdtype(rejected.dtype, np.integer)):
        raise ValueError(f"lengths must be integers, got {chosen.dtype} and {rejected.dtype}")
    return chosen.astype(np.int64, copy=False), rejected.astype(np.int64, copy=False)


def pair_tokens(chosen, rejected, prompt, prefix_sharing: bool) -> np.ndarray:
    """Tokens each pair takes in a packed row: both sequences, or P + C + R with prefix sharing.

    ``chosen``/``rejected`` are the sequence lengths (prompt + completion), ``prompt`` the prompt lengths (needed with
    prefix sharing only).
    """
    chosen, rejected = np.asarray(chosen, dtype=np.int64), np.asarray(rejected, dtype=np.int64)
    if not prefix_sharing:
        return chosen + rejected
    return chosen + rejected - _prompts(prompt, chosen)


def pair_attention_sq(chosen, rejected, prompt, prefix_sharing: bool) -> np.ndarray:
    """Attention term of each pair in a packed row (query x key counts, causal halving not counted): C'^2 + R'^2 of
    its two sequences, or with prefix sharing (P + C)^2 + R (P + R): the rejected block's queries meet the prompt's
    keys and their own."""
    chosen, rejected = np.asarray(chosen, dtype=np.int64), np.asarray(rejected, dtype=np.int64)
    if not prefix_sharing:
        return chosen ** 2 + rejected ** 2
    return chosen ** 2 + (rejected - _prompts(prompt, chosen)) * rejected


def _prompts(prompt, like: np.ndarray) -> np.ndarray:
    if prompt is None:
        raise ValueError("prefix sharing needs the prompt lengths")
    prompt = np.asarray(prompt, dtype=np.int64)
    if prompt.shape != like.shape:
        raise ValueError(f"prompt lengths {prompt.shape} do not match the pairs {like.shape}")
    return prompt


def validate_lengths(chosen_lengths, rejected_lengths, cfg: PlanConfig, pair_ids: Sequence | None = None,
                     prompt_lengths=None) -> None:
    """Raise InputError for impossible settings or pairs that cannot be planned; cheap (vectorized).

    ``chosen_lengths[i]`` / ``rejected_lengths[i]`` are the token counts of prompt+chosen and
    prompt+rejected of pair i, ``prompt_lengths[i]`` its prompt's (needed with prefix sharing).
    ``pair_ids`` (optional) names pairs in messages instead of their positional index.
    """
    _check_config(cfg)
    chosen, rejected = _as_lengths(chosen_lengths, rejected_lengths)

    def name(i: int) -> str:
        return f"pair {pair_ids[i] if pair_ids is not None else i}"

    if chosen.size == 0:
        raise InputError("no preference pairs to plan (the dataset is empty after loading and filtering)")
    for lengths, what in ((chosen, "prompt+chosen"), (rejected, "prompt+rejected")):
        if lengths.min() < 1:
            i = int(np.argmin(lengths))
            raise InputError(f"{name(i)}: {what} has {int(lengths[i])} tokens; every sequence needs at least 1")
    sharing = cfg.layout.shares_prefixes
    tokens = pair_tokens(chosen, rejected, prompt_lengths, sharing)
    if cfg.layout.packed and tokens.max() > cfg.max_tokens_per_row:
        i = int(np.argmax(tokens))
        too_long = int(np.count_nonzero(tokens > cfg.max_tokens_per_row))
        others = {1: "", 2: "; 1 more pair exceeds it"}.get(too_long, f"; {too_long - 1} more pairs exceed it")
        parts = (f"prompt {int(chosen[i] + rejected[i] - tokens[i])} + chosen {int(tokens[i] - rejected[i])} + rejected "
                 f"{int(tokens[i] - chosen[i])}, the prompt shared" if sharing
                 else f"prompt+chosen {int(chosen[i])} + prompt+rejected {int(rejected[i])}")
        raise InputError(
            f"{name(i)} needs {int(tokens[i])} tokens ({parts}) but --max-tokens-per-row is "
            f"{cfg.max_tokens_per_row}{others}; raise --max-tokens-per-row to >= {int(tokens[i])} or lower "
            f"--max-length to <= {cfg.max_tokens_per_row // 2}, or split rows over ranks with --sequence-parallel-size"
        )
    pair_tokens_both = chosen + rejected  # what --tokens-per-step counts (the composition ignores the layout)
    if cfg.drop_last:
        if cfg.global_batch_pairs is not None and cfg.global_batch_pairs > chosen.size:
            raise InputError(f"--global-batch-pairs {cfg.global_batch_pairs} is more than the {chosen.size} pairs "
                             f"and --drop-last is set: no step would run")
        if cfg.tokens_per_step is not None and cfg.tokens_per_step > pair_tokens_both.sum():
            raise InputError(f"--tokens-per-step {cfg.tokens_per_step} is more than all {int(pair_tokens_both.sum())} "
                             f"tokens of the data and --drop-last is set: no step would run")


# ----------------------------------------------------------------------------- composition


def step_compositions(chosen_lengths, rejected_lengths, cfg: PlanConfig, epoch: int,
                      groups: PairGroups | None = None) -> list[np.ndarray]:
    """The pair indices of every step of ``epoch``; a function of seed, epoch and the global batch setting only
    (and of the data's prompt groups, never of the layout).  With ``groups`` the groups are shuffled and a step
    takes whole groups: it closes at the first group end that reaches the global batch, so its pair count
    varies with the group sizes."""
    if not _is_int(epoch) or epoch < 0:
        raise InputError(f"epoch is {epoch!r}; it must be an integer >= 0")
    chosen, rejected = _as_lengths(chosen_lengths, rejected_lengths)
    rng = np.random.default_rng([cfg.seed, epoch])
    if groups is not None and groups.count < chosen.size:
        order, ends = group_permutation(groups, rng)
        return _cut_at_group_ends(order, ends, chosen + rejected, cfg)
    order = rng.permutation(chosen.size)
    if cfg.global_batch_pairs is not None:
        size = cfg.global_batch_pairs
        full = chosen.size // size if cfg.drop_last else -(-chosen.size // size)
        return [order[i * size:(i + 1) * size] for i in range(full)]
    # tokens_per_step: a step closes at the first pair that brings its tokens to the target.
    reached = np.cumsum((chosen + rejected)[order])
    steps, start, done = [], 0, 0
    while start < order.size:
        end = int(np.searchsorted(reached, done + cfg.tokens_per_step, side="left")) + 1
        if end > order.size and cfg.drop_last:
            break
        steps.append(order[start:end])
        done = int(reached[min(end, order.size) - 1])
        start = end
    return steps


def _cut_at_group_ends(order: np.ndarray, ends: np.ndarray, pair_tokens_both: np.ndarray,
                       cfg: PlanConfig) -> list[np.ndarray]:
    """Steps of whole groups: each closes at the first group end where its pairs (or tokens) reach the target; with
    --drop-last a last step short of it is dropped."""
    if cfg.global_batch_pairs is not None:
        reached, target = np.arange(1, order.size + 1), cfg.global_batch_pairs
    else:
        reached, target = np.cumsum(pair_tokens_both[order]), cfg.tokens_per_step
    steps, start, done = [], 0, 0
    boundaries = np.flatnonzero(ends) + 1
    at_boundaries = reached[boundaries - 1]  # non-decreasing: binary searches, not a scan of every group per step
    while start < order.size:
        first = max(int(np.searchsorted(boundaries, start, side="right")),
                    int(np.searchsorted(at_boundaries, done + target, side="left")))
        if first == boundaries.size and cfg.drop_last:
            break
        end = int(boundaries[first]) if first < boundaries.size else order.size
        steps.append(order[start:end])
        done = int(reached[end - 1])
        start = end
    return steps


def warn_if_ranks_idle(num_pairs: int, cfg: PlanConfig) -> float | None:
    """Warns (once per job, on stderr) when a step has fewer pairs than data-parallel ranks: the ranks without a pair run a
    1-token dummy row in lock-step with the others, so at most pairs/ranks of the hardware does real work.
    Returns that fraction, or None when every rank gets a pair."""
    if cfg.global_batch_pairs is None:  # --tokens-per-step: pairs per step vary; pack-stats shows the balance
        return None
    pairs = min(cfg.global_batch_pairs, num_pairs)
    if pairs >= cfg.dp_size:
        return None
    share = pairs / cfg.dp_size
    say_warning(f"{pairs} pairs per step for {cfg.dp_size} data-parallel ranks: {cfg.dp_size - pairs} ranks get no "
                f"pair and run a dummy row, so at most {share:.0%} of the ranks' compute is real work (raise "
                f"--global-batch-pairs to at least {cfg.dp_size}, or use fewer ranks)")
    return share


def steps_per_epoch(chosen_lengths, rejected_lengths, cfg: PlanConfig, epoch: int = 0,
                    groups: PairGroups | None = None) -> int:
    """Number of optimizer steps of an epoch (with --tokens-per-step or prompt groups it can differ between
    epochs)."""
    if groups is not None and groups.count < len(chosen_lengths):
        return len(step_compositions(chosen_lengths, rejected_lengths, cfg, epoch, groups))
    if cfg.global_batch_pairs is not None:
        n = len(chosen_lengths)
        return n // cfg.global_batch_pairs if cfg.drop_last else -(-n // cfg.global_batch_pairs)
    return len(step_compositions(chosen_lengths, rejected_lengths, cfg, epoch))


def _packed_ranks(step_pairs: np.ndarray, chosen: np.ndarray, rejected: np.ndarray, prompt: np.ndarray | None,
                  cfg: PlanConfig) -> list[list[Row]]:
    """Fewest slots R such that the pairs fit world x R rows, rows of near-equal cost, R rows dealt to each rank so
    that slot i holds near-equal rows everywhere: rows sorted by cost, slot i = the i-th block of ``world``, its
    heaviest row to the rank with the least so far (rank balance)."""
    world, budget = cfg.dp_size, cfg.max_tokens_per_row
    c, r = chosen[step_pairs], rejected[step_pairs]
    p = None if prompt is None else prompt[step_pairs]
    tokens = pair_tokens(c, r, p, cfg.layout.shares_prefixes)
    cost = tokens + cfg.attention_weight * pair_attention_sq(c, r, p, cfg.layout.shares_prefixes).astype(np.float64)
    heaviest_first = np.argsort(-cost, kind="stable")
    slots = slot_count_floor(tokens, world, budget)
    while (row := aligned_rows(heaviest_first, tokens, cost, world, slots, budget)) is None:
        slots += 1  # ends: with world * slots >= pairs every pair has a row to itself
    count = world * slots
    row_cost = np.bincount(row, weights=cost, minlength=count)
    row_tokens = np.bincount(row, weights=tokens, minlength=count).astype(np.int64)
    rank_of_row = deal_slots(np.argsort(-row_cost, kind="stable").reshape(slots, world), row_cost, world)
    # pairs grouped by row (heaviest pair first); rows built rank by rank, each rank's by tokens descending
    by_row = heaviest_first[np.argsort(row[heaviest_first], kind="stable")]
    pair_ids = tuple(step_pairs[by_row].tolist())
    sizes = np.bincount(row, minlength=count)
    final = np.lexsort((-row_tokens, rank_of_row))
    built = [_new_row(Row, (pair_ids[end - size:end], t, t, ())) if size else DUMMY_ROW
             for end, size, t in zip(np.cumsum(sizes)[final].tolist(), sizes[final].tolist(), row_tokens[final].tolist())]
    return [built[i:i + slots] for i in range(0, count, slots)]


def _spreads_groups(step_pairs: np.ndarray, cfg: PlanConfig, groups: PairGroups | None) -> bool:
    """The step is laid out by response (data/response_spread.py): prompt groups are on and a prompt repeats in it
    (else its pairs' own plan, exactly the plan without groups)."""
    return (groups is not None and cfg.layout.groups_prompts
            and np.unique(groups.group[step_pairs]).size < step_pairs.size)


def _spread_ranks(step_pairs: np.ndarray, chosen: np.ndarray, rejected: np.ndarray, prompt: np.ndarray,
                  cfg: PlanConfig, groups: PairGroups) -> tuple[list[list[Row]], StepResponses, int]:
    """(rows of each rank, the step's responses, prompt tokens copied) with the responses of the step's prompt groups
    spread over world x R rows (:func:`spread_step`); slots heaviest first, dealt to ranks as :func:`_packed_ranks`
    does.  A group over 3/4 of a slot's tokens is cut into runs of whole pairs first; where a unit still cannot be
    spread alone, smaller (at one row's budget every unit fits a row whole)."""
    world, budget = cfg.dp_size, cfg.max_tokens_per_row
    cap = budget if world == 1 else max(budget, world * budget * 3 // 4)
    while (spread := spread_step(responses := step_responses(step_pairs, groups, chosen, rejected, prompt, cap),
                                 world, budget, cfg.attention_weight)) is None:
        cap = max(budget, cap // 2)
    row, slots = spread
    count, units = world * slots, int(responses.unit.max()) + 1
    unit_prompt = np.zeros(units, dtype=np.int64)
    unit_prompt[responses.unit] = responses.prompt
    held_unit, held_row = np.divmod(np.unique(responses.unit * count + row), count)  # each prompt copy
    row_tokens = (np.bincount(row, weights=responses.length, minlength=count)
                  + np.bincount(held_row, weights=unit_prompt[held_unit], minlength=count)).astype(np.int64)
    row_cost = row_tokens + cfg.attention_weight * (
        np.bincount(row, weights=responses.length * (responses.prompt + responses.length), minlength=count)
        + np.bincount(held_row, weights=unit_prompt[held_unit] ** 2.0, minlength=count))
    blocks = np.arange(count).reshape(slots, world)
    blocks = blocks[np.argsort(-row_cost[blocks].max(axis=1), kind="stable")]  # heaviest slot first: peak memory
    position = np.empty(count, dtype=np.int64)
    position[blocks] = np.arange(slots)[:, None]
    final = np.lexsort((position, deal_slots(blocks, row_cost, world)))
    by_row = np.lexsort((np.arange(responses.count), responses.unit, row))  # each row's responses unit by unit
    response_ids = by_row.tolist()
    sizes = np.bincount(row, minlength=count)
    ends = np.cumsum(sizes)
    sides = row[responses.pair_sides]  # [N, 2] the row of each pair's chosen and rejected
    touching = np.concatenate([np.arange(sides.shape[0]), np.flatnonzero(sides[:, 1] != sides[:, 0])])
    touched_row = np.concatenate([sides[:, 0], sides[touching[sides.shape[0]:], 1]])
    by_pair_row = np.lexsort((touching, touched_row))
    pair_ids = step_pairs[touching[by_pair_row]].tolist()
    pair_ends = np.cumsum(np.bincount(touched_row, minlength=count))
    pair_sizes = np.bincount(touched_row, minlength=count)
    built = [_new_row(Row, (tuple(pair_ids[pe - ps:pe]), t, t, tuple(response_ids[end - size:end]))) if size
             else DUMMY_ROW
             for end, size, pe, ps, t in zip(ends[final].tolist(), sizes[final].tolist(), pair_ends[final].tolist(),
                                             pair_sizes[final].tolist(), row_tokens[final].tolist())]
    group_of_pair = groups.group[step_pairs]
    _, first = np.unique(group_of_pair, return_index=True)
    copies = int(unit_prompt[held_unit].sum() - prompt[step_pairs[first]].sum())
    return [built[i:i + slots] for i in range(0, count, slots)], responses, copies


def _padded_ranks(step_pairs: np.ndarray, chosen: np.ndarray, rejected: np.ndarray, prompt: np.ndarray | None,
                  cfg: PlanConfig) -> list[list[Row]]:
    """The baseline layout of TRL/OpenRLHF: pairs dealt by count like a DistributedSampler, micro-batches in order."""
    ranks = []
    for rank in range(cfg.dp_size):
        mine = step_pairs[rank::cfg.dp_size]
        rows = []
        for start in range(0, mine.size, cfg.micro_batch_pairs):
            batch = mine[start:start + cfg.micro_batch_pairs]
            c, r = chosen[batch], rejected[batch]
            longest = int(max(c.max(), r.max()))
            rows.append(Row(tuple(batch.tolist()), int(c.sum() + r.sum()), 2 * batch.size * longest))
        ranks.append(rows)
    count = max(len(rows) for rows in ranks)
    return [rows + [DUMMY_ROW] * (count - len(rows)) for rows in ranks]


def _plan_step(step_pairs: np.ndarray, chosen: np.ndarray, rejected: np.ndarray, prompt: np.ndarray | None,
               cfg: PlanConfig, epoch: int, step: int, groups: PairGroups | None = None) -> StepPlan:
    responses, copies = None, 0
    if _spreads_groups(step_pairs, cfg, groups):
        ranks, responses, copies = _spread_ranks(step_pairs, chosen, rejected, prompt, cfg, groups)
    else:
        ranks = (_packed_ranks if cfg.layout.packed else _padded_ranks)(step_pairs, chosen, rejected, prompt, cfg)
    return StepPlan(epoch, step, tuple(step_pairs.tolist()), tuple(tuple(rows) for rows in ranks), responses, copies)


def _as_prompts(prompt_lengths, cfg: PlanConfig) -> np.ndarray | None:
    """The prompt lengths as an int array when the rows share prefixes (else unused: None)."""
    if not cfg.layout.shares_prefixes:
        return None
    if prompt_lengths is None:
        raise ValueError(f"the {cfg.layout.value} layout needs the prompt lengths")
    return np.asarray(prompt_lengths, dtype=np.int64)


def plan_step(pair_indices, chosen_lengths, rejected_lengths, cfg: PlanConfig, epoch: int, step: int,
              prompt_lengths=None, groups: PairGroups | None = None) -> StepPlan:
    """Lay out one step's pairs on ranks and rows.  Pass lengths as numpy int arrays (they are not copied)."""
    chosen, rejected = _as_lengths(chosen_lengths, rejected_lengths)
    prompt = _as_prompts(prompt_lengths, cfg)
    step_pairs = np.asarray(pair_indices, dtype=np.int64)
    if step_pairs.size == 0:
        raise ValueError("a step needs at least one pair")
    validate_lengths(chosen[step_pairs], rejected[step_pairs], cfg, pair_ids=step_pairs.tolist(),
                     prompt_lengths=None if prompt is None else prompt[step_pairs])
    return _plan_step(step_pairs, chosen, rejected, prompt, cfg, epoch, step, groups)


def iter_plan(chosen_lengths, rejected_lengths, cfg: PlanConfig, epochs: int, start_epoch: int = 0,
              start_step: int = 0, prompt_lengths=None, groups: PairGroups | None = None) -> Iterator[StepPlan]:
    """Every step of epochs ``start_epoch .. epochs-1``, beginning at ``start_step`` of ``start_epoch``.

    Validates everything before the first step is planned, so a bad setting fails at once.
    Resuming from (epoch, step) yields exactly the tail of the uninterrupted plan.  ``prompt_lengths``
    are needed when the rows share prefixes (``cfg.layout``); ``groups`` (the data's prompt groups) make
    the group the unit of the steps and, in the prompt-groups layout, of the rows.
    """
    prompt = _as_prompts(prompt_lengths, cfg)
    validate_lengths(chosen_lengths, rejected_lengths, cfg, prompt_lengths=prompt)
    chosen, rejected = _as_lengths(chosen_lengths, rejected_lengths)
    for value, flag in ((epochs, "--epochs"), (start_epoch, "resume epoch"), (start_step, "resume step")):
        if not _is_int(value) or value < 0:
            raise InputError(f"{flag} is {value!r}; it must be an integer >= 0")
    first = step_compositions(chosen, rejected, cfg, start_epoch, groups) if start_epoch < epochs else []
    if start_epoch < epochs and start_step > len(first):
        raise InputError(f"resume step {start_step} is past the {len(first)} steps of epoch {start_epoch}")
    return _iter_steps(chosen, rejected, prompt, cfg, epochs, start_epoch, start_step, first, groups)


def _iter_steps(chosen, rejected, prompt, cfg, epochs, start_epoch, start_step, first, groups) -> Iterator[StepPlan]:
    for epoch in range(start_epoch, epochs):
        steps = first if epoch == start_epoch else step_compositions(chosen, rejected, cfg, epoch, groups)
        for step in range(start_step if epoch == start_epoch else 0, len(steps)):
            yield _plan_step(steps[step], chosen, rejected, prompt, cfg, epoch, step, groups)
