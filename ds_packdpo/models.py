"""Building or loading the causal LM, and the guard that packing is exact for it.

The guard exists because exactness is a property of the (model, attention backend,
transformers/torch version) combination, not of this code alone: transformers only
builds the per-sequence mask under conditions that have changed between releases,
and a backend that lets packed sequences attend to each other trains on silently
wrong log-probs.  So the real model is run on real (or synthetic) pairs packed into
one row and one sequence at a time, and the per-sequence log-probs are compared.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from pathlib import Path

import torch

from .attention import resolve_attn
from .collate import collate_packed, collate_padded
from .errors import InputError
from .logps import forward_logps

TINY_CONFIGS = {"tiny": "llama", "tiny-qwen2": "qwen2"}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Packed and alone forwards run different kernel shapes, so they round differently.
# Measured on CPU with tiny random models (sdpa): fp32 agrees to <= 2e-5 absolute, bf16 to
# ~4e-5 of |logps|, while a cross-attending forward differs by 6e-4..1e-1 absolute
# (3e-5..6e-3 relative: random weights barely use context, real ones much more).
FP32_ATOL = 1e-4
HALF_RTOL = 1e-3


class PackingNotExactError(RuntimeError):
    """The attention backend lets packed sequences see each other (or is otherwise inexact)."""


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def tiny_config(arch: str = "llama", vocab_size: int = 1024, hidden_size: int = 64, layers: int = 2, heads: int = 4,
                kv_heads: int = 2, max_position_embeddings: int = 4096, **overrides):
    """A small random-weight config of a real architecture (grouped-query attention, RoPE)."""
    from transformers import LlamaConfig, Qwen2Config

    config_classes = {"llama": LlamaConfig, "qwen2": Qwen2Config}
    if arch not in config_classes:
        raise ValueError(f"tiny_config: unknown arch {arch!r} (choices: {', '.join(config_classes)})")
    settings = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=4 * hidden_size,
                    num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                    max_position_embeddings=max_position_embeddings, tie_word_embeddings=False)
    return config_classes[arch](**{**settings, **overrides})


def load_model_config(model_config: str, vocab_size: int):
    """'tiny' (Llama), 'tiny-qwen2', or a config.json / a folder holding one."""
    from transformers import AutoConfig

    if model_config in TINY_CONFIGS:
        return tiny_config(TINY_CONFIGS[model_config], vocab_size=vocab_size)
    path = Path(model_config)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise InputError(f"--model-config {model_config}: no such config file "
                         f"(expected {', '.join(map(repr, TINY_CONFIGS))}, a config.json or a folder holding one)")
    try:
        config = AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError, KeyError) as error:
        raise InputError(f"--model-config {path}: unreadable model config ({_first_line(error)})") from None
    _check_vocab(config, vocab_size, f"--model-config {path}")
    return config


def _check_vocab(config, vocab_size: int, where: str) -> None:
    model_vocab = getattr(config, "vocab_size", None)
    if model_vocab is not None and model_vocab < vocab_size:
        raise InputError(f"{where}: vocab_size {model_vocab} is smaller than the tokenizer's {vocab_size} tokens "
                         f"(use the model's own tokenizer or a config with vocab_size >= {vocab_size})")


def build_model(model: str | None, model_config: str | None, vocab_size: int, dtype: torch.dtype, attn: str,
                seed: int = 0, trust_remote_code: bool = False):
    """``from_pretrained(model)`` for a local HF folder, else random weights from ``model_config`` (default 'tiny').

    Random weights depend on ``seed`` only (the global RNG is left as it was), so a
    policy and a reference built alike are identical.
    """
    from transformers import AutoModelForCausalLM

    if model is not None:
        folder = Path(model)
        if not (folder / "config.json").is_file():
            reason = "no config.json in the folder" if folder.is_dir() else "no such folder"
            raise InputError(f"--model {model}: not a local HF model folder ({reason})")
        try:
            lm = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, attn_implementation=attn,
                                                      trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as error:
            raise InputError(f"--model {model}: cannot load with --attn {attn} ({_first_line(error)})") from None
        _check_vocab(lm.config, vocab_size, f"--model {model}")
        return lm
    config = load_model_config(model_config or "tiny", vocab_size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn,
                                                trust_remote_code=trust_remote_code)


def synthetic_pairs(num_pairs: int, vocab_size: int, seed: int = 0, max_tokens: int = 24) -> list[dict]:
    """Random-id pairs of different lengths; the same on every rank for a seed (CPU generator)."""
    generator = torch.Generator().manual_seed(seed)

    def ids(low: int) -> list[int]:
        length = int(torch.randint(low, max_tokens + 1, (), generator=generator))
        return torch.randint(0, vocab_size, (length,), generator=generator).tolist()

    return [{"prompt_ids": ids(2), "chosen_ids": ids(1), "rejected_ids": ids(1)} for _ in range(num_pairs)]


@contextmanager
def _evaluating(model):
    """Eval mode (no dropout) for the comparison, then the previous mode back."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def _each_sequence_alone(model, padded, attn: str, forward=forward_logps) -> torch.Tensor:
    """Log-probs [S] with every row of a padded batch cut to its own length and run as a batch of one, no mask."""
    total = torch.zeros(padded.num_sequences, device=padded.input_ids.device)
    for row, length in enumerate(padded.attention_mask.sum(dim=1).tolist()):
        cut = (slice(row, row + 1), slice(0, length))
        alone = dataclasses.replace(
            padded, input_ids=padded.input_ids[cut], position_ids=padded.position_ids[cut], attention_mask=None,
            labels=padded.labels[cut], seq_index=padded.seq_index[cut], cu_seqlens=None, max_seqlen=length,
            real_tokens=length, computed_tokens=length)
        total += forward(model, alone, attn).logps  # zero everywhere but this sequence's slot
    return total


