"""Per-sequence completion log-probs out of one (packed or padded) forward.

Two implementations, one result:

* ``plain``: the model's full logits ``[T, V]``, then the log-prob of each
  completion token as ``logit[label] - logsumexp(logits)`` over chunks of rows
  (:class:`_LabelLogProb`).  The logits and their gradient are whole ``[T, V]``
  tensors: 8 GB each for 16k tokens at a 128k vocabulary in fp32.
* ``lean`` (default): the model runs without logits (``logits_to_keep`` selects no
  position) and returns its final hidden states; :class:`_LeanLabelLogProb` applies
  the lm_head to the completion positions only, a chunk at a time, keeps one
  logsumexp per token, and recomputes each chunk's logits in backward.  At most one
  chunk of logits and its gradient exist at any time; the price is one extra
  lm_head matmul (the recomputation).  Under ZeRO-3 the head weight is gathered
  once per forward and once per backward, not once per chunk.

Each token's log-prob comes out in fp64 (:func:`_target_logps`; the logits stay fp32) and
the token log-probs are summed per sequence with one ``index_add`` over the
sequence index - no loop over sequences.  The sums are accumulated and KEPT in fp64 up to the
loss: a 16k-token sum is ~1e5 nats, whose fp32 spacing (8e-3) dwarfs the DPO margin's
exactness, and the margin subtracts four of them.  The scored tokens of a row
(:func:`scored_tokens`) are its labelled positions plus, in a prefix-shared row, each
prompt's last position once more for the rejected completion's first token: one hidden
state, two targets, still no ``[T, V]`` logits.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch.profiler import record_function

from ..console import say_warning_once
from ..errors import InputError
from . import fused_logps
from .attention import model_forward_kwargs
from .fused_logps import FUSED, fused_token_logps
from .lora import hf_model, split_head
from .token_weights import TokenWeighting, length_desensitized_sums

if TYPE_CHECKING:
    from .collate import ModelBatch

__all__ = ["SequenceLogps", "TokenLogps", "sequence_logps", "model_forward_kwargs", "forward_logps",
           "completion_token_logps", "lean_token_logps", "lean_lm_head", "final_logit_softcap", "scored_tokens",
           "auto_chunk_tokens", "LOGPS_IMPLEMENTATIONS", "resolve_logps_impl", "AUTO_CHUNK", "pair_ordered",
           "TokenWeighting"]


@dataclass
class SequenceLogps:
    """Per-sequence sums in canonical order: sequence 2p is the chosen of pair p, 2p+1 its rejected.

    All fp64 (see the module docstring): a few numbers per sequence, so the loss's four-way difference is exact
    at any length."""

    logps: torch.Tensor       # [S] float64, sum of completion-token log-probs (differentiable); LD-weighted with
                              # --ld-alpha (model/token_weights.py)
    tokens: torch.Tensor      # [S] float64, completion token counts
    logits_sum: torch.Tensor  # [S] float64, sum over completion tokens of logits.mean(-1) (detached)
    plain_logps: torch.Tensor | None = None  # [S] float64, the unweighted sum when ``logps`` is LD-weighted
    wpo_sum: torch.Tensor | None = None  # [S] float64, sum of log p_t - log sum_v p_v^2 (WPO; detached)
    entropy_sum: torch.Tensor | None = None  # [S] float64, sum over completion tokens of the entropy (detached)
    top1_sum: torch.Tensor | None = None  # [S] float64, completion tokens whose target is the argmax (detached)

    @property
    def unweighted_logps(self) -> torch.Tensor:
        """The plain sum of the completion's token log-probs (what sft and the RPO term use), LD weighting or not."""
        return self.logps if self.plain_logps is None else self.plain_logps

    def mapped(self, fn) -> SequenceLogps:
        """Every per-sequence field (those present) through ``fn``."""
        return SequenceLogps(**{f.name: None if getattr(self, f.name) is None else fn(getattr(self, f.name))
                                for f in dataclasses.fields(self)})

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


class TokenLogps(NamedTuple):
    """What a log-prob kernel gives for each scored token (each implementation alike)."""

    logps: torch.Tensor  # [N] float64, log-prob of the target (differentiable)
    mean_logit: torch.Tensor  # [N] float32, the vocabulary-mean logit (TRL's logits/* metric; detached)
    log_sum_sq: torch.Tensor | None = None  # [N] float64, WPO's log sum_v p_v^2 when asked for
    stats: torch.Tensor | None = None  # [N, 2] float64, entropy and target-is-argmax when asked for (not fused)


