"""What a plan is worth and what it is, for people: the ``pack-stats`` figures (packed next to the padded baseline on the
same steps) and the plan written out as JSON lines (``--plan-out``)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from ..files import atomic_write
from .plan import SIDES, PlanConfig, RowLayout, StepPlan, iter_plan, pair_tokens
from .prompt_groups import PairGroups


def pack_stats(chosen_lengths, rejected_lengths, cfg: PlanConfig, epochs: int = 1, prompt_lengths=None,
               groups: PairGroups | None = None) -> dict:
    """Quality of the packed plan next to the padded baseline on the same steps (the ``pack-stats`` command).

    real_tokens: the tokens of the packed rows (each prompt once when ``cfg.layout`` shares prefixes; the
      packed layout when ``cfg.layout`` is padded).
    lockstep_utilization (the headline): real tokens / (world * sum over row slots of the largest row),
      packed -- the figure that matters under ZeRO-3, where ranks run row i together.
    utilization (rank balance): mean over steps of mean-rank-tokens / max-rank-tokens (packed; 1 = balanced).
    row_fill: real tokens / (rows * budget), dummy rows included.
    sequence_tokens: both sequences of every pair (what a run without prefix sharing computes);
      prompt_tokens_shared = sequence_tokens - real_tokens, the tokens prefix sharing does not compute, and
      prefix_sharing_ideal_speedup = sequence_tokens / real_tokens (1.0 without sharing).
    With ``groups``: prompt_groups (the data's groups), prefix_shared_tokens (each pair's prompt once, what prefix
    sharing alone computes) and prompt_groups_ideal_speedup = prefix_shared_tokens / real_tokens (what grouping
    saves over prefix sharing alone; 1.0 with --no-prompt-groups), and prompt_copy_tokens: the prompt tokens the
    rows compute beyond one copy per prompt group of a step, what spreading a group's responses over ranks spends on
    balance (data/response_spread.py); they are in real_tokens (the rows compute them).
    padded_utilization: sequence tokens / computed tokens of the padded baseline (micro_batch_pairs pairs
      per micro-batch, pairs dealt by count; its 1-token dummy rows included).
    padded_step_utilization: mean over steps of step sequence tokens / (world * max-rank padded computed tokens).
    """
    world = cfg.dp_size
    started = time.perf_counter()
    rank_tokens, rows_per_rank, lockstep, dummy_rows, copies = [], [], 0, 0, 0
    packed = cfg.layout if cfg.layout.packed else RowLayout.PACKED
    for plan in iter_plan(chosen_lengths, rejected_lengths, replace(cfg, layout=packed), epochs,
                          prompt_lengths=prompt_lengths, groups=groups):
        copies += plan.prompt_copy_tokens
        rank_tokens.append(plan.rank_tokens)
        rows_per_rank.append(plan.rows_per_rank)
        lockstep += sum(max(rows[i].tokens for rows in plan.ranks) for i in range(plan.rows_per_rank))
        dummy_rows += sum(1 for rows in plan.ranks for row in rows if not row.pairs)
    planning_seconds = time.perf_counter() - started
    padded_rank_computed, padded_rows_per_rank, step_sequence_tokens = [], [], []
    for plan in iter_plan(chosen_lengths, rejected_lengths, replace(cfg, layout=RowLayout.PADDED), epochs,
                          groups=groups):
        padded_rank_computed.append(plan.rank_computed_tokens)
        padded_rows_per_rank.append(plan.rows_per_rank)
        step_sequence_tokens.append(sum(plan.rank_tokens))

    rank_tokens = np.array(rank_tokens, dtype=np.float64)  # [steps, world]
    padded_rank_computed = np.array(padded_rank_computed, dtype=np.float64)
    step_sequence_tokens = np.array(step_sequence_tokens, dtype=np.float64)
    step_tokens = rank_tokens.sum(axis=1)
    real_tokens = int(step_tokens.sum())
    sequence_tokens = int(step_sequence_tokens.sum())
    padded_computed = int(padded_rank_computed.sum())
    step_utilization = rank_tokens.mean(axis=1) / rank_tokens.max(axis=1)
    rows = sum(rows_per_rank) * world
    grouping = {}
    if groups is not None and prompt_lengths is not None:
        shared = int(pair_tokens(chosen_lengths, rejected_lengths, prompt_lengths, True).sum()) * epochs
        grouping = {"prompt_groups": cfg.layout.groups_prompts, "groups": groups.count, "prefix_shared_tokens": shared,
                    "prompt_groups_ideal_speedup": shared / real_tokens, "prompt_copy_tokens": copies}
    return {
        "pairs": int(len(chosen_lengths)),
        "epochs": epochs,
        "steps": len(rows_per_rank),
        "dp_size": world,
        "max_tokens_per_row": cfg.max_tokens_per_row,
        "global_batch_pairs": cfg.global_batch_pairs,
        "tokens_per_step": cfg.tokens_per_step,
        "attention_weight": cfg.attention_weight,
        "micro_batch_pairs": cfg.micro_batch_pairs,
        "prefix_sharing": cfg.layout.shares_prefixes,
        "real_tokens": real_tokens,
        "sequence_tokens": sequence_tokens,
        "prompt_tokens_shared": sequence_tokens - real_tokens,
        "prefix_sharing_ideal_speedup": sequence_tokens / real_tokens,
        "rows": rows,
        "dummy_rows": dummy_rows,
        "rows_per_rank": {"min": min(rows_per_rank), "max": max(rows_per_rank)},
        "lockstep_utilization": real_tokens / (world * lockstep),
        "rank_balance": float(step_utilization.mean()),  # mean / max rank tokens, mean over steps
        "rank_balance_min": float(step_utilization.min()),
        "row_fill": real_tokens / (rows * cfg.max_tokens_per_row),
        "padded_computed_tokens": padded_computed,
        "padded_utilization": sequence_tokens / padded_computed,
        "padded_step_utilization": float((step_sequence_tokens / (world * padded_rank_computed.max(axis=1))).mean()),
        "padded_rows_per_rank": {"min": min(padded_rows_per_rank), "max": max(padded_rows_per_rank)},
        "planning_seconds": planning_seconds,
        **grouping,
    }


def write_plan_jsonl(plans: Iterable[StepPlan], path, pair_ids: Sequence | None = None) -> None:
    """One JSON line per (step, rank, row); written to a temporary file and renamed, so never half-written.  A row of
    prompt groups lists the pairs it computes a side of and, under ``responses``, each response it computes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    def name(index):
        value = pair_ids[int(index)] if pair_ids is not None else int(index)
        return value.item() if isinstance(value, np.generic) else value

    def write(temporary: str) -> None:
        with open(temporary, "w") as handle:
            for plan in plans:
                for rank, rows in enumerate(plan.ranks):
                    for index, row in enumerate(rows):
                        record = {"epoch": plan.epoch, "step": plan.step, "rank": rank, "row": index,
                                  "pairs": [name(i) for i in row.pairs], "tokens": row.tokens}
                        if plan.responses is not None:  # prompt groups: [pair, "chosen"|"rejected"] it computes
                            record["responses"] = [[name(plan.responses.source[m]), SIDES[plan.responses.side[m]]]
                                                   for m in row.responses]
                        handle.write(json.dumps(record) + "\n")

    atomic_write(path, write)
