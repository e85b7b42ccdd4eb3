"""Held-out evaluation: the DPO figures of pairs the run never trains on, with no gradients.

The held-out pairs (``--eval-fraction`` of --dataset, ``--eval-dataset``, or --dataset
itself for ``ds-packdpo eval``) are planned once, in phase one, by the training planner:
one step of rows within the row budget, near-equal on every rank, the same number of
rows on every rank (ZeRO-3 gathers every layer collectively, so a rank with one forward
fewer would hang the others).  Evaluating runs those rows through the run's own
:meth:`Run.forward_logps` and :meth:`Run.reference_logps` on a view of the run whose data
are the held-out pairs, so packing or padding, sequence parallelism, a precomputed
reference and whatever the run does to the reference apply unchanged.  The figures are
TRL's with the ``eval_`` prefix, summed over every rank in fp64 and divided by the
held-out pair count: they do not depend on the layout.  The batch-coupled losses (``aot``,
``aot_unpaired``, ``sft``) sort or token-average over the whole held-out set (one collective,
:mod:`.step_statistics`), where TRL does it per evaluation batch.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from ..console import progress_bar
from ..data.plan import StepPlan
from ..data.prepare import PreparedPairs
from ..data.run_plan import held_out_plan
from ..model.guard import evaluating
from ..model.losses import metric_means, metric_sums, pair_losses
from .metrics import add_sums, sum_over_ranks
from .reference import PrecomputedReference, reference_fingerprint
from .response_exchange import exchanged_pairs, spread_statistic
from .step_statistics import slot_index, slots_of, step_statistic

PREFIX = "eval_"


@dataclass
class HeldOut:
    pairs: PreparedPairs
    plan: StepPlan  # every held-out pair, laid out on the run's data-parallel ranks
    reference: PrecomputedReference | None  # the --ref-logps values of these pairs, in their order


def held_out_set(setup, pairs: PreparedPairs) -> HeldOut:
    """Phase one: the held-out pairs planned for the run's layout (an assemble.RunSetup), and their precomputed
    reference log-probs when the run has a --ref-logps file (InputError when it lacks one of them)."""
    plan = held_out_plan(setup.spec.plan.config, pairs)
    reference = None
    if setup.precomputed is not None:
        reference = PrecomputedReference.load(setup.spec.reference.logps_file, reference_fingerprint(setup),
                                              pairs.dataset["pair_id"])
    return HeldOut(pairs, plan, reference)


def evaluate(run, progress: bool = False) -> dict:
    """One pass over the held-out pairs on every rank (an assemble.Run); every rank returns the same figures.
    ``progress``: a bar of rank 0's rows (``ds-packdpo eval``; in training the run's own bar shows the step)."""
    held = run.setup.held_out
    view = dataclasses.replace(run, setup=dataclasses.replace(run.setup, prepared=held.pairs),
                               reference=held.reference if held.reference is not None else run.reference)
    spec, plan = run.setup.spec, held.plan
    layout = spec.layout
    spread = plan.responses is not None  # prompt groups spread over ranks: every pair on every rank, rank 0 counts
    sums: dict = {}
    started = time.perf_counter()
    with torch.no_grad(), evaluating(run.policy):
        batches, references, policies = [], [], []
        rows = plan.ranks[layout.dp_rank]
        bar = progress_bar(len(rows), "eval", "row", progress and layout.rank == 0 and spec.outputs.progress)
        for row in rows:
            batches.append(view.row_batch(row, plan))
            references.append(None if spread and view.reference_is_precomputed else view.reference_logps(batches[-1]))
            policies.append(view.forward_logps(view.policy, batches[-1]))
            bar.update(1)
        bar.close()
        if spread:
            policy, reference = exchanged_pairs(view, plan, batches, policies, references)
            statistic = spread_statistic(plan, spec.loss, policy, reference)
            partners = statistic.partners(torch.arange(plan.num_pairs)) if statistic is not None else None
            losses, per_pair = pair_losses(policy, reference, spec.loss, partners)
            add_sums(sums, {**metric_sums(per_pair, policy), "loss_sum": losses.sum()}, float(layout.rank == 0))
        else:
            statistic, slots = None, slot_index(plan)
            if spec.loss.batch_coupled:  # sorted / token-averaged over the whole held-out set
                statistic = step_statistic(plan, batches, policies, references, layout, run.device)
            for batch, policy, reference in zip(batches, policies, references):
                partners = statistic.partners(slots_of(slots, batch)) if statistic is not None else None
                losses, per_pair = pair_losses(policy, reference, spec.loss, partners)
                add_sums(sums, {**metric_sums(per_pair, policy), "loss_sum": losses.sum()},
                         float(layout.counts_metrics))
    totals = sum_over_ranks(sums, run.device)
    figures = {"loss": totals.pop("loss_sum") / max(totals["pairs"], 1.0), **metric_means(totals),
               "pairs": int(round(totals["pairs"])), "time_s": time.perf_counter() - started}
    return {PREFIX + name: value for name, value in figures.items()}