def _target_logps(logits: torch.Tensor, targets: torch.Tensor, squares: bool = False, stats: bool = False):
    """(fp64 log-prob of each target, fp32 logsumexp for the backward, fp32 vocab-mean logit, fp64
    ``log sum_v p_v^2`` with ``squares`` else None, fp64 ``[C, 2]`` entropy and target-is-argmax with ``stats``
    else None) of fp32 logits ``[C, V]``, which it overwrites (the exp is taken in place: one ``[C, V]`` buffer
    per chunk, not two).

    The row max and the target logit are exact in fp64; the sum of ``exp(logit - max)`` stays fp32 (it lies in
    [1, V], relative error ~1e-8) and its log is taken in fp64.  Rounding the ~10-nat result to fp32 per token
    instead cost 6e-6 nats per 512-token sum and 4e-5 per 16k-token one (random fp32 logits, V=1024, against an
    fp64 log_softmax); this costs 1.3e-6 and 1.5e-6 there, and no ``[C, V]`` tensor is ever fp64.
    WPO's ``log sum_v p_v^2 = log sum e^2 - 2 log sum e`` with ``e = exp(logit - max)`` (the max cancels): one
    more reduction of the same buffer (a norm: no second ``[C, V]`` tensor).
    TRL's ``entropy`` and ``mean_token_accuracy`` metrics (``stats``, the policy's forward only): the entropy is
    ``log sum e - sum(e (z - max)) / sum e`` (a copy of ``z - max`` kept through the in-place exp: one temporary
    ``[C, V]`` tensor, forward only; cheaper than ``xlogy(e, e)``, whose log cost 12% more here), the argmax comes
    with the row max.
    """
    target = logits.gather(1, targets[:, None]).squeeze(1).double()
    mean_logit = logits.mean(dim=-1)
    peak, top = logits.max(dim=-1, keepdim=True)
    logits.sub_(peak)
    centred = logits.clone() if stats else None
    shifted = logits.exp_()
    total = shifted.sum(dim=-1).double()
    log_total = total.log()
    logsumexp = peak.squeeze(1).double() + log_total
    log_sum_sq = token_stats = None
    if squares:
        log_sum_sq = torch.linalg.vector_norm(shifted, dim=-1).double().log_().mul_(2) - 2 * log_total
    if stats:
        entropy = log_total - torch.linalg.vecdot(shifted, centred).double() / total
        token_stats = torch.stack([entropy, (top.squeeze(1) == targets).double()], dim=1)
    return target - logsumexp, logsumexp.float(), mean_logit, log_sum_sq, token_stats


def _squares_buffer(like: torch.Tensor, count: int, squares: bool) -> torch.Tensor | None:
    """The fp64 per-token ``log sum_v p_v^2`` of a kernel asked for WPO's statistic, else None."""
    return like.new_empty(count, dtype=torch.float64) if squares else None


def _stats_buffer(like: torch.Tensor, count: int, stats: bool) -> torch.Tensor | None:
    """The fp64 per-token ``[entropy, target is the argmax]`` of a kernel asked for them, else None."""
    return like.new_empty(count, 2, dtype=torch.float64) if stats else None


def _fill_chunk(outputs, span, results) -> None:
    """Writes one chunk's :func:`_target_logps` results into the kernel's per-token buffers (None: not asked)."""
    for buffer, values in zip(outputs, results):
        if buffer is not None:
            buffer[span] = values


