"""Per-token weighting of the sequence log-probs: LD-DPO's ``--ld-alpha`` and WPO's ``--use-weighting``, as in TRL 1.16.

* **LD-DPO** (Liu et al. 2024, "Length Desensitization in DPO"): a pair's two completions share their first
  ``L = min(n_w, n_l)`` tokens' worth of "length"; the rest, the longer one's excess, is discounted:
  ``logp(y) = sum_{k < L} logp_k + alpha * sum_{k >= L} logp_k`` (k the token's place in its completion),
  for the policy and the reference alike.  The weight of a token depends on its pair, not only on its sequence:
  in a prompt-group row a response in several pairs counts with a different ``L`` in each, so the weighted sums
  are taken per pair side (:func:`length_desensitized_sums`) from the per-token log-probs, in fp64, by one
  ``index_add`` - in every layout (packed, prefix-shared, grouped, padded) and on a sequence-parallel slice
  (the slices' sums add up).  The unweighted sums stay for ``sft`` and the RPO term, as TRL's ``sft`` uses the
  plain per-token log-probs.
* **WPO** (Zhou et al. 2024, "Weighted Preference Optimization", Eq. 2): each pair's loss is multiplied by
  ``w(y_w) * w(y_l)`` with ``w(y) = exp(mean_k (logp_k - log sum_v p_v(k)^2))``, from the policy, without
  gradient.  The per-token term needs the whole distribution; the log-prob kernels give ``log sum_v p_v^2``
  per token beside the log-prob (``logsumexp(2z) - 2 logsumexp(z)``: one more reduction over each chunk's
  logits, no ``[T, V]`` tensor), and their per-sequence fp64 sum is :attr:`SequenceLogps.wpo_sum`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenWeighting:
    """What a forward computes beyond the plain per-sequence sums: LD-DPO's weighted sums (``ld_alpha``, None:
    off), WPO's statistic (``wpo``: the policy's forward only) and the per-token entropy and argmax hits of TRL's
    ``entropy`` and ``mean_token_accuracy`` metrics (``token_stats``: the policy's forward)."""

    ld_alpha: float | None = None
    wpo: bool = False
    token_stats: bool = False


def length_desensitized_sums(batch, rows: torch.Tensor, seq: torch.Tensor, token_logps: torch.Tensor,
                             alpha: float) -> torch.Tensor:
    """[2P] fp64 LD-DPO log-probs in canonical order (2p chosen, 2p + 1 rejected of local pair p; a row of spread
    responses: its pair sides in order) from the scored tokens of ``batch`` (a ``ModelBatch`` or a sequence-parallel
    slice of one): ``rows`` their flat positions, ``seq`` their sequences (responses), ``token_logps`` their log-probs.

    A token's place in its completion is its position id + 1 (it is the label of the position before it) minus
    its sequence's first completion position; the fork of a prefix-shared row (the prompt's last position scoring
    a later response's first token) is place 0 the same way.  Differentiable in ``token_logps``.
    """
    spans = batch.completion_spans.to(rows.device)
    members = batch.pair_sequences
    if batch.side_shared is not None:  # a row of spread responses: its pair sides, each pair's L given by the plan
        shared = batch.side_shared.to(rows.device)
    else:
        pairs = batch.num_pairs
        if members is None:
            members = torch.arange(2 * pairs, device=rows.device).reshape(pairs, 2)
        shared = (spans[members, 1].amin(dim=1) if pairs else spans.new_zeros(0)).repeat_interleave(2)  # L per side
    place = batch.position_ids.reshape(-1)[rows] + 1 - spans[seq, 0]
    if batch.pair_sequences is None:  # each sequence is one pair side: its slot is itself
        token, slot = torch.arange(seq.numel(), device=seq.device), seq
    else:  # a response passes its tokens to every pair side it is: expand each token once per side
        slot_response = members.reshape(-1)
        order = torch.argsort(slot_response, stable=True)
        sides = torch.bincount(slot_response, minlength=spans.shape[0])
        first_side = sides.cumsum(0) - sides
        per_token = sides[seq]
        token = torch.repeat_interleave(torch.arange(seq.numel(), device=seq.device), per_token)
        within = torch.arange(token.numel(), device=seq.device) - (per_token.cumsum(0) - per_token)[token]
        slot = order[first_side[seq[token]] + within]
    weight = torch.where(place[token] < shared[slot], 1.0, alpha).to(torch.float64)
    zeros = torch.zeros(shared.numel(), dtype=torch.float64, device=token_logps.device)
    return zeros.index_add(0, slot, token_logps[token].double() * weight)


def wpo_pair_weights(policy) -> torch.Tensor:
    """[P] ``w(y_w) * w(y_l)``, WPO's Eq. 2 (``policy`` a ``SequenceLogps`` with ``wpo_sum``), no gradient; TRL
    divides by the completion token count clamped at 1."""
    if policy.wpo_sum is None:
        raise ValueError("--use-weighting needs the policy's WPO statistic (forward with TokenWeighting(wpo=True))")
    weights = torch.exp(policy.wpo_sum.detach() / policy.tokens.clamp_min(1))
    return weights[0::2] * weights[1::2]
