"""``ds-packdpo check``: packed (and prefix-shared) against one-sequence-at-a-time log-probs of a real model.

Phase one of the run assembly (settings, tokenizer, the tokenized pairs a run would
see) and the assembly's model, without a process group or DeepSpeed.
"""

from __future__ import annotations

from .config import TrainConfig
from .errors import InputError
from .model.guard import packing_exactness
from .run.assemble import model_alone, prepare


def run_check(model: str, tokenizer: str | None = None, attn: str = "auto", dataset: str | None = None,
              pairs: int = 4, trust_remote_code: bool = False, dtype: str = "fp32") -> dict:
    """The exactness report for a local model; the caller exits non-zero unless ok.  ``prefix_sharing`` holds the
    same comparison for prefix-shared rows when the backend runs them (else null)."""
    if pairs < 1:
        raise InputError(f"--pairs must be >= 1, got {pairs}")
    cfg = TrainConfig(model=model, tokenizer=tokenizer, attn=attn, dataset=dataset, max_pairs=pairs, dtype=dtype,
                      trust_remote_code=trust_remote_code)
    cfg.validate()
    setup = prepare(cfg, "check")
    columns = setup.prepared.dataset.select_columns(["prompt_ids", "chosen_ids", "rejected_ids"])
    pairs, lm = columns.to_list(), model_alone(setup)
    result = packing_exactness(lm, pairs, setup.model_attn, setup.pad_token_id)
    shared = (packing_exactness(lm, pairs, setup.model_attn, setup.pad_token_id, shared_prefix=True)
              if setup.prefix_sharing else None)
    return {"model": model, "requested_attn": attn, "dataset": dataset or "synthetic", **result,
            "attn": setup.attn, "prefix_sharing": shared, "ok": result["ok"] and (shared is None or shared["ok"])}
