"""The plan of one run: its PlanConfig for a parallel layout, checked against the tokenized pairs.

``train`` (every rank and the front command), ``bench``, ``precompute-ref`` and
``pack-stats`` all plan through :func:`checked_plan_config`, so pack-stats shows exactly
what training would run.  No torch.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from ..errors import InputError
from .plan import PlanConfig, StepPlan, iter_plan, pair_tokens, validate_lengths, warn_if_ranks_idle
from .prepare import PreparedPairs


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
    for rows that hold each prompt once)."""
    return iter_plan(prepared.chosen_lengths, prepared.rejected_lengths, plan_cfg, epochs, start_epoch, start_step,
                     prompt_lengths=prepared.prompt_lengths)


def checked_plan_config(cfg, layout, prepared: PreparedPairs) -> PlanConfig:
    """``cfg.plan_config(layout)`` once every pair is known to fit its row budget (InputError naming the pair); warns
    when a step has fewer pairs than data-parallel ranks."""
    plan_cfg = cfg.plan_config(layout)
    pair_ids = prepared.dataset["pair_id"]
    if layout.sp_size > 1:
        check_pairs_fit_group(prepared.chosen_lengths, prepared.rejected_lengths, cfg.row_budget, layout.sp_size,
                              pair_ids, prepared.prompt_lengths, plan_cfg.prefix_sharing)
    validate_lengths(prepared.chosen_lengths, prepared.rejected_lengths, plan_cfg, pair_ids=pair_ids,
                     prompt_lengths=prepared.prompt_lengths)
    warn_if_ranks_idle(len(prepared.chosen_lengths), plan_cfg)
    return plan_cfg
