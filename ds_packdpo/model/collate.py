"""Turn one planned row of preference pairs into model inputs: one collate function per row layout.

Packed (:func:`collate_packed`): all 2P sequences of the row concatenated into one
``[1, T]`` row with no padding.  ``position_ids`` restart at 0 for every sequence,
which is what lets transformers build a per-sequence (block-diagonal) causal mask
when called with ``attention_mask=None, use_cache=False``; ``cu_seqlens`` /
``max_seqlen`` serve varlen kernels.  Prefix-shared (:func:`collate_shared`): every pair
once as ``[prompt | chosen | rejected]``, the prompt computed once for both completions;
its attention (``model/prefix_attention.py``) follows the row's :class:`PrefixLayout`.
Prompt groups (:func:`collate_grouped`): the pairs of a row that share a prompt as one block
``[prompt | r1 | ... | rk]``, every prompt and distinct response once.  Spread responses
(:func:`collate_spread`): a row of a step whose prompt groups are spread over ranks holds
responses, not pairs, laid out as groups, its sums per pair side.  Padded
(:func:`collate_padded`): the usual TRL / OpenRLHF batch of 2P right-padded rows, the
benchmark baseline and the reference of the parity tests.  :data:`COLLATE` maps each
``data.plan.RowLayout`` to its function.

All share one canonical sequence numbering -- sequence 2p is the chosen of local pair p,
2p+1 its rejected -- and one label rule: ``labels[t]`` is the token position t predicts
when that token is a completion token of the sequence ``seq_index[t]``, else -100.  In the
prefix-shared layout the prompt's last position predicts the first token of both
completions: ``labels`` holds the chosen one and ``fork_labels`` the rejected one (for
sequence ``seq_index[t] + 1``).  So a segment sum of the per-token log-probs gives each
sequence's completion log-prob in every layout.  Everything per token is vectorized; the
only Python loop is over pairs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch

from ..data.plan import RowLayout
from ..data.response_spread import StepResponses, row_sides
from ..errors import InputError

IGNORE_INDEX = -100


@dataclass(frozen=True)
class PrefixLayout:
    """Where the prompt groups of a prefix-shared row lie: block g holds ``[prompt | r1 | ... | rk]`` of
    ``blocks[g] = (P, R1, ..., Rk)`` tokens (k >= 1; a pair is the k = 2 case ``(P, C, R)``).  Prompt tokens attend
    to the prompt; the tokens of response j to the prompt and the tokens of response j before them, never another
    response.  A block ``(L, 0, 0)`` is one causal sequence (the padding that sequence parallelism appends)."""

    blocks: tuple[tuple[int, ...], ...]

    @property
    def tokens(self) -> int:
        return sum(sum(block) for block in self.blocks)

    def padded(self, tokens: int) -> PrefixLayout:
        """The layout with ``tokens`` more at the end, as one sequence of their own (nothing when 0)."""
        return PrefixLayout(self.blocks + ((tokens, 0, 0),)) if tokens else self


@dataclass(frozen=True)
class PromptGroup:
    """One prompt and its distinct responses, with the pairs drawn from them: ``pairs[i] = (chosen response,
    rejected response)`` (indices into ``responses``) of the planned pair ``pair_indices[i]``."""

    prompt_ids: tuple[int, ...]
    responses: tuple[tuple[int, ...], ...]
    pairs: tuple[tuple[int, int], ...]
    pair_indices: tuple[int, ...]


def group_pairs(pairs: Sequence[Mapping[str, Sequence[int]]], pair_indices: Sequence[int]) -> list[PromptGroup]:
    """The pairs grouped by prompt token ids (first appearance order), identical responses of a group kept once."""
    if len(pairs) != len(pair_indices):
        raise ValueError(f"got {len(pairs)} pairs but {len(pair_indices)} pair indices")
    found: dict[tuple[int, ...], tuple[dict, list, list]] = {}
    for pair, index in zip(pairs, pair_indices):
        prompt = tuple(int(t) for t in pair["prompt_ids"])
        responses, members, indices = found.setdefault(prompt, ({}, [], []))
        sides = [responses.setdefault(tuple(int(t) for t in pair[key]), len(responses))
                 for key in ("chosen_ids", "rejected_ids")]
        members.append(tuple(sides))
        indices.append(index)
    return [PromptGroup(prompt, tuple(responses), tuple(members), tuple(indices))
            for prompt, (responses, members, indices) in found.items()]


@dataclass
class ModelBatch:
    input_ids: torch.Tensor  # [N, L] long (packed: N = 1)
    position_ids: torch.Tensor  # [N, L] long
    attention_mask: torch.Tensor | None  # None when packed; [N, L] long when padded
    labels: torch.Tensor  # [N, L] long: input_ids[n, t+1] if it is a completion token of the same sequence, else -100
    seq_index: torch.Tensor  # [N, L] long: canonical sequence of position t; -1 on padding
    cu_seqlens: torch.Tensor | None  # [2P+1] int32 when packed, else None
    max_seqlen: int
    num_pairs: int  # P; sequence 2p = chosen of local pair p, 2p+1 = its rejected
    pair_indices: torch.Tensor  # [P] long, positional pair indices of the row
    real_tokens: int  # tokens of the 2P sequences (a prompt counted once per sequence)
    computed_tokens: int  # N * L: tokens the model runs
    # Prefix-shared rows only: the second target of each prompt's last position (the first rejected token, scored
    # for sequence seq_index + 1), -100 elsewhere; the row's pair blocks; the prompt tokens not run twice.
    fork_labels: torch.Tensor | None = None  # [1, T] long
    prefix_layout: PrefixLayout | None = None
    prompt_tokens_shared: int = 0
    # Grouped rows only: pair p's (chosen, rejected) sequences when they are not the canonical (2p, 2p + 1), and the
    # number of sequences (responses) the row computes.
    pair_sequences: torch.Tensor | None = None  # [P, 2] long; a row of spread responses: [K] its pair sides
    sequences: int = 0
    # Rows of responses spread over ranks (collate_responses) only: the position of each pair side it computes in the
    # step's side vector
    # (its sums are exchanged there, run/response_exchange.py), and each such pair's shorter completion (LD-DPO).
    side_positions: torch.Tensor | None = None  # [K] long
    side_shared: torch.Tensor | None = None  # [K] long
    # Every row: (position id of the first completion token, completion length) of each sequence (response), for
    # per-token weights that depend on a token's place in its completion (model/token_weights.py).
    completion_spans: torch.Tensor | None = None  # [num_sequences, 2] long

    def to(self, device) -> "ModelBatch":
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in moved.items():
            if isinstance(value, torch.Tensor):
                moved[name] = value.to(device)
        return ModelBatch(**moved)

    @property
    def num_sequences(self) -> int:
        return self.sequences or 2 * self.num_pairs

    @property
    def seq_pair(self) -> torch.Tensor:
        """[2P] long: the local pair of each canonical sequence."""
        return torch.arange(self.num_sequences, device=self.input_ids.device) // 2

    @property
    def seq_is_chosen(self) -> torch.Tensor:
        """[2P] bool: True for chosen sequences."""
        return torch.arange(self.num_sequences, device=self.input_ids.device) % 2 == 0


@dataclass
class _Flat:
    """All 2P sequences of a row concatenated in canonical order, with per-token bookkeeping."""

    ids: torch.Tensor  # [T]
    seq_lengths: torch.Tensor  # [2P]
    positions: torch.Tensor  # [T] position within its sequence
    labels: torch.Tensor  # [T]
    seq_index: torch.Tensor  # [T]
    completion_spans: torch.Tensor  # [2P, 2]: (prompt length, completion length)


def _check_prompt(prompt: np.ndarray, index) -> None:
    if prompt.size == 0:
        raise InputError(f"pair {index}: 'prompt_ids' is empty; the first completion token is predicted from the "
                         f"prompt's last token")


def _flatten(pairs: Sequence[Mapping[str, Sequence[int]]], pair_indices: Sequence[int]) -> _Flat:
    if len(pairs) != len(pair_indices):
        raise ValueError(f"got {len(pairs)} pairs but {len(pair_indices)} pair indices")
    pieces, seq_lengths, prompt_lengths = [], [], []
    for pair, index in zip(pairs, pair_indices):
        prompt = np.asarray(pair["prompt_ids"], dtype=np.int64)
        _check_prompt(prompt, index)
        for key in ("chosen_ids", "rejected_ids"):
            completion = np.asarray(pair[key], dtype=np.int64)
            pieces += [prompt, completion]
            seq_lengths.append(prompt.size + completion.size)
            prompt_lengths.append(prompt.size)
    ids = torch.from_numpy(np.concatenate(pieces))
    lengths = torch.tensor(seq_lengths, dtype=torch.long)
    seq_index = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    positions = torch.arange(ids.numel()) - starts[seq_index]
    # Position t predicts token t+1; it is scored when t+1 is a completion token of the same sequence.
    next_position = positions + 1
    scored = (next_position < lengths[seq_index]) & (next_position >= torch.tensor(prompt_lengths)[seq_index])
    next_ids = torch.roll(ids, -1)
    labels = torch.where(scored, next_ids, torch.full_like(ids, IGNORE_INDEX))
    prompts = torch.tensor(prompt_lengths, dtype=torch.long)
    return _Flat(ids, lengths, positions, labels, seq_index, torch.stack([prompts, lengths - prompts], 1))


def _dummy(pad_token_id: int, packed: bool) -> ModelBatch:
    """The 1-token row that keeps a rank with no pairs in step with the collectives (zero loss)."""
    one = torch.zeros(1, 1, dtype=torch.long)
    return ModelBatch(
        input_ids=torch.full((1, 1), pad_token_id, dtype=torch.long),
        position_ids=one.clone(),
        attention_mask=None if packed else torch.ones(1, 1, dtype=torch.long),
        labels=torch.full((1, 1), IGNORE_INDEX, dtype=torch.long),
        seq_index=torch.full((1, 1), -1, dtype=torch.long),
        cu_seqlens=torch.tensor([0, 1], dtype=torch.int32) if packed else None,
        max_seqlen=1,
        num_pairs=0,
        pair_indices=torch.zeros(0, dtype=torch.long),
        real_tokens=0,
        computed_tokens=1,
        completion_spans=torch.zeros(0, 2, dtype=torch.long),
    )


def collate_packed(pairs: Sequence[Mapping[str, Sequence[int]]], pair_indices: Sequence[int],
                   pad_token_id: int) -> ModelBatch:
    """One padding-free row: c0, r0, c1, r1, ... concatenated; zero pairs give the 1-token dummy row."""
    if len(pairs) == 0:
        return _dummy(pad_token_id, packed=True)
    flat = _flatten(pairs, pair_indices)
    cu_seqlens = torch.zeros(flat.seq_lengths.numel() + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.cumsum(flat.seq_lengths, 0)
    return ModelBatch(
        input_ids=flat.ids[None],
        position_ids=flat.positions[None],
        attention_mask=None,
        labels=flat.labels[None],
        seq_index=flat.seq_index[None],
        cu_seqlens=cu_seqlens,
        max_seqlen=int(flat.seq_lengths.max()),
        num_pairs=len(pairs),
        pair_indices=torch.as_tensor(pair_indices, dtype=torch.long),
        real_tokens=flat.ids.numel(),
        computed_tokens=flat.ids.numel(),
        completion_spans=flat.completion_spans,
    )


@dataclass
class _GroupedRow:
    """The flat row of prompt groups ``[prompt | r1 | ... | rk]`` block by block, response j of a block its sequence
    ``first[block] + j``."""

    ids: torch.Tensor        # [T]
    positions: torch.Tensor  # [T]
    seq_index: torch.Tensor  # [T]
    labels: torch.Tensor     # [T]
    fork_labels: torch.Tensor  # [forks, T]
    blocks: tuple[tuple[int, ...], ...]
    first: list[int]         # first sequence of each block
    sequences: int

    def batch(self, **pairs) -> ModelBatch:
        """The ModelBatch of this row with its pairs' fields (``num_pairs``, ``pair_indices``, ``real_tokens``, ...)."""
        lengths = torch.tensor([sum(b) for b in self.blocks], dtype=torch.int32)
        cu_seqlens = torch.zeros(lengths.numel() + 1, dtype=torch.int32)
        cu_seqlens[1:] = torch.cumsum(lengths, 0)
        return ModelBatch(
            input_ids=self.ids[None], position_ids=self.positions[None], attention_mask=None,
            labels=self.labels[None], seq_index=self.seq_index[None],
            cu_seqlens=cu_seqlens,  # the group blocks
            max_seqlen=int(lengths.max()), computed_tokens=self.ids.numel(), fork_labels=self.fork_labels,
            prefix_layout=PrefixLayout(self.blocks),
            completion_spans=torch.tensor([(block[0], size) for block in self.blocks for size in block[1:]],
                                          dtype=torch.long).reshape(-1, 2),
            **pairs)


