"""Collation: exact tensors on hand examples, packed/prefix-shared/padded agreement on random pairs, dummy rows,
vectorization."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ds_packdpo.model.collate as collate_module
from ds_packdpo.model.collate import ModelBatch, PrefixLayout, collate_packed, collate_padded, collate_shared
from ds_packdpo.errors import InputError
from ds_packdpo.model.logps import scored_tokens as scored_positions

PAD = 0
X = -100
HAND_PAIRS = [
    {"prompt_ids": [11, 12], "chosen_ids": [13, 14], "rejected_ids": [15]},
    {"prompt_ids": [21], "chosen_ids": [22], "rejected_ids": [23, 24, 25]},
]


def test_packed_hand_example():
    batch = collate_packed(HAND_PAIRS, [7, 3], PAD)
    # c0 = 11 12 13 14 | r0 = 11 12 15 | c1 = 21 22 | r1 = 21 23 24 25
    assert batch.input_ids.tolist() == [[11, 12, 13, 14, 11, 12, 15, 21, 22, 21, 23, 24, 25]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0, 1, 0, 1, 2, 3]]
    # position t predicts t+1 only inside a sequence and only for completion tokens
    assert batch.labels.tolist() == [[X, 13, 14, X, X, 15, X, 22, X, 23, 24, 25, X]]
    assert batch.seq_index.tolist() == [[0, 0, 0, 0, 1, 1, 1, 2, 2, 3, 3, 3, 3]]
    assert batch.cu_seqlens.dtype == torch.int32 and batch.cu_seqlens.tolist() == [0, 4, 7, 9, 13]
    assert batch.attention_mask is None and batch.max_seqlen == 4
    assert (batch.num_pairs, batch.num_sequences, batch.real_tokens, batch.computed_tokens) == (2, 4, 13, 13)
    assert batch.pair_indices.tolist() == [7, 3]
    assert batch.seq_pair.tolist() == [0, 0, 1, 1] and batch.seq_is_chosen.tolist() == [True, False, True, False]
    assert all(t.dtype == torch.long for t in (batch.input_ids, batch.position_ids, batch.labels, batch.seq_index))


def test_shared_hand_example():
    batch = collate_shared(HAND_PAIRS, [7, 3], PAD)
    # p0 c0 r0 = 11 12 | 13 14 | 15,  p1 c1 r1 = 21 | 22 | 23 24 25: every prompt once
    assert batch.input_ids.tolist() == [[11, 12, 13, 14, 15, 21, 22, 23, 24, 25]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 2, 0, 1, 1, 2, 3]]  # rejected continues from the prompt
    # the prompt's last position predicts the first token of both completions: chosen in labels, rejected in fork_labels
    assert batch.labels.tolist() == [[X, 13, 14, X, X, 22, X, 24, 25, X]]
    assert batch.fork_labels.tolist() == [[X, 15, X, X, X, 23, X, X, X, X]]
    assert batch.seq_index.tolist() == [[0, 0, 0, 0, 1, 2, 2, 3, 3, 3]]
    assert batch.prefix_layout == PrefixLayout(((2, 2, 1), (1, 1, 3)))
    assert batch.cu_seqlens.tolist() == [0, 5, 10] and batch.max_seqlen == 5  # the pair blocks
    assert (batch.real_tokens, batch.computed_tokens, batch.prompt_tokens_shared) == (13, 10, 3)
    rows, targets, seq = scored_positions(batch)
    assert sorted(zip(seq.tolist(), rows.tolist(), targets.tolist())) == [
        (0, 1, 13), (0, 2, 14), (1, 1, 15), (2, 5, 22), (3, 5, 23), (3, 7, 24), (3, 8, 25)]


def test_padded_hand_example():
    batch = collate_padded(HAND_PAIRS, [7, 3], PAD)
    # rows: chosen of pair 0, chosen of pair 1, rejected of pair 0, rejected of pair 1
    assert batch.input_ids.tolist() == [[11, 12, 13, 14], [21, 22, PAD, PAD], [11, 12, 15, PAD], [21, 23, 24, 25]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    assert batch.labels.tolist() == [[X, 13, 14, X], [22, X, X, X], [X, 15, X, X], [23, 24, 25, X]]
    assert batch.seq_index.tolist() == [[0, 0, 0, 0], [2, 2, -1, -1], [1, 1, 1, -1], [3, 3, 3, 3]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3]] * 4
    assert batch.cu_seqlens is None and batch.max_seqlen == 4
    assert (batch.num_pairs, batch.real_tokens, batch.computed_tokens) == (2, 13, 16)


@pytest.mark.parametrize("collate, packed", [(collate_packed, True), (collate_shared, True), (collate_padded, False)])
def test_dummy_row(collate, packed):
    batch = collate([], [], pad_token_id=5)
    assert batch.input_ids.tolist() == [[5]] and batch.position_ids.tolist() == [[0]]
    assert batch.labels.tolist() == [[X]] and batch.seq_index.tolist() == [[-1]]
    assert (batch.num_pairs, batch.num_sequences, batch.max_seqlen, batch.real_tokens, batch.computed_tokens) == (0, 0, 1, 0, 1)
    assert batch.pair_indices.numel() == 0 and batch.seq_pair.numel() == 0
    if packed:
        assert batch.attention_mask is None and batch.cu_seqlens.tolist() == [0, 1]
    else:
        assert batch.attention_mask.tolist() == [[1]] and batch.cu_seqlens is None


token_lists = st.lists(st.integers(1, 1000), min_size=1, max_size=12)
random_pairs = st.lists(st.fixed_dictionaries({"prompt_ids": token_lists, "chosen_ids": token_lists,
                                               "rejected_ids": token_lists}), min_size=1, max_size=6)


def scored_tokens(batch: ModelBatch) -> Counter:
    """Multiset of (sequence, position, input token, label) over every scored position."""
    rows, targets, seq = scored_positions(batch)
    return Counter(zip(seq.tolist(), batch.position_ids.reshape(-1)[rows].tolist(),
                       batch.input_ids.reshape(-1)[rows].tolist(), targets.tolist()))


@settings(max_examples=100, deadline=None)
@given(random_pairs)
def test_packed_and_padded_score_the_same_tokens(pairs):
    indices = list(range(10, 10 + len(pairs)))
    packed, padded = collate_packed(pairs, indices, PAD), collate_padded(pairs, indices, PAD)
    shared = collate_shared(pairs, indices, PAD)
    # every layout predicts the same (sequence, position, token) -> target, the shared one with each prompt once
    assert scored_tokens(packed) == scored_tokens(padded) == scored_tokens(shared)
    prompts = sum(len(p["prompt_ids"]) for p in pairs)
    assert shared.computed_tokens == packed.computed_tokens - prompts == shared.prefix_layout.tokens
    assert shared.real_tokens == packed.real_tokens and shared.prompt_tokens_shared == prompts
    completions = sum(len(p["chosen_ids"]) + len(p["rejected_ids"]) for p in pairs)
    assert sum(scored_tokens(packed).values()) == completions  # every completion token is predicted exactly once
    lengths = [len(p["prompt_ids"]) + len(p[k]) for p in pairs for k in ("chosen_ids", "rejected_ids")]
    assert packed.cu_seqlens.tolist() == np.concatenate([[0], np.cumsum(lengths)]).tolist()
    assert packed.max_seqlen == padded.max_seqlen == max(lengths)
    assert packed.real_tokens == padded.real_tokens == sum(lengths) == packed.computed_tokens
    assert padded.computed_tokens == 2 * len(pairs) * max(lengths)
    assert int(padded.attention_mask.sum()) == sum(lengths)
    # a sequence's tokens, read back from either layout, are prompt + completion
    for seq, (pair, key) in enumerate((p, k) for p in pairs for k in ("chosen_ids", "rejected_ids")):
        expected = pair["prompt_ids"] + pair[key]
        assert packed.input_ids[packed.seq_index == seq].tolist() == expected
        assert padded.input_ids[padded.seq_index == seq].tolist() == expected


def test_inputs_as_arrays_and_device_move():
    as_arrays = [{k: np.asarray(v) for k, v in pair.items()} for pair in HAND_PAIRS]
    as_tensors = [{k: torch.tensor(v) for k, v in pair.items()} for pair in HAND_PAIRS]
    reference = collate_packed(HAND_PAIRS, (7, 3), PAD)
    for pairs in (as_arrays, as_tensors):
        batch = collate_packed(pairs, (7, 3), PAD).to("cpu")
        assert torch.equal(batch.input_ids, reference.input_ids) and torch.equal(batch.labels, reference.labels)


@pytest.mark.parametrize("collate", [collate_packed, collate_shared, collate_padded])
def test_empty_completion_scores_nothing_and_empty_prompt_is_refused(collate):
    pairs = [{"prompt_ids": [1, 5], "chosen_ids": [2, 3], "rejected_ids": []},
             {"prompt_ids": [6], "chosen_ids": [], "rejected_ids": [7]}]
    assert scored_tokens(collate(pairs, [4, 5], PAD)) == Counter({(0, 1, 5, 2): 1, (0, 2, 2, 3): 1, (3, 0, 6, 7): 1})
    with pytest.raises(InputError, match="^pair 4: 'prompt_ids' is empty"):
        collate([{"prompt_ids": [], "chosen_ids": [2], "rejected_ids": [3]}], [4], PAD)


def test_no_python_loop_per_token():
    """Lines executed inside collate.py do not grow with the number of tokens (only with pairs)."""
    collate_file = str(Path(collate_module.__file__).resolve())

    def lines_executed(tokens_per_part: int) -> int:
        rng = np.random.default_rng(0)
        pairs = [{k: rng.integers(1, 1000, tokens_per_part) for k in ("prompt_ids", "chosen_ids", "rejected_ids")}
                 for _ in range(3)]
        count = 0

        def tracer(frame, event, arg):
            nonlocal count
            if frame.f_code.co_filename == collate_file:
                count += event == "line"
                return tracer
            return None

        sys.settrace(tracer)
        try:
            collate_packed(pairs, [0, 1, 2], PAD)
            collate_shared(pairs, [0, 1, 2], PAD)
            collate_padded(pairs, [0, 1, 2], PAD)
        finally:
            sys.settrace(None)
        return count

    assert lines_executed(20_000) == lines_executed(10) > 0
