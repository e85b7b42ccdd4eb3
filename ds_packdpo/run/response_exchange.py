"""Responses spread over ranks: their sums exchanged after each row slot, the loss of every pair on every rank.

With prompt groups a step's responses lie on several ranks (``data/response_spread.py``), so a pair's chosen and
rejected may be computed by different ranks.  The loss needs only each response's fp64 log-prob sums, so after the
forward of row slot i (row i of every rank; a pair's two sides always share a slot) every rank writes the sums of the
pair sides it computed into a zero vector ``[fields, 2N]`` (side s of the step's k-th pair at ``2k + s``), and one
all-reduce SUM gives every rank every side: each side is written by one data-parallel rank, so the sum is exact.  Under
sequence parallelism only the first rank of a group writes (the others hold the same sums).

Each rank then evaluates the loss of all the slot's pairs from that vector, with its own sides put back with their
graph (:func:`local_view`): its gradient is the loss's gradient with respect to its own responses, and the rank
backpropagates through its own rows only.  Summed over ranks by DeepSpeed, that is the gradient of the one-rank
grouped run, exactly: the loss is ``L(s_1 .. s_M)`` and rank r contributes ``sum over its i of dL/ds_i ds_i/dtheta``.

Why per slot: the planner keeps a group's pairs in one row slot (``data/response_spread.py``), so the sums a slot's
loss needs all exist right after that slot's forward, and each row is backpropagated before the next one runs, as
without prompt groups.  Cost: one all-reduce per row slot of ``fields x 2N`` fp64 numbers (``N`` the step's pairs;
5 fields of the policy's sums and statistics, up to 2 more with LD-DPO or WPO, 3 with a live reference: 1.3 MB at
8,192 pairs), no second forward and no activations kept past their slot.  The two other ways considered: keeping
every row's graph until one backward after the last row holds K rows' activations at once (what the row budget is
there to bound); a no-grad pre-pass for the sums, then a forward and backward per row, costs one more policy forward
per row, +27 % of a step on this machine's CPU (``--loss aot``'s pre-pass, measured in docs/losses.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from ..data.plan import StepPlan
from ..model.collate import ModelBatch
from ..model.coupled_losses import StepStatistic
from ..model.logps import SequenceLogps
from .step_statistics import CoupledStep


def side_fields(logps: SequenceLogps) -> list[str]:
    """The fields a forward gave (the same on every rank: the run's settings decide them)."""
    return [f.name for f in dataclasses.fields(logps) if getattr(logps, f.name) is not None]


def exchange_sides(plan: StepPlan, rows: Sequence[tuple[ModelBatch, Sequence[SequenceLogps | None]]], counts: bool,
                   device) -> list[SequenceLogps | None]:
    """Every pair side of the step, detached, for each kind of sums given per row (the policy's, a live reference's):
    ``rows`` are this rank's rows run since the last exchange, each with its sums per kind (None: that kind is not
    exchanged).  One all-reduce, on every rank alike; ``counts``: this rank writes (False on sequence-parallel ranks
    past their group's first)."""
    kinds = [[logps for _, per_kind in rows for logps in [per_kind[k]] if logps is not None]
             for k in range(len(rows[0][1]))]
    names = [side_fields(found[0]) if found else [] for found in kinds]
    sides = 2 * plan.num_pairs
    values = torch.zeros(sum(len(n) for n in names), sides, dtype=torch.float64, device=device)
    if counts:
        for batch, per_kind in rows:
            positions = batch.side_positions
            if positions is None or not positions.numel():
                continue  # a dummy row
            at = 0
            for kind, logps in enumerate(per_kind):
                for name in names[kind]:
                    values[at, positions.to(device)] = getattr(logps, name).detach().double()
                    at += 1
    dist.all_reduce(values)
    out, at = [], 0
    for kind_names in names:
        if not kind_names:
            out.append(None)
            continue
        fields = {name: values[at + i] for i, name in enumerate(kind_names)}
        at += len(kind_names)
        out.append(SequenceLogps(**fields))
    return out


def local_view(every: SequenceLogps, rows: Sequence[tuple[ModelBatch, SequenceLogps]]) -> SequenceLogps:
    """The exchanged sides with this rank's own put back with their graph (the values are the same).  A rank with no
    side here (a dummy row) gets a zero tied to its forward, so that its backward runs through the model like every
    other rank's (ZeRO-3 gathers and reduces in that backward on every rank alike)."""
    positions = [batch.side_positions for batch, _ in rows if batch.side_positions is not None
                 and batch.side_positions.numel()]
    if not positions:
        anchor = sum(logps.logps.sum() for _, logps in rows) * 0.0
        return dataclasses.replace(every, logps=every.logps + anchor)
    where = torch.cat(positions).to(every.logps.device)
    fields = {}
    for f in dataclasses.fields(every):
        value = getattr(every, f.name)
        if value is not None:
            mine = torch.cat([getattr(logps, f.name) for batch, logps in rows if batch.side_positions is not None
                              and batch.side_positions.numel()]).double()
            value = value.index_put((where,), mine)
        fields[f.name] = value
    return SequenceLogps(**fields)


def pairs_at(sides: SequenceLogps, positions: torch.Tensor) -> SequenceLogps:
    """The pairs at ``positions`` (places in the step) in canonical order (2p chosen, 2p + 1 rejected)."""
    index = torch.stack([2 * positions, 2 * positions + 1], 1).reshape(-1).to(sides.logps.device)
    return sides.mapped(lambda values: values.index_select(0, index))


def slot_pairs(plan: StepPlan) -> list[torch.Tensor]:
    """The places in the step of the pairs whose sides row slot i computes (a pair's two sides share a slot)."""
    slot = plan.side_rows()[:, 0] % plan.rows_per_rank
    return [torch.from_numpy(np.flatnonzero(slot == i)) for i in range(plan.rows_per_rank)]


def pair_tokens(plan: StepPlan, positions: torch.Tensor) -> float:
    """The tokens of the pairs at ``positions`` as the pairs alone hold them (prompt + chosen + prompt + rejected):
    what a run's ``tokens`` figure counts, once whatever the rows copy."""
    responses = plan.responses
    sides = responses.pair_sides[positions.numpy()]
    return float((2 * responses.prompt[sides[:, 0]] + responses.length[sides].sum(axis=1)).sum())


def exchanged_pairs(run, plan: StepPlan, batches: Sequence[ModelBatch], policies: Sequence[SequenceLogps | None],
                    references: Sequence[SequenceLogps | None]) -> tuple[SequenceLogps | None, SequenceLogps | None]:
    """(policy, reference) sums of every pair of the step in plan order, without graph, from this rank's rows (all
    of them, one exchange): a no-grad pass (evaluation, precompute-ref, the aot pre-pass).  A precomputed reference is
    looked up per pair; ``references`` are then not exchanged."""
    precomputed = run.reference if run.reference_is_precomputed else None
    every_policy, every_reference = exchange_sides(
        plan, [(b, [p, None if precomputed is not None else r]) for b, p, r in zip(batches, policies, references)],
        run.setup.spec.layout.counts_metrics, run.device)
    everything = torch.arange(plan.num_pairs)
    if precomputed is not None:
        reference = precomputed.pair_logps(plan.pairs, run.device)
    else:
        reference = pairs_at(every_reference, everything) if every_reference is not None else None
    return (pairs_at(every_policy, everything) if every_policy is not None else None), reference


def spread_statistic(plan: StepPlan, loss_cfg, policy: SequenceLogps | None,
                     reference: SequenceLogps | None) -> StepStatistic | None:
    """The batch-coupled losses' statistic of a step of spread responses (None when none is trained): every pair's
    sums (``policy``/``reference`` in plan order, when a sorted loss needs them) and the chosen completion tokens,
    from the plan's lengths (what a forward counts)."""
    if not loss_cfg.batch_coupled:
        return None
    responses = plan.responses
    values = None
    if loss_cfg.needs_policy_prepass:
        values = torch.stack([policy.chosen_logps, policy.rejected_logps, reference.chosen_logps,
                              reference.rejected_logps])
    return StepStatistic.from_values(values, plan.num_pairs, float(responses.length[responses.pair_sides[:, 0]].sum()))


class SpreadStep:
    """One optimizer step's rows on this rank when the plan spreads responses over ranks: the peer of
    ``step_statistics.CoupledStep`` (same methods).  Row i's loss is that of every pair of row slot i, from the sides
    exchanged after its forward; the batch-coupled losses' statistic comes from the no-grad pre-pass exchanged the
    same way (aot), or from the plan's lengths (sft: its chosen completion tokens, no forward)."""

    def __init__(self, run, plan: StepPlan, batches: Sequence[ModelBatch]):
        setup = run.setup
        self.run, self.plan, self.batches = run, plan, batches
        self.device = run.device
        self.positions = slot_pairs(plan)
        self.writes = setup.spec.layout.counts_metrics  # an sp-rank > 0 holds its group's sums again
        self.pair_weight = float(setup.spec.layout.rank == 0)  # every rank evaluates every pair: rank 0 counts them
        self.precomputed = run.reference if run.reference_is_precomputed else None
        self._references: list[SequenceLogps | None] = [None] * len(batches)
        self.every_reference: SequenceLogps | None = None  # the pre-pass's exchange of the live reference
        self.statistic: StepStatistic | None = None
        policy = reference = None
        if setup.spec.loss.needs_policy_prepass:  # every row, dummy rows included (lock-step)
            self._references = [self.reference_logps(i) for i in range(len(batches))]
            with torch.no_grad():
                policies = [run.forward_logps(run.policy, batch) for batch in batches]
            policy, reference = exchanged_pairs(run, plan, batches, policies, self._references)
            if self.precomputed is None:  # the gradient pass exchanges the policy's sides alone
                self.every_reference = reference
        self.statistic = spread_statistic(plan, setup.spec.loss, policy, reference)

    def reference_logps(self, i: int) -> SequenceLogps | None:
        """Row i's live reference sums (the pre-pass's when there is one); None with a precomputed reference (looked
        up per pair in :meth:`pair_logps`) or none (SimPO)."""
        if self.precomputed is not None:
            return None
        if self._references[i] is None:
            self._references[i] = self.run.reference_logps(self.batches[i])
        return self._references[i]

    def pair_logps(self, i: int, policy: SequenceLogps, reference: SequenceLogps | None):
        """(policy, reference, partners) of every pair of row slot i: the sides exchanged, this rank's own with their
        graph."""
        batch, positions = self.batches[i], self.positions[i]
        exchange_reference = reference is not None and self.every_reference is None
        every_policy, every_reference = exchange_sides(
            self.plan, [(batch, [policy, reference if exchange_reference else None])], self.writes, self.device)
        policy_pairs = pairs_at(local_view(every_policy, [(batch, policy)]), positions)
        if self.precomputed is not None:
            reference_pairs = self.precomputed.pair_logps(np.asarray(self.plan.pairs)[positions.numpy()],
                                                          self.device)
        elif reference is None:
            reference_pairs = None
        else:  # the pre-pass's (every pair in plan order, as the side vector is) or this slot's exchange
            reference_pairs = pairs_at(every_reference if self.every_reference is None else self.every_reference,
                                       positions)
        partners = self.statistic.partners(positions) if self.statistic is not None else None
        return policy_pairs, reference_pairs, partners

    def token_sums(self, i: int) -> dict[str, float]:
        """Row i's share of the step's token figures: the slot's pairs' tokens once (rank 0), each row's computed
        tokens (prompt copies included) once per sequence-parallel group."""
        real = pair_tokens(self.plan, self.positions[i]) * self.pair_weight
        computed = self.batches[i].computed_tokens * float(self.writes)
        return {"real_tokens": real, "computed_tokens": computed, "prompt_tokens_shared": real - computed}


def step_rows(run, plan: StepPlan, batches: Sequence[ModelBatch]):
    """The step's rows on this rank: spread responses (``SpreadStep``) or rows of whole pairs (``CoupledStep``)."""
    return (SpreadStep if plan.responses is not None else CoupledStep)(run, plan, batches)
