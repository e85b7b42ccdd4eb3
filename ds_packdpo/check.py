"""``ds-packdpo check``: packed against one-sequence-at-a-time log-probs of a real model, in one process.

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
    """The exactness report for a local model; the caller exits non-zero unless ok."""
    if pairs < 1:
        raise InputError(f"--pairs must be >= 1, got {pairs}")
    cfg = TrainConfig(model=model, tokenizer=tokenizer, attn=attn, dataset=dataset, max_pairs=pairs, dtype=dtype,
                      trust_remote_code=trust_remote_code)
    cfg.validate()
    setup = prepare(cfg, "check")
    columns = setup.prepared.dataset.select_columns(["prompt_ids", "chosen_ids", "rejected_ids"])
    result = packing_exactness(model_alone(setup), columns.to_list(), setup.attn, setup.pad_token_id)
    return {"model": model, "requested_attn": attn, "dataset": dataset or "synthetic", **result}
