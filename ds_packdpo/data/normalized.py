"""Normalized pairs written to an Arrow file as validation makes them, with their content hash and quality counts.

What ``prepare`` once built as one Python list of dicts (and hashed as one JSON text, and deduplicated as a set of
JSON texts: several copies of the data at a million pairs) is now written a batch at a time with datasets'
``ArrowWriter`` and tokenized from that memory-mapped file.  The content hash is the same bytes as
``json.dumps(list_of_pairs, sort_keys=True, ensure_ascii=False)`` fed piece by piece, so a dataset's fingerprint (its
cache, its precomputed reference log-probs) is what it was when the list was hashed whole; duplicates are counted
from a 128-bit digest per pair (16 bytes a pair, sorted once at the end).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import datasets
import numpy as np
from datasets.arrow_writer import ArrowWriter

WRITER_BATCH_ROWS = 1000


class NormalizedPairs:
    """Takes the valid pairs in order; keeps the first ``max_pairs`` (all when None) in ``path`` and counts the rest."""

    def __init__(self, path: Path, max_pairs: int | None):
        self.path, self.max_pairs = Path(path), max_pairs
        self._writer = ArrowWriter(path=str(path), writer_batch_size=WRITER_BATCH_ROWS)
        self._content = hashlib.sha256(b"[")
        self._digests = bytearray()
        self.kept = self.beyond_max_pairs = 0
        self.conversational: bool | None = None  # every pair's prompt is of the first pair's kind
        self._identical = self._ends_with_assistant = 0

    def add(self, pair: dict) -> None:
        """One valid pair: {pair_id, prompt, chosen, rejected}."""
        if self.max_pairs is not None and self.kept >= self.max_pairs:
            self.beyond_max_pairs += 1
            return
        if self.kept:
            self._content.update(b", ")
        self._content.update(json.dumps(pair, sort_keys=True, ensure_ascii=False).encode())
        prompt, chosen, rejected = pair["prompt"], pair["chosen"], pair["rejected"]
        same = json.dumps([prompt, chosen, rejected], sort_keys=True).encode()
        self._digests += hashlib.blake2b(same, digest_size=16).digest()
        self._identical += chosen == rejected
        self._ends_with_assistant += isinstance(prompt, list) and prompt[-1]["role"] == "assistant"
        if self.conversational is None:
            self.conversational = isinstance(prompt, list)
        self._writer.write(pair)
        self.kept += 1

    def content_hash(self) -> str:
        """sha256 of the kept pairs as one JSON list (what the fingerprint keys)."""
        content = self._content.copy()
        content.update(b"]")
        return content.hexdigest()

    def quality(self) -> dict[str, int]:
        """Pairs that train but probably should not as they are: the counts of prepare's summary (and its warnings)."""
        digests = np.frombuffer(bytes(self._digests), dtype=np.dtype((np.void, 16)))
        return {
            "identical_chosen_rejected": self._identical,
            "duplicate_pairs": self.kept - np.unique(digests).size,
            "prompt_ends_with_assistant": self._ends_with_assistant,
        }

    def close(self) -> datasets.Dataset:
        """Finishes the file; the kept pairs memory-mapped (validation refuses a dataset without one before this)."""
        self._writer.finalize()
        self._writer.close()
        return datasets.Dataset.from_file(str(self.path))

    def discard(self) -> None:
        """Closes and removes the file (bad input found: nothing is left half written)."""
        self._writer.close()
        self.path.unlink(missing_ok=True)
