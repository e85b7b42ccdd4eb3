"""Building or loading the causal LM: a local HF folder, or random weights from a config.

Random weights depend on the seed only, so a policy and a reference built alike are
identical, and every rank of a run builds the same model.
"""

from __future__ import annotations

from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, Qwen2Config

from ..config import check_model_folder
from ..errors import InputError, first_line

TINY_CONFIGS = {"tiny": "llama", "tiny-qwen2": "qwen2"}
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # keyed by config.DTYPES


def tiny_config(arch: str = "llama", vocab_size: int = 1024, hidden_size: int = 64, layers: int = 2, heads: int = 4,
                kv_heads: int = 2, max_position_embeddings: int = 4096, **overrides):
    """A small random-weight config of a real architecture (grouped-query attention, RoPE)."""
    config_classes = {"llama": LlamaConfig, "qwen2": Qwen2Config}
    if arch not in config_classes:
        raise ValueError(f"tiny_config: unknown arch {arch!r} (choices: {', '.join(config_classes)})")
    settings = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=4 * hidden_size,
                    num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                    max_position_embeddings=max_position_embeddings, tie_word_embeddings=False)
    return config_classes[arch](**{**settings, **overrides})


def load_model_config(model_config: str, vocab_size: int, check_buildable: bool = False):
    """'tiny' (Llama), 'tiny-qwen2', or a config.json / a folder holding one.

    ``check_buildable`` (phase one) also builds the model on the meta device, so that an
    impossible size fails before any rank starts.  Not when building the real model:
    under ZeRO-3 transformers wraps every from_config in ``zero.Init``, which cannot
    initialize meta tensors.
    """
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
    except (OSError, ValueError, KeyError, TypeError, ArithmeticError, StrictDataclassError) as error:
        # transformers validates some values as it builds the config (StrictDataclassError, a division by 0 heads)
        raise InputError(f"--model-config {path}: unreadable model config ({first_line(error)})") from None
    _check_vocab(config, vocab_size, f"--model-config {path}")
    if not check_buildable:
        return config
    try:
        with torch.device("meta"):  # the layers' shapes, with no memory: an impossible size fails here, not in a rank
            AutoModelForCausalLM.from_config(config)
    except (RuntimeError, ValueError, TypeError, ArithmeticError) as error:
        raise InputError(f"--model-config {path}: cannot build a model from it ({first_line(error)})") from None
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
    if model is not None:
        folder = check_model_folder(model)
        try:
            lm = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, attn_implementation=attn,
                                                      trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as error:
            raise InputError(f"--model {model}: cannot load with --attn {attn} ({first_line(error)})") from None
        _check_vocab(lm.config, vocab_size, f"--model {model}")
        return lm
    config = load_model_config(model_config or "tiny", vocab_size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn,
                                                trust_remote_code=trust_remote_code)