def packing_exactness(model, sequences_pairs: list[dict], attn: str, pad_token_id: int, device=None,
                      tolerance: float | None = None, forward=forward_logps) -> dict:
    """Per-sequence log-probs of the pairs packed in one row vs each sequence alone.

    ``tolerance`` defaults to 1e-4 absolute in fp32 and to 1e-3 of |logps| per
    sequence in bf16/fp16.  The number of forwards depends on the pairs only (1 +
    2 * pairs), so every rank of a ZeRO-3 job runs them together.  Pass ``device``
    (the compute device) when parameters may live elsewhere (ZeRO-3 parameter offload); ``forward``
    replaces :func:`forward_logps` (sequence parallelism runs both sides split over its group).
    """
    if not sequences_pairs:
        raise ValueError("packing_exactness needs at least one pair")
    parameter = next(model.parameters())
    device = parameter.device if device is None else torch.device(device)
    index = list(range(len(sequences_pairs)))
    with torch.no_grad(), _evaluating(model):
        packed = forward(model, collate_packed(sequences_pairs, index, pad_token_id).to(device), attn)
        alone = _each_sequence_alone(model, collate_padded(sequences_pairs, index, pad_token_id).to(device), attn,
                                     forward)
    abs_diff = (packed.logps - alone).abs()
    rel_diff = abs_diff / alone.abs().clamp_min(1.0)
    relative = parameter.dtype in (torch.bfloat16, torch.float16)
    if tolerance is None:
        tolerance = HALF_RTOL if relative else FP32_ATOL
    measured = rel_diff.max() if relative else abs_diff.max()
    return {
        "attn": attn,
        "pairs": len(sequences_pairs),
        "dtype": str(parameter.dtype).removeprefix("torch."),
        "max_abs_diff_logps": float(abs_diff.max()),
        "max_rel_diff_logps": float(rel_diff.max()),
        "tolerance": float(tolerance),
        "tolerance_kind": "relative" if relative else "absolute",
        "ok": bool(measured <= tolerance),  # False for NaN too
    }


def assert_packing_exact(model, attn: str, vocab_size: int, pad_token_id: int, device=None,
                         forward=forward_logps) -> dict:
    """The start-up guard: one fixed synthetic pair (two sequences), identical on every rank."""
    result = packing_exactness(model, synthetic_pairs(1, vocab_size, seed=0, max_tokens=12), attn, pad_token_id,
                               device, forward=forward)
    if not result["ok"]:
        measured = result["max_rel_diff_logps"] if result["tolerance_kind"] == "relative" else result["max_abs_diff_logps"]
        raise PackingNotExactError(
            f"--attn {attn}: packed rows are not exact with this model/backend/version: per-sequence log-probs of a "
            f"packed row differ from each sequence alone by {measured:.3g} ({result['tolerance_kind']}, tolerance "
            f"{result['tolerance']:.3g}); sequences would attend across their boundaries - use another --attn "
            f"(e.g. sdpa) or --no-packing")
    return result


def run_check(model: str, tokenizer: str, attn: str = "auto", dataset: str | None = None, pairs: int = 4,
              trust_remote_code: bool = False, dtype: str = "fp32") -> dict:
    """Body of ``ds-packdpo check``: the exactness report for a local model; the caller exits non-zero unless ok."""
    from .tokenizer import load_tokenizer

    if pairs < 1:
        raise InputError(f"--pairs must be >= 1, got {pairs}")
    if dtype not in DTYPES:
        raise InputError(f"--dtype: unknown {dtype!r} (choices: {', '.join(DTYPES)})")
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    resolved = resolve_attn(attn, device_type, needs_backward=False)
    tok = load_tokenizer(tokenizer, trust_remote_code=trust_remote_code)
    lm = build_model(model, None, len(tok), DTYPES[dtype], resolved, trust_remote_code=trust_remote_code)
    lm.to(device_type)
    pad_token_id = next(t for t in (tok.pad_token_id, tok.eos_token_id, 0) if t is not None)
    if dataset is None:
        check_pairs = synthetic_pairs(pairs, len(tok))
    else:
        from .data import DataConfig, prepare_pairs

        prepared = prepare_pairs(DataConfig(dataset=dataset, max_pairs=pairs), tok)
        check_pairs = prepared.dataset.select_columns(["prompt_ids", "chosen_ids", "rejected_ids"]).to_list()
    result = packing_exactness(lm, check_pairs, resolved, pad_token_id)
    return {"model": model, "requested_attn": attn, "dataset": dataset or "synthetic", **result}
