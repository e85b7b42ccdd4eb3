"""Writes N synthetic preference pairs (the embedded set's kind: short chat pairs) as JSONL, and its tokenizer.

Usage: ``python scripts/synthetic_pairs.py N OUT.jsonl [--seed S] [--tokenizer FOLDER]``.  Deterministic for
(N, seed); written block by block, so a million pairs need no more memory than ten thousand.  ``--tokenizer``
saves the local BPE tokenizer those texts are made for (``--tokenizer FOLDER`` of prepare and train).
"""

from __future__ import annotations

import argparse

from ds_packdpo.data.synthetic import default_tokenizer, synthetic_preference_rows, write_synthetic_pairs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("num_pairs", type=int)
    parser.add_argument("out")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", default=None, help="a folder to save the data's tokenizer in")
    args = parser.parse_args()
    write_synthetic_pairs(args.out, args.num_pairs, args.seed)
    if args.tokenizer:
        default_tokenizer(synthetic_preference_rows(2048, seed=0)).save_pretrained(args.tokenizer)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
