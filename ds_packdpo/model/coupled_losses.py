"""What the batch-coupled TRL 1.16 losses (``aot``, ``aot_unpaired``, ``sft``: rows of :mod:`.loss_registry` whose
``coupling`` is set) are matched against: the statistic of the whole step.

TRL sorts (AOT) or token-averages (SFT) over each device micro-batch, so its result depends on the
number of GPUs.  Here the coupling statistic is that of the whole optimizer step (or of the whole
held-out set), gathered once (:mod:`ds_packdpo.run.step_statistics`) into a :class:`StepStatistic`
indexed by *slot*, a pair's position in the step (``StepPlan.pairs``), which no layout changes.  Each
pair then gets a per-pair term (the rows' functions) whose sum over the step has TRL's value on the whole step in one
batch and whose gradient with respect to that pair's log-probs is TRL's:

* ``aot``: pair i whose policy margin ``pc - pr`` has rank k_i in the step is matched with the k_i-th
  smallest reference margin: ``smoothed(b ((pc - pr)_i - sort(rc - rr)[k_i]))``.  Summed over i this is
  TRL's sum over the sorted batch, and the gradient flows into ``(pc - pr)_i`` only, as through
  TRL's ``torch.sort``.
* ``aot_unpaired``: TRL's term k pairs the k-th smallest ``c`` with the k-th smallest ``r``, two
  different pairs.  ``A_i = smoothed(b (c_i - sort(r)[rank of c_i]))`` carries the gradient of c_i
  and ``B_i = smoothed(b (sort(c)[rank of r_i] - r_i))`` that of r_i; sum(A) and sum(B) are each
  TRL's sum, so the term ``A + B - (A + B).detach() / 2`` has half of both as its value (summing to
  TRL's) and the gradient of A + B (each log-ratio's own sorted term).
* ``sft``: ``-pc_i N / T`` with N the step's pairs and T its chosen completion tokens: the mean over
  the step's pairs is TRL's ``-sum(chosen token log-probs) / T`` over the step.

Ranks break ties by slot (a stable sort of the slot-ordered values), the same on every rank and
every layout; the ranks come from the no-grad pre-pass, so a gradient-mode forward that differs in
the last bit (GPU kernels) still gets the same matching.  Everything here is fp64 and detached: a term's gradient
flows into its own pair's log-probs only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .logps import SequenceLogps

VALUES_PER_PAIR = 4  # policy chosen, policy rejected, reference chosen, reference rejected


def _ranks(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rank of each slot's value, the sorted values); ties keep slot order (stable sort)."""
    ordered, order = torch.sort(values, stable=True)
    ranks = torch.empty_like(order)
    ranks[order] = torch.arange(order.numel(), device=order.device)
    return ranks, ordered


@dataclass(frozen=True)
class PairPartners:
    """What the pairs of one row are matched with in the step (all detached, one value per pair [P])."""

    aot_reference: torch.Tensor | None  # sort(rc - rr)[rank of the pair's pc - pr]
    unpaired_rejected: torch.Tensor | None  # sort(r)[rank of the pair's c]
    unpaired_chosen: torch.Tensor | None  # sort(c)[rank of the pair's r]
    sft_scale: float  # step pairs / step chosen completion tokens


@dataclass(frozen=True)
class StepStatistic:
    """The whole step's coupling statistic, indexed by slot (a pair's position in ``StepPlan.pairs``)."""

    pairs: int
    chosen_tokens: float  # the step's chosen completion tokens (TRL's sft denominator)
    margin_rank: torch.Tensor | None = None  # [N] rank of pc - pr; None when no sorted loss is trained
    sorted_ref_margin: torch.Tensor | None = None  # [N] sort(rc - rr)
    chosen_rank: torch.Tensor | None = None  # [N] rank of c = pc - rc
    rejected_rank: torch.Tensor | None = None  # [N] rank of r = pr - rr
    sorted_chosen: torch.Tensor | None = None  # [N] sort(c)
    sorted_rejected: torch.Tensor | None = None  # [N] sort(r)

    @classmethod
    def from_values(cls, values: torch.Tensor | None, pairs: int, chosen_tokens: float) -> StepStatistic:
        """From the slot-ordered fp64 log-prob sums ``[4, N]`` (pc, pr, rc, rr), or None when only sft is trained."""
        if values is None:
            return cls(pairs, chosen_tokens)
        pc, pr, rc, rr = values.double()
        margin_rank, _ = _ranks(pc - pr)
        chosen_rank, sorted_chosen = _ranks(pc - rc)
        rejected_rank, sorted_rejected = _ranks(pr - rr)
        return cls(pairs, chosen_tokens, margin_rank, torch.sort(rc - rr).values, chosen_rank, rejected_rank,
                   sorted_chosen, sorted_rejected)

    def partners(self, slots: torch.Tensor) -> PairPartners:
        """The matches of the pairs at ``slots`` (long [P], their positions in the step)."""
        sft_scale = self.pairs / max(self.chosen_tokens, 1.0)
        if self.margin_rank is None:
            return PairPartners(None, None, None, sft_scale)
        slots = slots.to(self.margin_rank.device)
        return PairPartners(self.sorted_ref_margin[self.margin_rank[slots]],
                            self.sorted_rejected[self.chosen_rank[slots]],
                            self.sorted_chosen[self.rejected_rank[slots]], sft_scale)


def batch_partners(policy: SequenceLogps, reference: SequenceLogps) -> PairPartners:
    """TRL's own semantics: the batch given is the whole step (its pairs in order are the slots)."""
    values = torch.stack([policy.chosen_logps, policy.rejected_logps, reference.chosen_logps,
                          reference.rejected_logps]).detach()
    statistic = StepStatistic.from_values(values, values.shape[1], float(policy.chosen_tokens.sum()))
    return statistic.partners(torch.arange(values.shape[1], device=values.device))
