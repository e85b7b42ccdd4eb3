"""How long planning one epoch takes at scale (targets: 1,000,000 pairs on 64 ranks in <= 10 s; with prompt groups,
1,000,000 pairs of 10-response groups on 1,024 ranks at 8,192 pairs a step in <= 20 ms a step).

Lengths are synthetic lognormal token counts (prompt+completion, median ~665, heavy
right tail) cut at --max-length, which is what real chat preference data looks like.
With ``--responses-per-group K`` the pairs are every pair of K responses per prompt (prompts median ~150 tokens,
responses ~400), planned with prompt groups: their responses spread over the ranks (data/response_spread.py).
Times the whole path the trainer takes: validation, step composition and the
layout of every step.  Prints one JSON object: wall seconds, and the process's CPU seconds (what other work on a
shared machine does not inflate).

    .venv/bin/python scripts/bench_planner.py --pairs 1000000 --world-size 64 --global-batch-pairs 512
    .venv/bin/python scripts/bench_planner.py --pairs 1000000 --world-size 1024 --global-batch-pairs 8192 \
        --responses-per-group 10 --max-tokens-per-row 16384
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from ds_packdpo.data.plan import PlanConfig, RowLayout, iter_plan
from ds_packdpo.data.prompt_groups import PairGroups


def grouped_lengths(pairs: int, responses: int, max_length: int, rng: np.random.Generator):
    """(chosen, rejected, prompt lengths, groups) of every pair of ``responses`` responses per prompt, ``pairs`` of
    them (the last group cut short)."""
    first, second = np.triu_indices(responses, 1)
    groups = -(-pairs // first.size)
    prompt = np.minimum(np.exp(rng.normal(5.0, 0.8, groups)).astype(np.int64) + 1, max_length // 2)
    response = np.minimum(np.exp(rng.normal(6.0, 0.7, (groups, responses))).astype(np.int64) + 1,
                          max_length - prompt[:, None])
    group = np.repeat(np.arange(groups), first.size)[:pairs]
    chosen_id = (group * responses + np.tile(first, groups)[:pairs])
    rejected_id = (group * responses + np.tile(second, groups)[:pairs])
    p = prompt[group]
    return (p + response.reshape(-1)[chosen_id], p + response.reshape(-1)[rejected_id], p,
            PairGroups(group, chosen_id, rejected_id))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=1_000_000)
    parser.add_argument("--world-size", type=int, default=64)
    parser.add_argument("--global-batch-pairs", type=int, default=512, help="8 pairs per rank at 64 ranks")
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--max-tokens-per-row", type=int, default=4096)
    parser.add_argument("--attention-weight", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--responses-per-group", type=int, default=0,
                        help="K > 1: every pair of K responses per prompt, planned with prompt groups")
    args = parser.parse_args()

    rng = np.random.default_rng(args.seed)
    grouped = args.responses_per_group > 1
    if grouped:
        chosen, rejected, prompt, groups = grouped_lengths(args.pairs, args.responses_per_group, args.max_length, rng)
    else:
        chosen, rejected = (np.minimum(np.exp(rng.normal(6.5, 0.8, args.pairs)).astype(np.int64) + 1,
                                       args.max_length) for _ in range(2))
        prompt = groups = None
    cfg = PlanConfig(max_tokens_per_row=args.max_tokens_per_row, dp_size=args.world_size, seed=args.seed,
                     global_batch_pairs=args.global_batch_pairs, attention_weight=args.attention_weight,
                     layout=RowLayout.PROMPT_GROUPS if grouped else RowLayout.PACKED)

    started, cpu_started = time.perf_counter(), time.process_time()
    utilization, rows_per_rank, copies, tokens_in_rows = [], [], 0, 0
    for plan in iter_plan(chosen, rejected, cfg, epochs=1, prompt_lengths=prompt, groups=groups):
        tokens = plan.rank_tokens
        utilization.append(sum(tokens) / (len(tokens) * max(tokens)))
        rows_per_rank.append(plan.rows_per_rank)
        copies += plan.prompt_copy_tokens
        tokens_in_rows += sum(tokens)
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started

    print(json.dumps({
        "pairs": args.pairs,
        "world_size": args.world_size,
        "global_batch_pairs": args.global_batch_pairs,
        "max_tokens_per_row": args.max_tokens_per_row,
        "max_length": args.max_length,
        "attention_weight": args.attention_weight,
        "responses_per_group": args.responses_per_group if grouped else None,
        "steps": len(utilization),
        "seconds": round(seconds, 3),
        "ms_per_step": round(1000 * seconds / len(utilization), 3),
        "cpu_ms_per_step": round(1000 * cpu_seconds / len(utilization), 3),
        "rank_balance": round(float(np.mean(utilization)), 5),
        "rank_balance_min": round(float(np.min(utilization)), 5),
        "rows_per_rank": {"min": min(rows_per_rank), "max": max(rows_per_rank)},
        **({"prompt_copy_share": round(copies / tokens_in_rows, 4)} if grouped else {}),
    }))


if __name__ == "__main__":
    main()
