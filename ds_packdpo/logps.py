"""Per-sequence completion log-probs out of one (packed or padded) forward.

The logits of a packed row are ``[T, V]`` with T up to the row budget and V up to
~150k: an fp32 ``log_softmax`` beside them (and its saved copy for backward) would
cost more memory than the model.  So the log-prob of each completion token is
computed as ``logit[label] - logsumexp(logits)`` over chunks of ``chunk_tokens``
rows, and a hand-written autograd function recomputes the softmax chunk by chunk
in backward instead of keeping it (torch has no fused "log-prob at label" op; a
``checkpoint`` per chunk would allocate a full ``[T, V]`` gradient per chunk).
Token log-probs are then summed per sequence with one ``index_add`` over the
sequence index - no loop over sequences.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .attention import model_forward_kwargs

if TYPE_CHECKING:
    from .collate import ModelBatch

__all__ = ["SequenceLogps", "sequence_logps", "model_forward_kwargs", "forward_logps", "completion_token_logps"]


@dataclass
class SequenceLogps:
    """Per-sequence sums in canonical order: sequence 2p is the chosen of pair p, 2p+1 its rejected."""

    logps: torch.Tensor       # [S] float32, sum of completion-token log-probs (differentiable)
    tokens: torch.Tensor      # [S] float32, completion token counts
    logits_sum: torch.Tensor  # [S] float32, sum over completion tokens of logits.mean(-1) (detached)

    @property
    def chosen_logps(self) -> torch.Tensor:
        return self.logps[0::2]

    @property
    def rejected_logps(self) -> torch.Tensor:
        return self.logps[1::2]

    @property
    def chosen_tokens(self) -> torch.Tensor:
        return self.tokens[0::2]

    @property
    def rejected_tokens(self) -> torch.Tensor:
        return self.tokens[1::2]

    @property
    def chosen_logits_sum(self) -> torch.Tensor:
        return self.logits_sum[0::2]

    @property
    def rejected_logits_sum(self) -> torch.Tensor:
        return self.logits_sum[1::2]


class _LabelLogProb(torch.autograd.Function):
    """log_softmax(logits)[row, target] and logits[row].mean() for selected rows, chunked.

    Saves only the logits (which the graph holds anyway) and one logsumexp per
    selected token; backward writes ``g * (onehot - softmax)`` chunk by chunk into
    a single gradient buffer.
    """

    @staticmethod
    def forward(ctx, logits_2d, rows, targets, chunk_tokens):
        count = rows.numel()
        token_logps = logits_2d.new_empty(count, dtype=torch.float32)
        logsumexp = logits_2d.new_empty(count, dtype=torch.float32)
        mean_logit = logits_2d.new_empty(count, dtype=torch.float32)
        for start in range(0, count, chunk_tokens):
            span = slice(start, start + chunk_tokens)
            chunk = logits_2d.index_select(0, rows[span]).float()
            logsumexp[span] = torch.logsumexp(chunk, dim=-1)
            token_logps[span] = chunk.gather(1, targets[span, None]).squeeze(1) - logsumexp[span]
            mean_logit[span] = chunk.mean(dim=-1)
        ctx.save_for_backward(logits_2d, rows, targets, logsumexp)
        ctx.chunk_tokens = chunk_tokens
        ctx.mark_non_differentiable(mean_logit)
        return token_logps, mean_logit

    @staticmethod
    def backward(ctx, grad_token_logps, _grad_mean_logit):
        logits_2d, rows, targets, logsumexp = ctx.saved_tensors
        grad = torch.zeros_like(logits_2d)
        grad_token_logps = grad_token_logps.float()
        for start in range(0, rows.numel(), ctx.chunk_tokens):
            span = slice(start, start + ctx.chunk_tokens)
            g = grad_token_logps[span, None]
            chunk_grad = (logits_2d.index_select(0, rows[span]).float() - logsumexp[span, None]).exp_().mul_(-g)
            chunk_grad.scatter_add_(1, targets[span, None], g)
            grad.index_copy_(0, rows[span], chunk_grad.to(grad.dtype))  # each row is selected once
        return grad, None, None, None


def completion_token_logps(logits: torch.Tensor, labels: torch.Tensor, chunk_tokens: int = 4096):
    """Log-probs and vocab-mean logits of the positions whose label is not -100, flattened.

    Returns ``(rows, token_logps, mean_logit)`` with ``rows`` the flat positions.
    ``nonzero`` syncs once per call; it buys computing only completion tokens.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    logits_2d = logits.reshape(-1, logits.shape[-1])
    flat_labels = labels.reshape(-1)
    rows = (flat_labels != -100).nonzero().squeeze(1)
    token_logps, mean_logit = _LabelLogProb.apply(logits_2d, rows, flat_labels[rows], chunk_tokens)
    return rows, token_logps, mean_logit


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor, seq_index: torch.Tensor, num_sequences: int,
                   chunk_tokens: int = 4096) -> SequenceLogps:
    """Per-sequence sums of completion-token log-probs; ``logits`` [N, L, V], labels/seq_index [N, L]."""
    rows, token_logps, mean_logit = completion_token_logps(logits, labels, chunk_tokens)
    seq = seq_index.reshape(-1)[rows]
    zeros = torch.zeros(num_sequences, dtype=torch.float32, device=logits.device)
    return SequenceLogps(
        logps=zeros.index_add(0, seq, token_logps),
        tokens=zeros.index_add(0, seq, torch.ones_like(token_logps)),
        logits_sum=zeros.index_add(0, seq, mean_logit),
    )


def forward_logps(model, batch: ModelBatch, attn: str, chunk_tokens: int = 4096) -> SequenceLogps:
    """One forward of ``model`` (an nn.Module or a DeepSpeed engine) on ``batch``, reduced per sequence."""
    output = model(**model_forward_kwargs(batch, attn))
    return sequence_logps(output.logits, batch.labels, batch.seq_index, batch.num_sequences, chunk_tokens)
