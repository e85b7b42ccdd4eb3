"""The whole optimizer step's statistic for the batch-coupled losses (``aot``, ``aot_unpaired``, ``sft``).

TRL sorts or token-averages over each device micro-batch; here the statistic is that of every pair
of the step on every rank (:mod:`ds_packdpo.model.coupled_losses` turns it into per-pair terms), so
the trajectory does not depend on the layout (invariant 2):

* ``sft`` needs only the step's chosen completion token count: counted on the collated rows, no
  forward, one all-reduce of one number.
* ``aot``/``aot_unpaired`` need every pair's four log-prob sums before the gradient pass: a no-grad
  pre-pass over this rank's rows (the reference, kept for the gradient pass so it runs once, and the
  policy), each pair's sums written at its slot (its position in ``StepPlan.pairs``) of a zero fp64
  vector ``[4 N + 1]``, and one all-reduce SUM over the world.  Each slot is written by one rank
  (under sequence parallelism by sp-rank 0 of its group; the others add zeros), so the sum is exact.
  The cost is one extra policy forward per row, without gradients (docs/losses.md has the figure);
  every rank runs it on each of its rows, dummy rows included, so the forwards stay in lock-step
  under ZeRO-3 (invariant 3).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..data.plan import StepPlan
from ..model.collate import ModelBatch
from ..model.coupled_losses import VALUES_PER_PAIR, PairPartners, StepStatistic
from ..model.logps import SequenceLogps, scored_tokens


def chosen_token_counts(batch: ModelBatch) -> torch.Tensor:
    """Each pair's scored chosen completion tokens [P] (what ``SequenceLogps.chosen_tokens`` of a forward holds),
    from the collated row alone."""
    _, _, seq = scored_tokens(batch)
    counts = torch.bincount(seq, minlength=batch.num_sequences).double()
    if batch.pair_sequences is not None:  # grouped row: per response, looked up per pair
        counts = counts.index_select(0, batch.pair_sequences.reshape(-1))
    return counts[0::2]


def slot_index(plan: StepPlan) -> dict[int, int]:
    """Pair index -> its slot, its position in the step (``plan.pairs``): the same whatever the layout."""
    return {pair: k for k, pair in enumerate(plan.pairs)}


def slots_of(slots: dict[int, int], batch: ModelBatch) -> torch.Tensor:
    """The slots (:func:`slot_index`) of the row's pairs, in the row's pair order."""
    return torch.tensor([slots[p] for p in batch.pair_indices.tolist()], dtype=torch.long)


def local_values(pairs: int, rows: Sequence[tuple[torch.Tensor, float, SequenceLogps | None, SequenceLogps | None]],
                 sorted_losses: bool, device) -> torch.Tensor:
    """This rank's share of the step's vector: for each row ``(slots, chosen tokens, policy, reference)`` its pairs'
    four sums at their slots (``[4 N]``, with ``sorted_losses``) and its chosen token count (the last entry)."""
    values = torch.zeros(VALUES_PER_PAIR * pairs + 1 if sorted_losses else 1, dtype=torch.float64, device=device)
    for slots, chosen_tokens, policy, reference in rows:
        values[-1] += chosen_tokens
        if sorted_losses and slots.numel():
            sums = (policy.chosen_logps, policy.rejected_logps, reference.chosen_logps, reference.rejected_logps)
            for j, value in enumerate(sums):
                values[j * pairs + slots.to(device)] = value.detach().double()
    return values


def step_statistic(plan: StepPlan, batches: Sequence[ModelBatch], policies: Sequence[SequenceLogps] | None,
                   references: Sequence[SequenceLogps] | None, layout, device) -> StepStatistic:
    """The step's statistic on every rank alike: one all-reduce (every rank calls it once per step).  An sp-rank > 0
    adds zeros: its group's sp-rank 0 writes the same rows."""
    rows, slots = [], slot_index(plan)
    if layout.counts_metrics:
        rows = [(slots_of(slots, batch), float(chosen_token_counts(batch).sum()),
                 policies[i] if policies is not None else None, references[i] if policies is not None else None)
                for i, batch in enumerate(batches)]
    values = local_values(plan.num_pairs, rows, policies is not None, device)
    dist.all_reduce(values)
    sums = values[:-1].reshape(VALUES_PER_PAIR, plan.num_pairs) if policies is not None else None
    return StepStatistic.from_values(sums, plan.num_pairs, float(values[-1]))


class CoupledStep:
    """One optimizer step's rows on this rank, each holding whole pairs: the reference log-probs of each row (from the
    pre-pass when there is one), each row's pairs with the step statistic's matches (None when no batch-coupled loss
    is trained), and what each row adds to the step's figures.  ``run/response_exchange.py``'s ``SpreadStep`` is its
    peer for rows of responses spread over ranks."""

    def __init__(self, run, plan: StepPlan, batches: Sequence[ModelBatch]):
        self.run, self.batches, self.slots = run, batches, slot_index(plan)
        self.pair_weight = float(run.setup.spec.layout.counts_metrics)  # an sp-rank > 0 holds its group's sums again
        self.statistic: StepStatistic | None = None
        self._references: list[SequenceLogps | None] = [None] * len(batches)
        loss = run.setup.spec.loss
        if not loss.batch_coupled:
            return
        policies = None
        if loss.needs_policy_prepass:  # the no-grad pre-pass: every row, dummy rows included (lock-step)
            self._references = [run.reference_logps(batch) for batch in batches]
            with torch.no_grad():
                policies = [run.forward_logps(run.policy, batch) for batch in batches]
        self.statistic = step_statistic(plan, batches, policies, self._references if policies is not None else None,
                                        run.setup.spec.layout, run.device)

    def reference_logps(self, i: int) -> SequenceLogps | None:
        """Row i's reference log-probs: the pre-pass's, else computed now."""
        if self._references[i] is not None:
            return self._references[i]
        return self.run.reference_logps(self.batches[i])

    def partners(self, i: int) -> PairPartners | None:
        """Row i's pairs' matches in the step statistic (None: no batch-coupled loss)."""
        if self.statistic is None:
            return None
        return self.statistic.partners(slots_of(self.slots, self.batches[i]))

    def pair_logps(self, i: int, policy: SequenceLogps, reference: SequenceLogps | None):
        """(policy, reference, partners) of the pairs whose loss row i's backward carries: the row's own pairs."""
        return policy, reference, self.partners(i)

    def token_sums(self, i: int) -> dict[str, float]:
        """Row i's share of the step's token figures (weighted: counted once per sequence-parallel group)."""
        batch = self.batches[i]
        return {"real_tokens": batch.real_tokens * self.pair_weight,
                "computed_tokens": batch.computed_tokens * self.pair_weight,
                "prompt_tokens_shared": batch.prompt_tokens_shared * self.pair_weight}