def _grouped_row(groups: Sequence[tuple[Sequence[int], Sequence[Sequence[int]]]], names: Sequence) -> _GroupedRow:
    """Positions: the prompt 0..P-1, every response P..P+Rj-1, so each token sits where it would in its own sequence.
    The prompt's last position predicts the first token of every response: response 1's in ``labels``, response
    j's in row j - 2 of ``fork_labels`` (scored for sequence ``seq_index + j - 1``).  A response may be empty; the
    prompt may not (``names[g]`` names a pair of group g in that error)."""
    forks = max(1, max(len(responses) for _, responses in groups) - 1)
    ids, positions, seq_index, labels, blocks, first_of = [], [], [], [], [], []
    fork_at: list[tuple[int, int, int]] = []  # (fork row, flat position, token)
    start = first = 0
    for (prompt_ids, response_ids), name in zip(groups, names):
        prompt = np.asarray(prompt_ids, dtype=np.int64)
        _check_prompt(prompt, name)
        responses = [np.asarray(r, dtype=np.int64) for r in response_ids]
        size = prompt.size
        ids.append(prompt)
        positions.append(np.arange(size))
        seq_index.append(np.full(size, first))
        prompt_labels = np.full(size, IGNORE_INDEX)
        for j, response in enumerate(responses):
            ids.append(response)
            positions.append(size + np.arange(response.size))
            seq_index.append(np.full(response.size, first + j))
            labels.append(np.append(response[1:], IGNORE_INDEX)[:response.size])
            if response.size and j == 0:
                prompt_labels[-1] = response[0]
            elif response.size:
                fork_at.append((j - 1, start + size - 1, int(response[0])))
        labels.insert(len(labels) - len(responses), prompt_labels)
        blocks.append((size, *(r.size for r in responses)))
        first_of.append(first)
        start += sum(blocks[-1])
        first += len(responses)
    flat = torch.from_numpy(np.concatenate(ids))
    fork_labels = torch.full((forks, flat.numel()), IGNORE_INDEX, dtype=torch.long)
    for row, position, token in fork_at:
        fork_labels[row, position] = token
    return _GroupedRow(flat, torch.from_numpy(np.concatenate(positions)), torch.from_numpy(np.concatenate(seq_index)),
                       torch.from_numpy(np.concatenate(labels)), fork_labels, tuple(blocks), first_of, first)


