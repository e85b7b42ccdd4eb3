"""Turn one planned row of preference pairs into model inputs, packed or padded.

Packed (:func:`collate_packed`): all 2P sequences of the row concatenated into one
``[1, T]`` row with no padding.  ``position_ids`` restart at 0 for every sequence,
which is what lets transformers build a per-sequence (block-diagonal) causal mask
when called with ``attention_mask=None, use_cache=False``; ``cu_seqlens`` /
``max_seqlen`` serve varlen kernels.  Padded (:func:`collate_padded`): the usual TRL /
OpenRLHF batch of 2P right-padded rows, the benchmark baseline and the reference of
the parity tests.

Both share one canonical sequence numbering -- sequence 2p is the chosen of local pair p,
2p+1 its rejected -- and one label rule: ``labels[t]`` is the token at t+1 when that token
is a completion token of the same sequence, else -100.  So a segment sum of the
per-token log-probs over ``seq_index`` gives each sequence's completion log-prob in
either layout.  Everything per token is vectorized; the only Python loop is over pairs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch

from ..errors import InputError

IGNORE_INDEX = -100


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
    real_tokens: int
    computed_tokens: int  # N * L

    def to(self, device) -> "ModelBatch":
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in moved.items():
            if isinstance(value, torch.Tensor):
                moved[name] = value.to(device)
        return ModelBatch(**moved)

    @property
    def num_sequences(self) -> int:
        return 2 * self.num_pairs

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


def _flatten(pairs: Sequence[Mapping[str, Sequence[int]]], pair_indices: Sequence[int]) -> _Flat:
    if len(pairs) != len(pair_indices):
        raise ValueError(f"got {len(pairs)} pairs but {len(pair_indices)} pair indices")
    pieces, seq_lengths, prompt_lengths = [], [], []
    for pair, index in zip(pairs, pair_indices):
        prompt = np.asarray(pair["prompt_ids"], dtype=np.int64)
        for key in ("chosen_ids", "rejected_ids"):
            completion = np.asarray(pair[key], dtype=np.int64)
            if prompt.size == 0 or completion.size == 0:
                empty = "prompt_ids" if prompt.size == 0 else key
                raise InputError(f"pair {index}: '{empty}' is empty; a sequence needs a prompt and a completion to score")
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
    return _Flat(ids, lengths, positions, labels, seq_index)


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
    )


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
    )


def collate_row(columns, pair_indices: Sequence[int], pad_token_id: int, packed: bool = True) -> ModelBatch:
    """The model inputs of one planned row: its pairs (positional indices) looked up in the tokenized columns
    (a ``datasets.Dataset`` with ``prompt_ids``, ``chosen_ids``, ``rejected_ids``), packed or padded."""
    indices = list(pair_indices)
    pairs = []
    if indices:
        cols = columns[indices]
        pairs = [{"prompt_ids": p, "chosen_ids": c, "rejected_ids": r}
                 for p, c, r in zip(cols["prompt_ids"], cols["chosen_ids"], cols["rejected_ids"])]
    return (collate_packed if packed else collate_padded)(pairs, indices, pad_token_id)
