"""How long planning one epoch takes at scale (target: 1,000,000 pairs on 64 ranks in <= 10 s).

Lengths are synthetic lognormal token counts (prompt+completion, median ~665, heavy
right tail) cut at --max-length, which is what real chat preference data looks like.
Times the whole path the trainer takes: validation, step composition and the
layout of every step (Karmarkar-Karp over ranks, first-fit-decreasing into rows,
row splitting).  Prints one JSON object.

    .venv/bin/python scripts/bench_planner.py --pairs 1000000 --world-size 64 --global-batch-pairs 512
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from ds_packdpo.data.plan import PlanConfig, iter_plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=1_000_000)
    parser.add_argument("--world-size", type=int, default=64)
    parser.add_argument("--global-batch-pairs", type=int, default=512, help="8 pairs per rank at 64 ranks")
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--max-tokens-per-row", type=int, default=4096)
    parser.add_argument("--attention-weight", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    rng = np.random.default_rng(args.seed)
    chosen, rejected = (np.minimum(np.exp(rng.normal(6.5, 0.8, args.pairs)).astype(np.int64) + 1, args.max_length)
                        for _ in range(2))
    cfg = PlanConfig(max_tokens_per_row=args.max_tokens_per_row, dp_size=args.world_size, seed=args.seed,
                     global_batch_pairs=args.global_batch_pairs, attention_weight=args.attention_weight)

    started = time.perf_counter()
    utilization, rows_per_rank = [], []
    for plan in iter_plan(chosen, rejected, cfg, epochs=1):
        tokens = plan.rank_tokens
        utilization.append(sum(tokens) / (len(tokens) * max(tokens)))
        rows_per_rank.append(plan.rows_per_rank)
    seconds = time.perf_counter() - started

    print(json.dumps({
        "pairs": args.pairs,
        "world_size": args.world_size,
        "global_batch_pairs": args.global_batch_pairs,
        "max_tokens_per_row": args.max_tokens_per_row,
        "max_length": args.max_length,
        "attention_weight": args.attention_weight,
        "steps": len(utilization),
        "seconds": round(seconds, 3),
        "ms_per_step": round(1000 * seconds / len(utilization), 3),
        "rank_balance": round(float(np.mean(utilization)), 5),
        "rank_balance_min": round(float(np.min(utilization)), 5),
        "rows_per_rank": {"min": min(rows_per_rank), "max": max(rows_per_rank)},
    }))


if __name__ == "__main__":
    main()
