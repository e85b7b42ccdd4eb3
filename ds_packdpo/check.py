"""``ds-packdpo check``: packed against one-sequence-at-a-time log-probs of a real model, in one process."""

from __future__ import annotations

import torch

from .config import check_model_folder
from .data.prepare import DataConfig, prepare_pairs
from .data.tokenizer import load_tokenizer
from .errors import InputError
from .model.attention import resolve_attn
from .model.build import TORCH_DTYPES, build_model
from .model.guard import packing_exactness, synthetic_pairs


def run_check(model: str, tokenizer: str, attn: str = "auto", dataset: str | None = None, pairs: int = 4,
              trust_remote_code: bool = False, dtype: str = "fp32") -> dict:
    """Body of ``ds-packdpo check``: the exactness report for a local model; the caller exits non-zero unless ok."""
    if pairs < 1:
        raise InputError(f"--pairs must be >= 1, got {pairs}")
    if dtype not in TORCH_DTYPES:
        raise InputError(f"--dtype: unknown {dtype!r} (choices: {', '.join(TORCH_DTYPES)})")
    check_model_folder(model)  # before the tokenizer, which defaults to the same folder
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    resolved = resolve_attn(attn, device_type, needs_backward=False)
    tok = load_tokenizer(tokenizer, trust_remote_code=trust_remote_code)
    lm = build_model(model, None, len(tok), TORCH_DTYPES[dtype], resolved, trust_remote_code=trust_remote_code)
    lm.to(device_type)
    pad_token_id = next(t for t in (tok.pad_token_id, tok.eos_token_id, 0) if t is not None)
    if dataset is None:
        check_pairs = synthetic_pairs(pairs, len(tok))
    else:
        prepared = prepare_pairs(DataConfig(dataset=dataset, max_pairs=pairs), tok)
        check_pairs = prepared.dataset.select_columns(["prompt_ids", "chosen_ids", "rejected_ids"]).to_list()
    result = packing_exactness(lm, check_pairs, resolved, pad_token_id)
    return {"model": model, "requested_attn": attn, "dataset": dataset or "synthetic", **result}
