"""The plan of one run: its settings (:class:`PlanSpec`) for a parallel layout, checked against the tokenized pairs.

``train`` (every rank and the front command), ``bench``, ``precompute-ref`` and
``pack-stats`` all plan through :func:`checked_plan_config`, so pack-stats shows exactly
what training would run; the held-out pairs are planned by the same planner
(:func:`held_out_plan`).  No torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ..errors import InputError
from .plan import PlanConfig, StepPlan, iter_plan, pair_tokens, steps_per_epoch, validate_lengths, warn_if_ranks_idle
from .prepare import PreparedPairs


@dataclass(frozen=True)
class PlanSpec:
    """A run's plan: the planner's settings at the run's layout, one rank's share of a row, the epochs, the last
    step."""

    config: PlanConfig  # its max_tokens_per_row is a whole row: row_budget x the sequence-parallel size
    row_budget: int  # tokens of one rank's share of a row (--max-tokens-per-row, or its auto default)
    epochs: int
    max_steps: int | None  # stop after this many optimizer steps (None: every step of every epoch)
    epochs_given: bool = True  # False: --epochs left at its default, so --max-steps may extend the epochs


@dataclass(frozen=True)
class RunLength:
    """How long a run is, once its pairs are known: the epochs it plans and the optimizer steps it runs."""

    epochs: int
    steps: int
    capped_at: int | None = None  # --max-steps asked for more steps than the given --epochs hold: the steps they hold


def check_pairs_fit_group(chosen_lengths, rejected_lengths, per_rank_budget: int, sp_size: int, pair_ids,
                          prompt_lengths=None, prefix_sharing: bool = False) -> None:
    """Under sequence parallelism a pair must fit one row of S x the per-rank budget; the message says which of the
    two to raise."""
    tokens = pair_tokens(chosen_lengths, rejected_lengths, prompt_lengths, prefix_sharing)
    longest = int(np.argmax(tokens))
    need = int(tokens[longest])
    if need > per_rank_budget * sp_size:
        raise InputError(f"pair {pair_ids[longest]} needs {need} tokens but a row holds --sequence-parallel-size "
                         f"{sp_size} x --max-tokens-per-row {per_rank_budget} = {sp_size * per_rank_budget}; raise "
                         f"--max-tokens-per-row to >= {-(-need // sp_size)} or --sequence-parallel-size to >= "
                         f"{-(-need // per_rank_budget)}")


def run_plan(prepared: PreparedPairs, plan_cfg: PlanConfig, epochs: int, start_epoch: int = 0,
             start_step: int = 0) -> Iterator[StepPlan]:
    """The steps of a run over its tokenized pairs: ``iter_plan`` with every length the plan may need (the prompts',
    for rows that hold each prompt once) and the prompt groups (the unit of the steps whatever the layout)."""
    return iter_plan(prepared.chosen_lengths, prepared.rejected_lengths, plan_cfg, epochs, start_epoch, start_step,
                     prompt_lengths=prepared.prompt_lengths, groups=prepared.groups)


def checked_plan_config(plan: PlanSpec, sp_size: int, prepared: PreparedPairs) -> PlanConfig:
    """``plan.config`` once every pair is known to fit its row budget (InputError naming the pair); warns when a step
    has fewer pairs than data-parallel ranks."""
    plan_cfg = plan.config
    pair_ids = prepared.pair_ids
    if sp_size > 1:
        check_pairs_fit_group(prepared.chosen_lengths, prepared.rejected_lengths, plan.row_budget, sp_size,
                              pair_ids, prepared.prompt_lengths, plan_cfg.layout.shares_prefixes)
    validate_lengths(prepared.chosen_lengths, prepared.rejected_lengths, plan_cfg, pair_ids=pair_ids,
                     prompt_lengths=prepared.prompt_lengths)
    warn_if_ranks_idle(len(prepared.chosen_lengths), plan_cfg)
    return plan_cfg


# --max-steps alone plans at most this many epochs: each epoch's steps are planned to count them (prompt groups and
# --tokens-per-step make epochs differ), so a --max-steps far beyond the data would plan for hours in phase one.
MAX_EXTENDED_EPOCHS = 1000


def check_extension(plan: PlanSpec, epochs: int, steps: int, wanted: int | None, per_epoch: int, asked: str) -> None:
    """One line naming what asked for the steps (--max-steps) when extending the epochs to them would plan more than
    MAX_EXTENDED_EPOCHS."""
    if plan.epochs_given or not wanted or steps >= wanted or epochs < plan.epochs:
        return
    needed = epochs + -(-(wanted - steps) // per_epoch)
    if needed > MAX_EXTENDED_EPOCHS:
        raise InputError(f"{asked}: these pairs hold {per_epoch} steps an epoch, so it needs about "
                         f"{needed:,} epochs; --max-steps alone extends the epochs to at most {MAX_EXTENDED_EPOCHS:,} "
                         f"(give --epochs N as well to run longer)")


def run_length(plan: PlanSpec, prepared: PreparedPairs, steps_wanted: int | None = None,
               asked: str | None = None) -> RunLength:
    """The epochs and optimizer steps of a run (the LR schedule spans the steps): every step of --epochs epochs
    (--tokens-per-step and prompt groups make epochs differ), cut at ``steps_wanted`` (default --max-steps).

    When --epochs was not given, --max-steps extends the epochs to as many as its steps need (``--max-steps 20`` on
    data of 18 steps an epoch runs 20 steps, two epochs planned); when it was, and its epochs hold fewer steps, they
    cap the run (``capped_at``, said in the plan line).  ``asked`` names the flags that ask for ``steps_wanted``."""
    wanted = plan.max_steps if steps_wanted is None else steps_wanted
    lengths = (prepared.chosen_lengths, prepared.rejected_lengths)
    epochs = steps = 0
    # epochs are counted (each one planned) only until they hold the steps wanted: --epochs 1000 --max-steps 10 plans
    # the epochs of 10 steps, not a thousand
    while (epochs < plan.epochs or (wanted and not plan.epochs_given)) and not (wanted and steps >= wanted):
        per_epoch = steps_per_epoch(*lengths, plan.config, epoch=epochs, groups=prepared.groups)
        if per_epoch == 0:  # --drop-last on fewer pairs than a step: no epoch ever holds a step
            break
        epochs, steps = epochs + 1, steps + per_epoch
        check_extension(plan, epochs, steps, wanted, per_epoch, asked or f"--max-steps {wanted}")
    if not wanted:
        return RunLength(epochs, steps)
    return RunLength(epochs, min(steps, wanted), capped_at=steps if steps < wanted else None)


def held_out_plan(plan_cfg: PlanConfig, held_out: PreparedPairs) -> StepPlan:
    """Every held-out pair in one step laid out like a training step (same row budget, ranks, packing): rows of
    near-equal cost, the same number on every rank.  One step, so the rows are as few and as full as they can be."""
    cfg = dataclasses.replace(plan_cfg, global_batch_pairs=len(held_out.chosen_lengths), tokens_per_step=None,
                              drop_last=False)
    validate_lengths(held_out.chosen_lengths, held_out.rejected_lengths, cfg, pair_ids=held_out.pair_ids,
                     prompt_lengths=held_out.prompt_lengths)
    return next(run_plan(held_out, cfg, epochs=1))


def plan_figures(plan_cfg: PlanConfig, prepared: PreparedPairs, epochs: int, steps: int) -> dict:
    """What the run's ``steps`` steps hold: pairs, real tokens, forwards per rank, the lock-step utilization
    (real tokens / (ranks x sum over row slots of the slot's largest computed row), what ZeRO-3 pays) and, with prompt
    groups, the prompt tokens copied to spread groups over ranks (in the real tokens: the rows compute them)."""
    pairs = real = lockstep = copies = 0
    rows, step_pairs = [], []
    for index, plan in enumerate(run_plan(prepared, plan_cfg, epochs)):
        if index >= steps:
            break
        pairs += plan.num_pairs
        copies += plan.prompt_copy_tokens
        step_pairs.append(plan.num_pairs)
        real += sum(plan.rank_tokens)
        rows.append(plan.rows_per_rank)
        lockstep += sum(max(ranks[i].computed_tokens for ranks in plan.ranks) for i in range(plan.rows_per_rank))
    grouped = prepared.groups.count < len(prepared.chosen_lengths)  # steps of whole groups: sizes vary
    return {"pairs": pairs, "tokens": real, "rows_per_rank": {"min": min(rows), "max": max(rows)},
            **({"pairs_per_step": {"min": min(step_pairs), "max": max(step_pairs)}} if grouped else {}),
            **({"prompt_copy_tokens": copies} if plan_cfg.layout.groups_prompts and grouped else {}),
            "lockstep_utilization": real / (plan_cfg.dp_size * lockstep)}