def collate_groups(groups: Sequence[PromptGroup], pad_token_id: int,
                   pair_order: Sequence[int] | None = None) -> ModelBatch:
    """One padding-free row with every prompt group once: ``[prompt | r1 | ... | rk]`` block by block (see
    :class:`PrefixLayout` and :func:`_grouped_row`).  The pairs' log-probs are looked up from the responses'
    (``pair_sequences``), in ``pair_order`` (the groups' order by default).
    """
    pair_indices = list(pair_order) if pair_order is not None else [i for group in groups for i in group.pair_indices]
    if not pair_indices:
        return _dummy(pad_token_id, packed=True)
    row = _grouped_row([(group.prompt_ids, group.responses) for group in groups],
                       [group.pair_indices[0] for group in groups])
    pair_sequences, real = {}, 0
    for group, first in zip(groups, row.first):
        size = len(group.prompt_ids)
        for (chosen, rejected), index in zip(group.pairs, group.pair_indices):
            pair_sequences[index] = (first + chosen, first + rejected)
            real += 2 * size + len(group.responses[chosen]) + len(group.responses[rejected])
    pairs = torch.tensor([pair_sequences[index] for index in pair_indices], dtype=torch.long)
    canonical = torch.equal(pairs.reshape(-1), torch.arange(2 * len(pair_indices)))
    return row.batch(num_pairs=len(pair_indices), pair_indices=torch.as_tensor(pair_indices, dtype=torch.long),
                     real_tokens=real, prompt_tokens_shared=real - row.ids.numel(),
                     pair_sequences=None if canonical else pairs, sequences=0 if canonical else row.sequences)


