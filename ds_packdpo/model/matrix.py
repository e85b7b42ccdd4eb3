"""The architecture matrix check: a backend's packed log-probs and gradients against each sequence alone, eager.

For one tiny model of :data:`build.ARCHITECTURES` and one backend: either phase one refuses
the pair (:func:`attention.check_model_attention`, what transformers would refuse later),
or the per-sequence log-probs of a packed row, and the gradients of a loss of them, are
compared with those of every sequence run alone with transformers' eager attention, on
sequences longer than the model's sliding window.  The tests (CPU, fp32), the README's
table (``scripts/arch_matrix.py``) and the GPU check (flash-attn, bf16) all run this.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from ..errors import InputError
from .attention import check_model_attention, sliding_window_of
from .build import SLIDING_WINDOW, build_model, tiny_config
from ..data.plan import RowLayout
from .collate import COLLATE, collate_padded
from .guard import synthetic_pairs
from .logps import forward_logps

VOCAB = 256


def matrix_pairs(num_pairs: int = 2) -> list[dict]:
    """Pairs whose every sequence is longer than the matrix's sliding window (prompts alone exceed it)."""
    return synthetic_pairs(num_pairs, VOCAB, seed=2, max_tokens=12, min_prompt_tokens=SLIDING_WINDOW + 2)


def matrix_group_pairs(num_pairs: int = 2) -> list[dict]:
    """:func:`matrix_pairs` and, per prompt, every pair more that its responses and the next pair's make (all
    responses of a group differ; one response in up to three pairs): prompt groups of three responses."""
    base = matrix_pairs(num_pairs)
    pairs = list(base)
    for pair, other in zip(base, base[1:] + base[:1]):
        third = other["chosen_ids"]
        pairs += [{"prompt_ids": pair["prompt_ids"], "chosen_ids": pair["chosen_ids"], "rejected_ids": third},
                  {"prompt_ids": pair["prompt_ids"], "chosen_ids": third, "rejected_ids": pair["rejected_ids"]}]
    return pairs


def _pairs(num_pairs: int, grouped: bool) -> list[dict]:
    return matrix_group_pairs(num_pairs) if grouped else matrix_pairs(num_pairs)


def _weights(count: int, device) -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, count, device=device)  # a loss of every sequence's log-prob, signs mixed


def _model(arch: str, attn: str, dtype: torch.dtype, device: str):
    return build_model(None, f"tiny-{arch}", VOCAB, dtype, attn, seed=0).to(device)


@functools.cache
def eager_alone(arch: str, dtype: torch.dtype = torch.float32, device: str = "cpu", num_pairs: int = 2,
                grouped: bool = False):
    """(log-probs [S] in fp64, parameter gradients, sequence lengths) with every sequence of every pair alone,
    eager (``grouped``: the pairs of :func:`matrix_group_pairs`)."""
    model = _model(arch, "eager", dtype, device)
    pairs = _pairs(num_pairs, grouped)
    padded = collate_padded(pairs, list(range(len(pairs))), 0).to(device)
    weights = _weights(padded.num_sequences, device)
    logps = torch.zeros(padded.num_sequences, dtype=torch.float64, device=device)
    for row, length in enumerate(padded.attention_mask.sum(dim=1).tolist()):
        cut = (slice(row, row + 1), slice(0, length))
        alone = dataclasses.replace(padded, input_ids=padded.input_ids[cut], position_ids=padded.position_ids[cut],
                                    attention_mask=None, labels=padded.labels[cut], seq_index=padded.seq_index[cut],
                                    cu_seqlens=None, max_seqlen=length)
        result = forward_logps(model, alone, "eager").logps
        (result * weights).sum().backward()  # the gradients accumulate over the sequences
        logps += result.detach().double()
    grads = [p.grad.float().clone() for p in model.parameters()]
    return logps, grads, padded.attention_mask.sum(dim=1).cpu()


def matrix_outcome(arch: str, attn: str, dtype: torch.dtype = torch.float32, device: str = "cpu",
                   num_pairs: int = 2, layout: RowLayout = RowLayout.PACKED) -> dict:
    """``{"verdict": "refused", "message"}`` or ``{"verdict": "measured", ...}``: the largest log-prob difference
    (absolute, on sums), per completion token, and the largest gradient difference with the gradients' scale.
    The row is collated in ``layout``; the prompt-groups layout runs the pairs of :func:`matrix_group_pairs`, each
    response once, against each pair alone."""
    config = tiny_config(arch, vocab_size=VOCAB)
    try:
        check_model_attention(config, attn, f"--model-config tiny-{arch}")
    except InputError as error:
        return {"arch": arch, "attn": attn, "verdict": "refused", "message": str(error)}
    model = _model(arch, attn, dtype, device)
    grouped = layout.groups_prompts
    pairs = _pairs(num_pairs, grouped)
    packed = COLLATE[layout](pairs, list(range(len(pairs))), 0).to(device)
    result = forward_logps(model, packed, attn)  # per pair: 2p chosen, 2p + 1 rejected, in every layout
    (result.logps * _weights(2 * packed.num_pairs, device)).sum().backward()
    grads = [p.grad.float() for p in model.parameters()]
    want_logps, want_grads, lengths = eager_alone(arch, dtype, device, num_pairs, grouped)
    diff = (result.logps.detach().double() - want_logps).abs()
    return {"arch": arch, "attn": attn, "verdict": "measured", "dtype": str(dtype).removeprefix("torch."),
            "sliding_window": sliding_window_of(config), "shortest_sequence": int(lengths.min()),
            "logps_diff": float(diff.max()), "diff_per_token": float((diff / result.tokens.double()).max()),
            "grad_diff": max(float((g - w).abs().max()) for g, w in zip(grads, want_grads, strict=True)),
            "grad_scale": max(float(w.abs().max()) for w in want_grads)}
