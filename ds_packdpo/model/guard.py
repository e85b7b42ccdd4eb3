"""The guard that packing is exact for a model: packed per-sequence log-probs against each sequence alone.

The guard exists because exactness is a property of the (model, attention backend,
transformers/torch version) combination, not of this code alone: transformers only
builds the per-sequence mask under conditions that have changed between releases,
and a backend that lets packed sequences attend to each other trains on silently
wrong log-probs.  So the real model is run on pairs packed into one row and one
sequence at a time, and the per-sequence log-probs are compared.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager

import torch

from ..errors import PackingNotExactError
from .collate import collate_packed, collate_padded, collate_shared
from .logps import forward_logps

# Packed and alone forwards run different kernel shapes, so they round differently.
# Measured on CPU with tiny random models (sdpa): fp32 agrees to <= 2e-5 absolute, bf16 to
# ~4e-5 of |logps|, while a cross-attending forward differs by 6e-4..1e-1 absolute
# (3e-5..6e-3 relative: random weights barely use context, real ones much more).
FP32_ATOL = 1e-4
HALF_RTOL = 1e-3


def synthetic_pairs(num_pairs: int, vocab_size: int, seed: int = 0, max_tokens: int = 24) -> list[dict]:
    """Random-id pairs of different lengths; the same on every rank for a seed (CPU generator)."""
    generator = torch.Generator().manual_seed(seed)

    def ids(low: int) -> list[int]:
        length = int(torch.randint(low, max_tokens + 1, (), generator=generator))
        return torch.randint(0, vocab_size, (length,), generator=generator).tolist()

    return [{"prompt_ids": ids(2), "chosen_ids": ids(1), "rejected_ids": ids(1)} for _ in range(num_pairs)]


@contextmanager
def evaluating(model):
    """Eval mode (no dropout) for the comparison, then the previous mode back."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def _each_sequence_alone(model, padded, attn: str, forward=forward_logps) -> torch.Tensor:
    """Log-probs [S] with every row of a padded batch cut to its own length and run as a batch of one, no mask."""
    total = torch.zeros(padded.num_sequences, device=padded.input_ids.device)
    for row, length in enumerate(padded.attention_mask.sum(dim=1).tolist()):
        cut = (slice(row, row + 1), slice(0, length))
        alone = dataclasses.replace(
            padded, input_ids=padded.input_ids[cut], position_ids=padded.position_ids[cut], attention_mask=None,
            labels=padded.labels[cut], seq_index=padded.seq_index[cut], cu_seqlens=None, max_seqlen=length,
            real_tokens=length, computed_tokens=length)
        total += forward(model, alone, attn).logps  # zero everywhere but this sequence's slot
    return total


def packing_exactness(model, sequences_pairs: list[dict], attn: str, pad_token_id: int, device=None,
                      tolerance: float | None = None, forward=forward_logps, shared_prefix: bool = False) -> dict:
    """Per-sequence log-probs of the pairs packed in one row (each prompt once with ``shared_prefix``) vs each
    sequence alone.

    ``tolerance`` defaults to 1e-4 absolute in fp32 and to 1e-3 of |logps| per
    sequence in bf16/fp16.  The number of forwards depends on the pairs only (1 +
    2 * pairs), so every rank of a ZeRO-3 job runs them together.  Pass ``device``
    (the compute device) when parameters may live elsewhere (ZeRO-3 parameter offload); ``forward``
    replaces :func:`forward_logps` (sequence parallelism runs both sides split over its group).
    """
    if not sequences_pairs:
        raise ValueError("packing_exactness needs at least one pair")
    parameter = next(model.parameters())
    device = parameter.device if device is None else torch.device(device)
    index = list(range(len(sequences_pairs)))
    with torch.no_grad(), evaluating(model):
        collate = collate_shared if shared_prefix else collate_packed
        packed = forward(model, collate(sequences_pairs, index, pad_token_id).to(device), attn)
        alone = _each_sequence_alone(model, collate_padded(sequences_pairs, index, pad_token_id).to(device), attn,
                                     forward)
    abs_diff = (packed.logps - alone).abs()
    rel_diff = abs_diff / alone.abs().clamp_min(1.0)
    relative = parameter.dtype in (torch.bfloat16, torch.float16)
    if tolerance is None:
        tolerance = HALF_RTOL if relative else FP32_ATOL
    measured = rel_diff.max() if relative else abs_diff.max()
    return {
        "attn": attn,
        "layout": "shared-prefix" if shared_prefix else "packed",
        "pairs": len(sequences_pairs),
        "dtype": str(parameter.dtype).removeprefix("torch."),
        "max_abs_diff_logps": float(abs_diff.max()),
        "max_rel_diff_logps": float(rel_diff.max()),
        "tolerance": float(tolerance),
        "tolerance_kind": "relative" if relative else "absolute",
        "ok": bool(measured <= tolerance),  # False for NaN too
    }


def assert_packing_exact(model, attn: str, vocab_size: int, pad_token_id: int, device=None,
                         forward=forward_logps, shared_prefix: bool = False) -> dict:
    """The start-up guard: one fixed synthetic pair (two sequences), identical on every rank; with ``shared_prefix``
    laid out as the run lays out its rows, the prompt once."""
    result = packing_exactness(model, synthetic_pairs(1, vocab_size, seed=0, max_tokens=12), attn, pad_token_id,
                               device, forward=forward, shared_prefix=shared_prefix)
    if not result["ok"]:
        measured = result["max_rel_diff_logps"] if result["tolerance_kind"] == "relative" else result["max_abs_diff_logps"]
        what, way_out = (("prefix-shared rows", "--no-prefix-sharing") if shared_prefix
                         else ("packed rows", "another --attn (e.g. sdpa) or --no-packing"))
        raise PackingNotExactError(
            f"--attn {attn}: {what} are not exact with this model/backend/version: per-sequence log-probs of a "
            f"{what[:-1]} differ from each sequence alone by {measured:.3g} ({result['tolerance_kind']}, tolerance "
            f"{result['tolerance']:.3g}); sequences would attend across their boundaries - use {way_out}")
    return result