def collate_responses(groups: Sequence[tuple[Sequence[int], Sequence[Sequence[int]]]], sides: Sequence[Sequence[int]],
                      side_positions: Sequence[int], side_shared: Sequence[int], pad_token_id: int,
                      names: Sequence) -> ModelBatch:
    """A row of responses spread over ranks (``data/response_spread.py``): ``groups[g] = (prompt ids, its responses
    here)``, laid out as :func:`collate_groups` does; no pair need be whole here.  ``sides[g][j]`` lists the pair
    sides response j of group g is; ``side_positions`` (flat, in that order) are their positions in the step's side
    vector (2 x the pair's place in the step, + 1 for a rejected) and ``side_shared`` each one's pair's shorter
    completion (LD-DPO).  The forward's sums come out per side, in that order (``pair_sequences`` 1-D)."""
    if not groups:
        return _dummy(pad_token_id, packed=True)
    row = _grouped_row(groups, names)
    sequences = [row.first[g] + j for g, per_group in enumerate(sides) for j, positions in enumerate(per_group)
                 for _ in positions]
    return row.batch(num_pairs=0, pair_indices=torch.zeros(0, dtype=torch.long), real_tokens=0,
                     pair_sequences=torch.tensor(sequences, dtype=torch.long), sequences=row.sequences,
                     side_positions=torch.as_tensor(side_positions, dtype=torch.long),
                     side_shared=torch.as_tensor(side_shared, dtype=torch.long))