class _LabelLogProb(torch.autograd.Function):
    """log_softmax(logits)[row, target] and logits[row].mean() for selected rows, chunked.

    Saves only the logits (which the graph holds anyway) and one logsumexp per
    selected token; backward writes ``g * (onehot - softmax)`` chunk by chunk into
    a single gradient buffer.
    """

    @staticmethod
    def forward(ctx, logits_2d, rows, targets, chunk_tokens, squares=False, stats=False):
        count = rows.numel()
        token_logps = logits_2d.new_empty(count, dtype=torch.float64)
        logsumexp = logits_2d.new_empty(count, dtype=torch.float32)
        mean_logit = logits_2d.new_empty(count, dtype=torch.float32)
        extras = (_squares_buffer(logits_2d, count, squares), _stats_buffer(logits_2d, count, stats))
        for start in range(0, count, chunk_tokens):
            span = slice(start, start + chunk_tokens)
            chunk = logits_2d.index_select(0, rows[span]).float()
            _fill_chunk((token_logps, logsumexp, mean_logit, *extras), span,
                        _target_logps(chunk, targets[span], squares, stats))
        ctx.save_for_backward(logits_2d, rows, targets, logsumexp)
        ctx.chunk_tokens = chunk_tokens
        ctx.mark_non_differentiable(*(t for t in (mean_logit, *extras) if t is not None))
        return token_logps, mean_logit, *extras

    @staticmethod
    def backward(ctx, grad_token_logps, _grad_mean_logit, _grad_log_sum_sq, _grad_stats):
        logits_2d, rows, targets, logsumexp = ctx.saved_tensors
        grad = torch.zeros_like(logits_2d)
        grad_token_logps = grad_token_logps.float()
        for start in range(0, rows.numel(), ctx.chunk_tokens):
            span = slice(start, start + ctx.chunk_tokens)
            g = grad_token_logps[span, None]
            chunk_grad = logits_2d.index_select(0, rows[span]).float().sub_(logsumexp[span, None]).exp_().mul_(-g)
            chunk_grad.scatter_add_(1, targets[span, None], g)
            grad.index_add_(0, rows[span], chunk_grad.to(grad.dtype))  # a prompt's last row is scored twice when shared
        return grad, None, None, None, None, None


def completion_token_logps(logits: torch.Tensor, labels: torch.Tensor, chunk_tokens: int = 4096):
    """Log-probs and vocab-mean logits of the positions whose label is not -100, flattened.

    Returns ``(rows, token_logps, mean_logit)`` with ``rows`` the flat positions.
    ``nonzero`` syncs once per call; it buys computing only completion tokens.
    """
    flat_labels = labels.reshape(-1)
    rows = (flat_labels != -100).nonzero().squeeze(1)
    scored = _plain_logps_at(logits, rows, flat_labels[rows], chunk_tokens)
    return rows, scored.logps, scored.mean_logit


