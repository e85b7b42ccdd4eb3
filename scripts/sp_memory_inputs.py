"""Inputs of the README's sequence-parallel memory figure: a model config, a tokenizer, the 2 longest pairs.

``python scripts/sp_memory_inputs.py OUT`` writes OUT/model/config.json (4-layer Llama-style,
hidden 256, 8 heads, 4 KV heads, vocab 4096), OUT/tok (byte-level BPE trained on the demo
texts) and OUT/longest2.json (the 2 rows of ../shared/data/dpo_en_demo.json with the most characters).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ds_packdpo.model.build import tiny_config
from ds_packdpo.data.tokenizer import train_bpe_tokenizer

DEMO = Path(__file__).resolve().parents[2] / "shared/data/dpo_en_demo.json"


def main(out: Path) -> None:
    rows = json.loads(DEMO.read_text())

    def texts():
        for row in rows:
            yield from (message["value"] for message in row["conversations"])
            yield row["chosen"]["value"]
            yield row["rejected"]["value"]

    def characters(row) -> int:
        prompt = sum(len(message["value"]) for message in row["conversations"])
        return prompt + max(len(row["chosen"]["value"]), len(row["rejected"]["value"]))

    train_bpe_tokenizer(texts(), vocab_size=4096).save_pretrained(str(out / "tok"))
    tiny_config(vocab_size=4096, hidden_size=256, layers=4, heads=8, kv_heads=4,
                max_position_embeddings=16384).save_pretrained(str(out / "model"))
    (out / "longest2.json").write_text(json.dumps(sorted(rows, key=characters, reverse=True)[:2]))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