def collate_shared(pairs: Sequence[Mapping[str, Sequence[int]]], pair_indices: Sequence[int],
                   pad_token_id: int) -> ModelBatch:
    """Prefix sharing alone: every pair its own group ``[prompt | chosen | rejected]`` (the k = 2 case of
    :func:`collate_groups`; pair p is sequences 2p and 2p + 1)."""
    if len(pairs) != len(pair_indices):
        raise ValueError(f"got {len(pairs)} pairs but {len(pair_indices)} pair indices")
    return collate_groups([PromptGroup(tuple(pair["prompt_ids"]), (tuple(pair["chosen_ids"]),
                                                                    tuple(pair["rejected_ids"])), ((0, 1),), (index,))
                           for pair, index in zip(pairs, pair_indices)], pad_token_id)


def collate_grouped(pairs: Sequence[Mapping[str, Sequence[int]]], pair_indices: Sequence[int],
                    pad_token_id: int) -> ModelBatch:
    """Pairs whose prompts repeat grouped (:func:`group_pairs`): every prompt and distinct response once."""
    return collate_groups(group_pairs(pairs, pair_indices), pad_token_id, pair_indices)


def collate_padded(pairs: Sequence[Mapping[str, Sequence[int]]], pair_indices: Sequence[int],
                   pad_token_id: int) -> ModelBatch:
    """2P right-padded rows: row i < P is the chosen of pair i (sequence 2i), row P+i its rejected (2i+1)."""
    if len(pairs) == 0:
        return _dummy(pad_token_id, packed=False)
    flat = _flatten(pairs, pair_indices)
    num_pairs = len(pairs)
    canonical = torch.arange(2 * num_pairs)
    row_of_seq = canonical // 2 + (canonical % 2) * num_pairs
    rows, width = 2 * num_pairs, int(flat.seq_lengths.max())
    token_rows, token_cols = row_of_seq[flat.seq_index], flat.positions

    def scatter(values: torch.Tensor, fill: int) -> torch.Tensor:
        grid = torch.full((rows, width), fill, dtype=torch.long)
        grid[token_rows, token_cols] = values
        return grid

    return ModelBatch(
        input_ids=scatter(flat.ids, pad_token_id),
        # Right padding: positions simply count on into the padding, as transformers does by default.
        position_ids=torch.arange(width).expand(rows, width).clone(),
        attention_mask=scatter(torch.ones_like(flat.ids), 0),
        labels=scatter(flat.labels, IGNORE_INDEX),
        seq_index=scatter(flat.seq_index, -1),
        cu_seqlens=None,
        max_seqlen=width,
        num_pairs=num_pairs,
        pair_indices=torch.as_tensor(pair_indices, dtype=torch.long),
        real_tokens=flat.ids.numel(),
        computed_tokens=rows * width,
        completion_spans=flat.completion_spans,
    )