def _plain_logps_at(logits: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor, chunk_tokens: int,
                    squares: bool = False, stats: bool = False) -> TokenLogps:
    """The :class:`TokenLogps` of ``targets`` at the flat positions ``rows`` of ``logits`` [..., V] (a row may
    repeat): WPO's term with ``squares``, the entropy and argmax hits with ``stats``."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    return TokenLogps(*_LabelLogProb.apply(logits.reshape(-1, logits.shape[-1]), rows, targets, chunk_tokens, squares,
                                           stats))


def _per_sequence(seq, scored: TokenLogps, num_sequences: int) -> SequenceLogps:
    """Sums per canonical sequence (``seq``: the sequence of each scored token), accumulated and returned in fp64:
    ``index_add`` adds token by token, and in fp32 a 4,000-nat sum drifted by up to 1.5e-3 nats that way (the
    layouts add a sequence's tokens in different orders); rounding the fp64 sum to fp32 afterwards still cost
    2.6e-4 nats at 512 tokens.  The gradient flows back to the fp32 token log-probs through the cast.  With
    ``log_sum_sq`` (WPO) also the detached sums of ``log p_t - log sum_v p_v^2``; with ``stats`` those of the
    entropy and of the argmax hits."""
    zeros = torch.zeros(num_sequences, dtype=torch.float64, device=scored.logps.device)

    def summed(values: torch.Tensor) -> torch.Tensor:
        return zeros.index_add(0, seq, values.double())

    wpo_sum = None if scored.log_sum_sq is None else summed(scored.logps.detach().double() - scored.log_sum_sq)
    entropy_sum, top1_sum = (None, None) if scored.stats is None else (summed(scored.stats[:, 0]),
                                                                       summed(scored.stats[:, 1]))
    return SequenceLogps(logps=summed(scored.logps), tokens=summed(torch.ones_like(scored.logps)),
                         logits_sum=summed(scored.mean_logit), wpo_sum=wpo_sum, entropy_sum=entropy_sum,
                         top1_sum=top1_sum)


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor, seq_index: torch.Tensor, num_sequences: int,
                   chunk_tokens: int = 4096) -> SequenceLogps:
    """Per-sequence sums of completion-token log-probs; ``logits`` [N, L, V], labels/seq_index [N, L]."""
    rows, token_logps, mean_logit = completion_token_logps(logits, labels, chunk_tokens)
    return _per_sequence(seq_index.reshape(-1)[rows], TokenLogps(token_logps, mean_logit), num_sequences)


# ----------------------------------------------------------------------------- lean: no [T, V] logits
AUTO_CHUNK = "auto"
# The chunk's logits and gradient may take this share of the stage's floor (:func:`auto_chunk_tokens`); chosen on
# scripts/bench_logps.py (README, "Lean log-probs").
AUTO_CHUNK_FRACTION = 0.5
# Config keys of architectures whose forward rescales the lm_head output (Cohere, Granite): the lean path applies
# the lm_head itself and would skip that, so those models take the plain path.  Gemma 2/3's final soft-cap
# (``final_logit_softcapping``) the lean path applies itself (:func:`final_logit_softcap`).
_LOGIT_POSTPROCESSING = ("logit_scale", "logits_scaling", "output_multiplier_scale")


def lean_lm_head(model) -> torch.nn.Module | None:
    """The lm_head (a linear layer, or one with a LoRA adapter) when the lean path computes exactly the model's
    logits, else None (take the plain path)."""
    lm = hf_model(model)
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    linear = split_head(head)[0] if head is not None else None
    if not isinstance(linear, torch.nn.Linear) or "logits_to_keep" not in inspect.signature(lm.forward).parameters:
        return None
    config = getattr(lm, "config", None)
    if any(getattr(config, key, None) not in (None, 1, 1.0) for key in _LOGIT_POSTPROCESSING):
        return None
    return head


def final_logit_softcap(model) -> float | None:
    """The model's final logit soft-cap (Gemma 2/3: logits = cap * tanh(logits / cap)), or None."""
    cap = getattr(getattr(hf_model(model), "config", None), "final_logit_softcapping", None)
    return float(cap) if cap else None


def _capped(logits: torch.Tensor, softcap: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logits soft-capped as the model's forward caps them, tanh(logits / cap) for the backward) - or unchanged."""
    if softcap is None:
        return logits, None
    squashed = torch.tanh(logits / softcap)
    return squashed * softcap, squashed


def _as_head_call(head: torch.nn.Linear, fn, *args):
    """``fn(*args)`` run as one call of the ``head`` module, so that every hook on the module treats it as one.

    Under ZeRO-3 that is one all-gather of the partitioned head weight before it and a release after, and in
    backward one more gather, the weight gradient accumulated while the weight is whole (autograd needs it at
    its full shape) and reduce-scattered by ZeRO's gradient hook, then a release - for the whole row,
    however many chunks ``fn`` makes.  A module's hooks cannot be had without calling the module, hence the
    temporary ``forward`` (an instance attribute, which ``nn.Module.__call__`` looks up first).
    """
    own = head.__dict__.get("forward")  # e.g. accelerate's hook, kept
    head.forward = fn
    try:
        return head(*args)
    finally:
        if own is None:
            del head.forward  # the class's forward again
        else:
            head.forward = own


class _LeanLabelLogProb(torch.autograd.Function):
    """log_softmax(hidden @ W.T + b + low_in @ U.T)[i, target_i] and the vocab-mean logit, chunk by chunk,
    recomputed in backward.

    ``low_in @ U.T`` is the low-rank term of a LoRA adapter on the head (``low_in`` the scaled down-projection of
    the hidden states, ``U`` the up-projection; both None without one).  Applied inside one call of the head
    module, and of its adapter's up-projection (:func:`_as_head_call`), with their weights and bias as inputs:
    under ZeRO-3 they are whole in forward and again in backward, which computes the gradients of the hidden
    states, the weights and the bias chunk by chunk itself and returns each weight gradient once per row (only
    those asked for: a frozen base head gets none); autograd accumulates them (summed with the input
    embedding's, for a tied weight) and ZeRO-3's gradient hook reduce-scatters them.  No collective runs inside
    the chunk loop, so ranks with different chunk counts stay in step.  Saved for backward: the selected hidden
    states, the low-rank inputs and one logsumexp per token; at most one chunk of logits (and its gradient)
    exists at a time.  ``softcap`` (Gemma) caps each chunk's logits in fp32 as the model's forward would, and
    backward multiplies through the cap's derivative.
    """

    @staticmethod
    def forward(ctx, hidden, targets, weight, bias, low_in, low_weight, head, low_head, spans, softcap,
                squares=False, stats=False):
        count = hidden.shape[0]
        token_logps = hidden.new_empty(count, dtype=torch.float64)
        logsumexp = hidden.new_empty(count, dtype=torch.float32)
        mean_logit = hidden.new_empty(count, dtype=torch.float32)
        extras = (_squares_buffer(hidden, count, squares), _stats_buffer(hidden, count, stats))
        for span in spans:
            logits, _ = _capped(_chunk_logits(hidden[span], weight, bias, low_in, low_weight, span), softcap)
            _fill_chunk((token_logps, logsumexp, mean_logit, *extras), span,
                        _target_logps(logits, targets[span], squares, stats))
        ctx.save_for_backward(hidden, targets, logsumexp, low_in)
        ctx.head, ctx.low_head, ctx.spans, ctx.softcap = head, low_head, spans, softcap
        ctx.mark_non_differentiable(*(t for t in (mean_logit, *extras) if t is not None))
        return token_logps, mean_logit, *extras

    @staticmethod
    def backward(ctx, grad_token_logps, _grad_mean_logit, _grad_log_sum_sq, _grad_stats):
        hidden, targets, logsumexp, low_in = ctx.saved_tensors
        want_hidden, _, want_weight, want_bias, want_low_in, want_low_weight = ctx.needs_input_grad[:6]
        grad_token_logps = grad_token_logps.float()
        weight, bias = ctx.head.weight, ctx.head.bias  # whole again: ZeRO-3 gathered them for the head's backward
        low_weight = ctx.low_head.weight if ctx.low_head is not None else None
        grad_hidden = torch.zeros_like(hidden) if want_hidden else None
        grad_weight = torch.zeros_like(weight) if want_weight else None
        grad_bias = torch.zeros_like(bias) if want_bias else None
        grad_low_in = torch.zeros_like(low_in) if want_low_in else None
        grad_low_weight = torch.zeros_like(low_weight) if want_low_weight else None
        for span in ctx.spans:
            chunk = hidden[span]
            g = grad_token_logps[span, None]
            logits, squashed = _capped(_chunk_logits(chunk, weight, bias, low_in, low_weight, span), ctx.softcap)
            grad_logits = logits.sub_(logsumexp[span, None]).exp_().mul_(-g)  # in place: one [C, V] buffer
            grad_logits = grad_logits.scatter_add_(1, targets[span, None], g)
            if squashed is not None:  # d(cap * tanh(x / cap)) / dx = 1 - tanh(x / cap)^2
                grad_logits = grad_logits.mul_(1 - squashed.square_())
            grad_logits = grad_logits.to(weight.dtype)
            if want_hidden:
                grad_hidden[span] = grad_logits @ weight
            if want_weight:
                grad_weight.addmm_(grad_logits.T, chunk)
            if want_bias:
                grad_bias += grad_logits.sum(dim=0)
            if want_low_in:
                grad_low_in[span] = grad_logits @ low_weight
            if want_low_weight:
                grad_low_weight.addmm_(grad_logits.T, low_in[span])
        return (grad_hidden, None, grad_weight, grad_bias, grad_low_in, grad_low_weight, None, None, None, None, None,
                None)


def _chunk_logits(chunk, weight, bias, low_in, low_weight, span) -> torch.Tensor:
    """One chunk's fp32 logits: the head's linear map, plus its adapter's low-rank term when there is one."""
    logits = torch.nn.functional.linear(chunk, weight, bias)
    if low_in is not None:
        logits = logits.addmm(low_in[span], low_weight.T)
    return logits.float()


def lean_token_logps(hidden: torch.Tensor, labels: torch.Tensor, head: torch.nn.Module, chunk_tokens: int = 4096,
                     softcap: float | None = None):
    """Like :func:`completion_token_logps`, from final hidden states ``[N, L, H]`` and the lm_head (a linear
    layer, or one with a LoRA adapter: its down-projection runs as a module, its up-projection joins the chunks),
    its output soft-capped at ``softcap`` first, as Gemma's forward does."""
    flat_labels = labels.reshape(-1)
    rows = (flat_labels != -100).nonzero().squeeze(1)
    scored = _lean_logps_at(hidden, rows, flat_labels[rows], head, chunk_tokens, softcap)
    return rows, scored.logps, scored.mean_logit


def _lean_logps_at(hidden: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor, head: torch.nn.Module,
                   chunk_tokens: int, softcap: float | None = None, squares: bool = False,
                   stats: bool = False) -> TokenLogps:
    """The :class:`TokenLogps` of ``targets`` from the hidden states at the flat positions ``rows`` (a row may
    repeat: its gradient is summed by ``index_select``'s backward), the logits soft-capped at ``softcap``."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    selected = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows)
    spans = [slice(start, start + chunk_tokens) for start in range(0, rows.numel(), chunk_tokens)]
    base, adapter = split_head(head)
    if adapter is None:
        return TokenLogps(*_as_head_call(
            base, lambda x, y: _LeanLabelLogProb.apply(x, y, base.weight, base.bias, None, None, base, None, spans,
                                                       softcap, squares, stats),
            selected, targets))
    low_in = adapter.down(adapter.dropout(selected)) * adapter.scaling
    up = adapter.up

    def with_adapter(x, y, z):  # inside the base head's call: the adapter's up-projection is whole too
        return _as_head_call(up, lambda x2, y2, z2: _LeanLabelLogProb.apply(x2, y2, base.weight, base.bias, z2,
                                                                             up.weight, base, up, spans, softcap,
                                                                             squares, stats),
                             x, y, z)

    return TokenLogps(*_as_head_call(base, with_adapter, selected, targets, low_in))


def scored_tokens(batch: ModelBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(flat position, target token, canonical sequence) of every scored token of ``batch``: the labelled
    positions, and in a prefix-shared row each prompt's last position again for its rejected completion
    (``fork_labels``, sequence ``seq_index + 1``).  One ``nonzero`` (one device sync)."""
    labels = batch.labels.reshape(1, -1)
    if batch.fork_labels is not None:  # row f: the first token of the group's response f + 2
        labels = torch.cat([labels, batch.fork_labels.reshape(-1, labels.shape[1])])
    fork, rows = (labels != -100).nonzero(as_tuple=True)
    return rows, labels[fork, rows], batch.seq_index.reshape(-1)[rows] + fork


def _final_hidden_states(model, batch: ModelBatch, attn: str) -> torch.Tensor:
    """The hidden states after the final norm, with the model's lm_head applied to no position at all."""
    no_position = torch.zeros(0, dtype=torch.long, device=batch.input_ids.device)
    output = model(**model_forward_kwargs(batch, attn), logits_to_keep=no_position, output_hidden_states=-1)
    return output.hidden_states[-1]


def auto_chunk_tokens(row_tokens: int, hidden_size: int, vocab_size: int, hidden_bytes: int,
                      fraction: float = AUTO_CHUNK_FRACTION) -> int:
    """The largest chunk whose fp32 logits and their gradient (``2 x chunk x V x 4`` bytes) stay under
    ``fraction`` of the stage's floor: what it holds whatever the chunk, the row's final hidden states and the
    lm_head's weight gradient, ``(T + V) x H`` elements of the model's dtype.  At least one token.

    The floor is the memory the stage cannot go below (a fused kernel holds it too), so sizing the chunk from it
    keeps the chunks' share of the peak bounded at any length, vocabulary and width: a fixed 1024 tokens' logits
    and gradient (262 MB at a 32k vocabulary) were 3.2x the floor of an 8k-token row of width 512.
    """
    floor_bytes = (row_tokens + vocab_size) * hidden_size * hidden_bytes
    return max(1, int(fraction * floor_bytes) // (2 * vocab_size * 4))


def _chunk_for(chunk_tokens: int | str, model, batch: ModelBatch) -> int:
    """``chunk_tokens``, or for ``"auto"`` :func:`auto_chunk_tokens` of this row and this model."""
    if chunk_tokens != AUTO_CHUNK:
        return chunk_tokens
    lm = hf_model(model)
    config = lm.config.get_text_config()
    return auto_chunk_tokens(batch.input_ids.numel(), config.hidden_size, config.vocab_size,
                             torch.empty((), dtype=lm.dtype).element_size())


# ----------------------------------------------------------------------------- the implementations
LEAN, PLAIN, AUTO = "lean", "plain", "auto"
LOGPS_SCOPE = "ds_packdpo.logps"  # the profiler's range around the head and reduction (run/profile_categories.py)


def _plain_kernel(model, batch: ModelBatch, attn: str, head, rows, targets, chunk_tokens: int, squares: bool,
                  stats: bool) -> TokenLogps:
    logits = model(**model_forward_kwargs(batch, attn)).logits
    with record_function(LOGPS_SCOPE):
        return _plain_logps_at(logits, rows, targets, chunk_tokens, squares, stats)


def _lean_kernel(model, batch: ModelBatch, attn: str, head, rows, targets, chunk_tokens: int, squares: bool,
                 stats: bool) -> TokenLogps:
    hidden = _final_hidden_states(model, batch, attn)
    with record_function(LOGPS_SCOPE):
        return _lean_logps_at(hidden, rows, targets, head, chunk_tokens, final_logit_softcap(model), squares, stats)


def _fused_kernel(model, batch: ModelBatch, attn: str, head, rows, targets, chunk_tokens: int, squares: bool,
                  stats: bool) -> TokenLogps:
    """The kernel holds no logits to take an entropy or an argmax from (``stats`` gives none)."""
    hidden = _final_hidden_states(model, batch, attn)
    with record_function(LOGPS_SCOPE):
        selected = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows)
        # one call of the head module: under ZeRO-3 its weight is gathered once for the row, as the lean path's
        return TokenLogps(*_as_head_call(head, lambda x, y: fused_token_logps(x, y, head.weight, squares), selected,
                                         targets))


@dataclass(frozen=True)
class LogpsImplementation:
    """One ``--logps-impl`` and what it can do: phase one's choice and refusal (:func:`resolve_logps_impl`) and the
    forward's own check of the model it is handed (:func:`forward_logps`) read these fields.  A new implementation
    is one row of :data:`LOGPS_IMPLEMENTATIONS` and its kernel."""

    name: str
    kernel: Callable[..., TokenLogps]  # (model, batch, attn, head, rows, targets, chunk, squares, stats)
    logits_held: str  # what of the [tokens x vocab] logits exists at once: "row", "chunk" or "none"
    linear_head: bool = True  # applies the lm_head itself (a model whose logits are more falls back to plain)
    cuda_only: bool = False
    final_softcap: bool = True  # applies a final-logit soft-cap (Gemma)
    head_adapter: bool = True  # holds a LoRA adapter on the lm_head
    head_bias: bool = True  # holds an lm_head bias
    missing: Callable[[], str | None] = lambda: None  # why this install has no such kernel (None: it has)

    def head_obstacle(self, final_softcap: float | None, head_adapter: bool, head_bias: bool) -> str | None:
        """What of the model's head this implementation does not hold (None: nothing)."""
        if final_softcap and not self.final_softcap:
            return f"the model soft-caps its logits (final_logit_softcapping {final_softcap:g})"
        if head_adapter and not self.head_adapter:
            return "a LoRA adapter on the lm_head adds a low-rank term the kernel's matmul does not hold"
        if head_bias and not self.head_bias:
            return "the lm_head has a bias, which the kernel's matmul does not hold"
        return None

    def obstacle(self, device_type: str, final_softcap: float | None, head_adapter: bool) -> str | None:
        """Why it cannot run this model here (None: it can), from what phase one knows: the install, the device,
        the model's config and the LoRA settings."""
        if self.missing():
            return self.missing()
        if self.cuda_only and device_type != "cuda":
            return f"its Triton kernel runs on CUDA only, and this run's device is {device_type}"
        return self.head_obstacle(final_softcap, head_adapter, head_bias=False)


LOGPS_IMPLEMENTATIONS: dict[str, LogpsImplementation] = {impl.name: impl for impl in (
    LogpsImplementation(LEAN, _lean_kernel, logits_held="chunk"),
    LogpsImplementation(PLAIN, _plain_kernel, logits_held="row", linear_head=False),
    LogpsImplementation(FUSED, _fused_kernel, logits_held="none", cuda_only=True, final_softcap=False,
                        head_adapter=False, head_bias=False, missing=lambda: fused_logps.kernel_missing()),
)}
AUTO_ORDER = (FUSED, LEAN)  # --logps-impl auto: the first that runs here


@dataclass(frozen=True)
class LogpsSpec:
    """How a run's forwards turn into per-sequence log-probs."""

    impl: str  # a key of LOGPS_IMPLEMENTATIONS (--logps-impl auto resolved)
    chunk_tokens: int | str  # completion tokens per chunk, or "auto" (auto_chunk_tokens)


def resolve_logps_impl(requested: str, device_type: str, final_logit_softcap: float | None,
                       lora_on_head: bool) -> str:
    """``--logps-impl``: ``auto`` is the first of :data:`AUTO_ORDER` that runs here; a written implementation that
    cannot is refused in one line."""
    if requested == AUTO:
        return next(name for name in AUTO_ORDER
                    if LOGPS_IMPLEMENTATIONS[name].obstacle(device_type, final_logit_softcap, lora_on_head) is None)
    why = LOGPS_IMPLEMENTATIONS[requested].obstacle(device_type, final_logit_softcap, lora_on_head)
    if why:
        raise InputError(f"--logps-impl {requested}: {why}; use --logps-impl lean (or auto)")
    return requested


def forward_logps(model, batch: ModelBatch, attn: str, chunk_tokens: int | str = AUTO_CHUNK,
                  impl: str = LEAN, weighting: TokenWeighting | None = None) -> SequenceLogps:
    """One forward of ``model`` (an nn.Module or a DeepSpeed engine) on ``batch``, reduced per sequence.

    ``impl="lean"`` never holds the ``[T, V]`` logits, ``"fused"`` (:mod:`.fused_logps`, CUDA) not even a chunk
    of them; a model whose logits are not just its (soft-capped) lm_head's output falls back to ``plain``, a head
    the implementation does not hold (its :meth:`LogpsImplementation.head_obstacle`) to ``lean``, with a warning.
    ``chunk_tokens``: completion tokens per chunk, or ``"auto"`` (:func:`auto_chunk_tokens`).
    ``weighting``: LD-DPO's weighted sums and WPO's statistic besides (:mod:`.token_weights`).
    """
    weighting = weighting or TokenWeighting()
    if impl not in LOGPS_IMPLEMENTATIONS:
        raise ValueError(f"impl must be one of {', '.join(LOGPS_IMPLEMENTATIONS)}, got {impl!r}")
    implementation = LOGPS_IMPLEMENTATIONS[impl]
    chunk_tokens = _chunk_for(chunk_tokens, model, batch)
    head = lean_lm_head(model) if implementation.linear_head else None
    if implementation.linear_head and head is None:
        say_warning_once(f"{impl} log-probs: this model post-processes its logits or has no linear lm_head; "
                         "computing full logits instead")
        implementation = LOGPS_IMPLEMENTATIONS[PLAIN]
    why = head is not None and implementation.head_obstacle(final_logit_softcap(model),
                                                            split_head(head)[1] is not None, head.bias is not None)
    if why:  # phase one refuses what the config tells of it; here the values never go wrong whoever calls
        say_warning_once(f"{impl} log-probs: the lm_head has a bias, an adapter or a final soft-cap, which the {impl} "
                         f"kernel does not hold ({why}); computing lean log-probs instead")
        implementation = LOGPS_IMPLEMENTATIONS[LEAN]
    rows, targets, seq = scored_tokens(batch)
    scored = implementation.kernel(model, batch, attn, head, rows, targets, chunk_tokens, weighting.wpo,
                                   weighting.token_stats)
    sums = pair_ordered(_per_sequence(seq, scored, batch.num_sequences), batch)
    if weighting.ld_alpha is None:
        return sums
    return dataclasses.replace(sums, plain_logps=sums.logps, logps=length_desensitized_sums(
        batch, rows, seq, scored.logps, weighting.ld_alpha))


def pair_ordered(per_sequence: SequenceLogps, batch: ModelBatch) -> SequenceLogps:
    """Per-response sums of a grouped row looked up per pair into the canonical order (2p chosen, 2p + 1 rejected);
    a response in several pairs passes each its sum, and its gradient is their total.  Other rows unchanged."""
    if batch.pair_sequences is None:
        return per_sequence
    order = batch.pair_sequences.reshape(-1)
    return per_sequence.mapped(lambda values: values.index_select(0, order))
