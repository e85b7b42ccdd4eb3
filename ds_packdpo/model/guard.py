"""The guard that packing is exact for a model: packed per-sequence log-probs against each sequence alone, eager.

The guard exists because exactness is a property of the (model, attention backend,
transformers/torch version) combination, not of this code alone: transformers only
builds the per-sequence mask under conditions that have changed between releases, a
kernel can drop a layer's sliding window or soft-cap, and a backend that lets packed
sequences attend to each other trains on silently wrong log-probs.  So the real model
runs pairs packed into one row with the run's backend, and each sequence alone with
transformers' **eager** attention (an independent kernel: the model's own reference
implementation, window and soft-cap included), on sequences longer than any sliding
window of the model, and the per-sequence log-probs are compared.  With prefix sharing the
row is laid out as the run lays out its rows (each pair as ``[prompt | chosen | rejected]``).

The difference is measured per completion token (|packed - alone| / tokens of the
sequence): rounding differences of an exact kernel stay far below a bound that grows
with the sequence, while a kernel that leaks context moves every affected token.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager

import torch

from ..errors import PackingNotExactError
from .attention import sliding_window_of
from .collate import collate_packed, collate_padded, collate_shared
from .logps import forward_logps
from .lora import hf_model

# Tolerances on the mean difference per completion token of a sequence's summed log-prob.
# fp32: an exact kernel differs by ~1e-7 per token (tiny models here; 4.9e-4 on ~1,000-token real chat sequences,
# ~5e-7 per token), a leaking one by 3e-4..1e-3 per token on real data (0.3-1.0 nats per sequence) and by 1e-2 or
# more on the guard's short completions after a context beyond the window (tiny models here).
FP32_ATOL_PER_TOKEN = 1e-5
# bf16/fp16: 5x the worst exact figure measured (1.9e-3 per token: a random 12-layer, 768-wide Llama on ~1,000-token
# sequences, CPU, sdpa_varlen against eager alone; tiny models 2e-4..1.4e-3), while kernels that drop the window of
# the tiny matrix models differ by 1.5e-2..8e-2 per token (README "The exactness guard"; scripts/gpu_check.py
# prints the figures of a GPU with flash-attn).
HALF_ATOL_PER_TOKEN = 1e-2
# In half precision the bound is also at least NOISE_FACTOR times this model's own noise floor: transformers' sdpa
# against its eager attention, each sequence alone (two references that share none of this package's code).  On a
# large-vocabulary model bf16 logits are coarse (spacing 2^-7 at |logit| 1-2): a random Llama-3.2-1B-shaped model
# (vocab 128,256) differed from eager alone by 2.7e-2 per token on an H200 with torch_varlen, an exact kernel there
# (README "On a GPU"), above the fixed bound, while its matrix models stay below 1e-3.
NOISE_FACTOR = 4.0
NOISE_REFERENCE_ATTN = "sdpa"
REFERENCE_ATTN = "eager"
# Completion tokens of the guard's sequences, and how far their prompts reach beyond the model's sliding window.
COMPLETION_TOKENS = 12
BEYOND_WINDOW = 8


def synthetic_pairs(num_pairs: int, vocab_size: int, seed: int = 0, max_tokens: int = 24,
                    min_prompt_tokens: int = 2) -> list[dict]:
    """Random-id pairs of different lengths; the same on every rank for a seed (CPU generator).

    Prompts have ``min_prompt_tokens`` to ``min_prompt_tokens + max_tokens - 2`` tokens, completions 1 to
    ``max_tokens``.
    """
    generator = torch.Generator().manual_seed(seed)

    def ids(low: int, high: int) -> list[int]:
        length = int(torch.randint(low, high + 1, (), generator=generator))
        return torch.randint(0, vocab_size, (length,), generator=generator).tolist()

    return [{"prompt_ids": ids(min_prompt_tokens, min_prompt_tokens + max_tokens - 2),
             "chosen_ids": ids(1, max_tokens), "rejected_ids": ids(1, max_tokens)} for _ in range(num_pairs)]


def guard_pairs(model, vocab_size: int, num_pairs: int = 1, seed: int = 0) -> list[dict]:
    """The guard's pairs for ``model``: every sequence longer than the model's sliding window (if it has one),
    with completions that are scored beyond it, so a kernel that drops the window changes them."""
    window = sliding_window_of(hf_model(model).config)
    if window is None:
        return synthetic_pairs(num_pairs, vocab_size, seed=seed, max_tokens=COMPLETION_TOKENS)
    return synthetic_pairs(num_pairs, vocab_size, seed=seed, max_tokens=COMPLETION_TOKENS,
                           min_prompt_tokens=window + BEYOND_WINDOW)


@contextmanager
def evaluating(model):
    """Eval mode (no dropout) for the comparison, then the previous mode back."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


@contextmanager
def attention_implementation(model, name: str):
    """The HF model (also behind a DeepSpeed engine) runs with attention ``name`` inside, its own one after."""
    lm = hf_model(model)
    own = lm.config._attn_implementation
    lm.set_attn_implementation(name)
    try:
        yield
    finally:
        lm.set_attn_implementation(own)