def collate_spread(pairs: Sequence[Mapping[str, Sequence[int]]], pair_indices: Sequence[int], pad_token_id: int,
                   responses: StepResponses | None = None, members: Sequence[int] = ()) -> ModelBatch:
    """A row of spread responses: ``members`` (``Row.responses``, indices into the step's ``responses``), their
    tokens taken from ``pairs`` (the row's pairs, ``Row.pairs``: each response's source pair is one of them), laid
    out as :func:`collate_responses` does: each unit's prompt once, then its responses here."""
    members = np.asarray(members, dtype=np.int64)
    if not members.size:
        return _dummy(pad_token_id, packed=True)
    of_index = dict(zip(pair_indices, pairs))
    sources = responses.source[members].tolist()
    side_names = ("chosen_ids", "rejected_ids")
    per_side, positions, shared = row_sides(responses, members)
    units = responses.unit[members]
    starts = np.flatnonzero(np.r_[True, units[1:] != units[:-1]])
    ends = np.r_[starts[1:], members.size]
    groups, sides, names = [], [], []
    for start, end in zip(starts.tolist(), ends.tolist()):
        groups.append((of_index[sources[start]]["prompt_ids"],
                       [of_index[sources[k]][side_names[responses.side[members[k]]]] for k in range(start, end)]))
        sides.append(per_side[start:end])
        names.append(sources[start])
    return collate_responses(groups, sides, positions.tolist(), shared.tolist(), pad_token_id, names)


# the collate function of each row layout (a new layout: a row here and its function above)
COLLATE = {RowLayout.PADDED: collate_padded, RowLayout.PACKED: collate_packed, RowLayout.PREFIX_SHARED: collate_shared,
           RowLayout.PROMPT_GROUPS: collate_grouped, RowLayout.SPREAD_RESPONSES: collate_spread}


def collate_row(columns, pair_indices: Sequence[int], pad_token_id: int, layout: RowLayout = RowLayout.PACKED,
                responses: StepResponses | None = None, members: Sequence[int] = ()) -> ModelBatch:
    """The model inputs of one planned row: its pairs (positional indices) looked up in the tokenized columns
    (a ``datasets.Dataset`` with ``prompt_ids``, ``chosen_ids``, ``rejected_ids``), collated in ``layout``; a row of
    spread responses also takes the step's ``responses`` and the row's ``members`` (``Row.responses``)."""
    indices = list(pair_indices)
    pairs = []
    if indices:
        cols = columns[indices]
        pairs = [{"prompt_ids": p, "chosen_ids": c, "rejected_ids": r}
                 for p, c, r in zip(cols["prompt_ids"], cols["chosen_ids"], cols["rejected_ids"])]
    spread = {"responses": responses, "members": members} if layout.spreads_responses else {}
    return COLLATE[layout](pairs, indices, pad_token_id, **spread)
