"""A wide multi-response set made of the real texts of ``multi_response_demo.jsonl``: many prompts, many answers each.

The shared demo has 160 prompts of 4 answers; planning prompt groups at cluster width needs several hundred prompts
of 10+ scored answers (like the held-out 20-answer human-scored set of issue 43, which is not public).  Prompt ``i``
is the demo's prompt ``i mod 160`` (from the second round on with a ``(variant v)`` tag in front, so that every
prompt is its own group); its answers are its own 4 and answers drawn without replacement from the other prompts',
each with its real score.  Only the lengths matter to the planner, and those are the real ones: prompts and answers
of real chat data.  Deterministic for the arguments.

    .venv/bin/python scripts/expand_multi_response.py --prompts 480 --answers 12 --out runs/wide_multi_response.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

DEMO = Path(__file__).resolve().parents[2] / "shared/data/multi_response_demo.jsonl"


def expanded_rows(source: list[dict], prompts: int, answers: int, seed: int) -> list[dict]:
    """``prompts`` rows of ``answers`` completions each, drawn from ``source`` (rows of the demo's layout)."""
    pool = [(i, completion) for i, row in enumerate(source) for completion in row["completions"]]
    if answers > len(pool):
        raise SystemExit(f"error: --answers {answers} is more than the {len(pool)} answers of the source")
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(prompts):
        origin, variant = i % len(source), i // len(source)
        prompt = [dict(message) for message in source[origin]["prompt"]]
        if variant:
            prompt[0]["content"] = f"(variant {variant}) {prompt[0]['content']}"
        own = list(source[origin]["completions"])[:answers]
        others = [c for j, c in pool if j != origin]
        drawn = rng.choice(len(others), size=answers - len(own), replace=False)
        rows.append({"prompt": prompt, "completions": own + [others[k] for k in drawn.tolist()]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default=str(DEMO), help="multi_response_demo.jsonl (the default: ../shared/data)")
    parser.add_argument("--prompts", type=int, default=480)
    parser.add_argument("--answers", type=int, default=12, help="answers per prompt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    source = [json.loads(line) for line in Path(args.source).read_text().splitlines() if line.strip()]
    rows = expanded_rows(source, args.prompts, args.answers, args.seed)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(json.dumps({"out": args.out, "prompts": len(rows), "answers_per_prompt": args.answers}))


if __name__ == "__main__":
    main()