def each_sequence_alone(model, padded, attn: str = REFERENCE_ATTN) -> torch.Tensor:
    """Log-probs [S] with every row of a padded batch cut to its own length and run as a batch of one with
    transformers' attention ``attn`` (eager by default)."""
    total = torch.zeros(padded.num_sequences, dtype=torch.float64, device=padded.input_ids.device)
    with attention_implementation(model, attn):
        for row, length in enumerate(padded.attention_mask.sum(dim=1).tolist()):
            cut = (slice(row, row + 1), slice(0, length))
            alone = dataclasses.replace(
                padded, input_ids=padded.input_ids[cut], position_ids=padded.position_ids[cut], attention_mask=None,
                labels=padded.labels[cut], seq_index=padded.seq_index[cut], cu_seqlens=None, max_seqlen=length,
                real_tokens=length, computed_tokens=length)
            total += forward_logps(model, alone, attn).logps  # zero everywhere but this sequence's slot
    return total


def noise_floor_per_token(model, padded, alone: torch.Tensor, tokens: torch.Tensor) -> float | None:
    """The largest per-token difference between two exact references, each sequence alone: transformers' sdpa
    against the ``alone`` eager log-probs (None where transformers has no sdpa for the model, e.g. Gemma 2)."""
    try:
        reference = each_sequence_alone(model, padded, NOISE_REFERENCE_ATTN)
    except ValueError:  # transformers refuses sdpa for this model
        return None
    return float(((reference - alone).abs() / tokens.double().clamp_min(1.0)).max())


def tolerance_per_token(dtype: torch.dtype) -> float:
    return HALF_ATOL_PER_TOKEN if dtype in (torch.bfloat16, torch.float16) else FP32_ATOL_PER_TOKEN


def packing_exactness(model, sequences_pairs: list[dict], attn: str, pad_token_id: int, device=None,
                      tolerance: float | None = None, forward=forward_logps, shared_prefix: bool = False) -> dict:
    """Per-sequence log-probs of the pairs packed in one row (backend ``attn``; each prompt once with
    ``shared_prefix``) vs each sequence alone (eager).

    ``tolerance`` bounds the mean difference per completion token of a sequence (default
    :func:`tolerance_per_token` of the model's dtype, in half precision at least ``NOISE_FACTOR``
    times the model's :func:`noise_floor_per_token`).  The number of forwards depends on the
    pairs and the dtype only (1 + 2 * pairs, 1 + 4 * pairs in half precision), so every rank
    of a ZeRO-3 job runs them together.
    Pass ``device`` (the compute device) when parameters may live elsewhere (ZeRO-3
    parameter offload); ``forward`` replaces :func:`forward_logps` for the packed row
    (sequence parallelism runs it split over its group; the eager side runs whole).
    """
    if not sequences_pairs:
        raise ValueError("packing_exactness needs at least one pair")
    parameter = next(model.parameters())
    device = parameter.device if device is None else torch.device(device)
    index = list(range(len(sequences_pairs)))
    padded = collate_padded(sequences_pairs, index, pad_token_id).to(device)
    half = parameter.dtype in (torch.bfloat16, torch.float16)
    with torch.no_grad(), evaluating(model):
        collate = collate_shared if shared_prefix else collate_packed
        packed = forward(model, collate(sequences_pairs, index, pad_token_id).to(device), attn)
        alone = each_sequence_alone(model, padded)
        floor = noise_floor_per_token(model, padded, alone, packed.tokens) if half and tolerance is None else None
    abs_diff = (packed.logps.double() - alone).abs()
    per_token = abs_diff / packed.tokens.double().clamp_min(1.0)
    if tolerance is None:
        tolerance = max(tolerance_per_token(parameter.dtype), NOISE_FACTOR * (floor or 0.0))
    return {
        "attn": attn,
        "layout": "shared-prefix" if shared_prefix else "packed",
        "reference": f"{REFERENCE_ATTN}, one sequence at a time",
        "pairs": len(sequences_pairs),
        "dtype": str(parameter.dtype).removeprefix("torch."),
        "longest_sequence": int(padded.attention_mask.sum(dim=1).max()),
        "sliding_window": sliding_window_of(hf_model(model).config),
        "max_abs_diff_logps": float(abs_diff.max()),
        "max_diff_per_token": float(per_token.max()),
        "tolerance_per_token": float(tolerance),
        "noise_floor_per_token": floor,  # half precision: sdpa vs eager, each alone (None otherwise)
        "ok": bool(per_token.max() <= tolerance),  # False for NaN too
    }


def assert_packing_exact(model, attn: str, vocab_size: int, pad_token_id: int, device=None,
                         forward=forward_logps, shared_prefix: bool = False) -> dict:
    """The start-up guard: one fixed synthetic pair (two sequences beyond any window), identical on every rank; with
    ``shared_prefix`` laid out as the run lays out its rows, the prompt once."""
    result = packing_exactness(model, guard_pairs(model, vocab_size), attn, pad_token_id, device, forward=forward,
                               shared_prefix=shared_prefix)
    if not result["ok"]:
        floor = result["noise_floor_per_token"]
        noise = "" if floor is None else f", {NOISE_FACTOR:g} x the sdpa-vs-eager noise floor {floor:.3g} or more"
        what, way_out = (("prefix-shared rows", "--no-prefix-sharing") if shared_prefix
                         else ("packed rows", "another --attn (e.g. eager) or --no-packing"))
        raise PackingNotExactError(
            f"--attn {attn}: {what} are not exact with this model/backend/version: per-sequence log-probs of a "
            f"{what[:-1]} differ from each sequence alone with eager attention by {result['max_diff_per_token']:.3g} "
            f"per token (tolerance {result['tolerance_per_token']:.3g}, {result['dtype']}{noise}); sequences would attend "
            f"across their boundaries or beyond their sliding window - use {way_out}")
    return result
