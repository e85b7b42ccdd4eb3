"""What a model config and a model folder must satisfy for a rank to run them, checked in phase one.

transformers builds a model from a config that cannot run a forward (4 query heads over 3
key/value heads builds, and fails in the first attention), and a folder without its weight
files, or whose embedding is smaller than its tokenizer, fails only in the ranks, after the
launcher's output (the first blamed on the attention backend).  Here each is one line naming
the rule it breaks, from the config and the weight files' headers alone (no weights read).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from safetensors import safe_open

from ..errors import InputError

# the files from_pretrained loads the weights from, in its order of preference
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
EMBEDDING = re.compile(r"(^|\.)(embed_tokens|wte|word_embeddings|embed_in)\.weight$")
SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


def text_config(config):
    """The language model's part of a config (a multimodal one nests it)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def forward_rule_broken(config) -> str | None:
    """The rule of attention and rotary embeddings ``config`` breaks (None: none): sizes positive, query heads a
    multiple of key/value heads, hidden size a multiple of heads unless head_dim is given, an even rotary width."""
    config = text_config(config)
    for key in SIZES:
        value = getattr(config, key, None)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            return f"{key} must be a positive integer, got {value!r}"
    heads, hidden = getattr(config, "num_attention_heads", None), getattr(config, "hidden_size", None)
    if heads is None or hidden is None:
        return None  # not a decoder of the usual shape: left to transformers
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if not isinstance(kv_heads, int) or kv_heads < 1 or heads % kv_heads:
        return (f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads} (grouped-query "
                f"attention shares each key/value head among a whole number of query heads)")
    head_dim = getattr(config, "head_dim", None)
    if head_dim is None:
        if hidden % heads:
            return (f"hidden_size {hidden} is not a multiple of num_attention_heads {heads} (and no head_dim is "
                    f"given)")
        head_dim = hidden // heads
    if not isinstance(head_dim, int) or head_dim < 1:
        return f"head_dim must be a positive integer, got {head_dim!r}"
    rotary = _has_rotary(config)
    if rotary:
        width = int(head_dim * (getattr(config, "partial_rotary_factor", None) or 1.0))
        if width % 2:
            return f"the rotary embedding's width {width} (head_dim {head_dim}) is odd; rotary embeddings need it even"
    return None


def _has_rotary(config) -> bool:
    return any(getattr(config, key, None) is not None for key in ("rope_theta", "rope_parameters", "rope_scaling"))


def check_forward_rules(config, where: str) -> None:
    """InputError naming ``where`` and the rule, for a config that builds but cannot run a forward."""
    broken = forward_rule_broken(config)
    if broken:
        raise InputError(f"{where}: the model config cannot run a forward: {broken}")


def weight_files(folder: Path) -> list[Path] | str:
    """The weight files of a local HF folder, or why it has none (an index naming files that are not there)."""
    for index in WEIGHT_INDEXES:
        if (folder / index).is_file():
            try:
                names = sorted(set(json.loads((folder / index).read_text())["weight_map"].values()))
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as error:
                return f"unreadable {index} ({type(error).__name__})"
            missing = [name for name in names if not (folder / name).is_file()]
            if missing:
                return f"{index} names {len(missing)} missing weight file(s): {', '.join(missing[:3])}"
            return [folder / name for name in names]
    present = [folder / name for name in WEIGHT_FILES if (folder / name).is_file()]
    return present or f"no weight files ({', '.join((*WEIGHT_FILES, *WEIGHT_INDEXES))})"


def embedding_rows(files: list[Path]) -> int | None:
    """The input embedding's row count from the safetensors headers (None: not found, or not safetensors)."""
    for path in files:
        if path.suffix != ".safetensors":
            continue
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                if EMBEDDING.search(name):
                    return int(handle.get_slice(name).get_shape()[0])
    return None


def check_model_folder(folder: str, config, tokens: int, own_tokenizer: bool, where: str = "--model") -> None:
    """A local HF folder: its weight files are there, and neither its config's vocab_size nor its embedding is
    smaller than the tokenizer's ``tokens`` (``own_tokenizer``: the folder's own tokenizer)."""
    path = Path(folder)
    if not path.is_dir():
        return  # a hub id: from_pretrained fetches the files
    files = weight_files(path)
    if isinstance(files, str):
        raise InputError(f"{where} {folder}: {files}")
    whose = "its own tokenizer" if own_tokenizer else "the tokenizer"
    vocab = getattr(text_config(config), "vocab_size", None)
    rows = embedding_rows(files)
    for what, size in (("config's vocab_size", vocab), ("embedding's row count", rows)):
        if size is not None and size < tokens:
            hint = ("the folder's config/weights and tokenizer do not belong together" if own_tokenizer
                    else "pass the model's own tokenizer (drop --tokenizer)")
            raise InputError(f"{where} {folder}: the {what} {size} is smaller than the {tokens} tokens of {whose}: "
                             f"token ids >= {size} would index past the embedding ({hint})")
