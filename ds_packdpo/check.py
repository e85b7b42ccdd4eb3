"""``ds-packdpo check``: packed (and prefix-shared) against one-sequence-at-a-time (eager) log-probs of a model, in
one process.

Phase one of the run assembly with train's flags (settings, tokenizer, the tokenized
pairs a run would see: ``--dataset``, ``--max-length``, ``--format``, the columns, ...)
and the assembly's model, without a process group or DeepSpeed.  The first ``pairs``
pairs of the data are compared, plus, for a model with a sliding window, the guard's
synthetic pair whose sequences exceed it.
"""

from __future__ import annotations

import dataclasses

from .config import LARGEST_COUNT
from .errors import InputError
from .model.attention import sliding_window_of
from .model.guard import guard_pairs, packing_exactness
from .model.lora import hf_model
from .run.assemble import model_alone, prepare


def run_check(flags, pairs: int = 4) -> dict:
    """The exactness report for the model of ``flags``; the caller exits non-zero unless ok.  ``prefix_sharing``
    holds the same comparison for prefix-shared rows when the backend runs them (else null)."""
    if not 1 <= pairs <= LARGEST_COUNT:
        raise InputError(f"--pairs must be in [1, {LARGEST_COUNT}], got {pairs}")
    requested = flags.attn
    setup = prepare(dataclasses.replace(flags, max_pairs=min(pairs, flags.max_pairs or pairs)), "check")
    spec = setup.spec
    columns = setup.prepared.dataset.select_columns(["prompt_ids", "chosen_ids", "rejected_ids"]).to_list()
    model = model_alone(setup)
    beyond_window = guard_pairs(model, setup.vocab_size) if sliding_window_of(hf_model(model).config) else []
    checked = columns + beyond_window
    attn = spec.attention.model_attn
    result = packing_exactness(model, checked, attn, setup.pad_token_id)
    shared = (packing_exactness(model, checked, attn, setup.pad_token_id, shared_prefix=True)
              if spec.row_layout.shares_prefixes else None)
    return {"model": spec.model.name, "requested_attn": requested,
            "dataset": spec.data.tokenization.dataset, **result, "attn": spec.attention.backend,
            "data_pairs": len(columns),
            "beyond_window_pairs": len(beyond_window), "prefix_sharing": shared,
            "ok": result["ok"] and (shared is None or shared["ok"])}
