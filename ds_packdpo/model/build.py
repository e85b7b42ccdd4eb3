"""Building or loading the causal LM: a local HF folder or a hub id, or random weights from a config.

Random weights depend on the seed only, so a policy and a reference built alike are
identical, and every rank of a run builds the same model.  :data:`ARCHITECTURES` is the
matrix of tiny random-weight models of real transformers config classes on which the
tests check that packing is exact (``--model-config tiny-<name>`` builds one).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError
from transformers import (AutoConfig, AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, LlamaConfig,
                          MistralConfig, Olmo2Config, Phi3Config, Qwen2Config, Qwen2MoeConfig, Qwen3Config)

from ..errors import InputError, first_line
from ..hub import check_model_source, hub_load_error, is_hub_id
from .attention import attn_implementation
from .lora import LoraSettings

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # keyed by config.DTYPES (resolved)
CONFIG_CLASSES = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig,
                  "gemma2": Gemma2Config, "gemma3": Gemma3TextConfig, "phi3": Phi3Config, "olmo2": Olmo2Config,
                  "qwen2_moe": Qwen2MoeConfig}
# The architecture matrix: (config class, what each exercises).  Windows are 8 tokens, so that test sequences
# exceed them; soft-caps are small enough to bind on the small logits of random weights.
SLIDING_WINDOW = 8
ARCHITECTURES = {
    "llama": ("llama", {}),
    "qwen2-swa": ("qwen2", {"use_sliding_window": True, "sliding_window": SLIDING_WINDOW,
                            "max_window_layers": 1}),  # layer 0 full, layer 1 sliding
    "qwen3": ("qwen3", {}),  # q/k RMS norm per head
    "mistral": ("mistral", {"sliding_window": SLIDING_WINDOW}),  # every layer sliding
    "gemma2": ("gemma2", {"sliding_window": SLIDING_WINDOW, "query_pre_attn_scalar": 16, "tie_word_embeddings": True,
                          "attn_logit_softcapping": 0.05, "final_logit_softcapping": 0.5}),  # sliding, full
    "gemma3": ("gemma3", {"sliding_window": SLIDING_WINDOW, "query_pre_attn_scalar": 16, "tie_word_embeddings": True,
                          "layer_types": ["sliding_attention", "full_attention"], "final_logit_softcapping": 0.5}),
    "phi3": ("phi3", {"sliding_window": SLIDING_WINDOW, "pad_token_id": 0, "eos_token_id": 2}),  # fused qkv
    "olmo2": ("olmo2", {"pad_token_id": 0, "eos_token_id": 2}),  # q/k RMS norm over all heads
    "qwen2-moe": ("qwen2_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                "shared_expert_intermediate_size": 64}),
}
TINY_CONFIGS = {"tiny": "llama", "tiny-qwen2": "qwen2", **{f"tiny-{name}": name for name in ARCHITECTURES}}


@dataclass(frozen=True)
class ModelSpec:
    """The policy (and its reference's weights): where they come from, the precision they run in, the seed of random
    weights and adapters, LoRA, activation checkpointing, the compiled or fused kernels of its layers."""

    path: str | None  # --model: a local folder or a hub id
    config: str | None  # --model-config: random weights from a config ('tiny' when neither is given)
    reference: str | None  # --ref-model: a separate frozen reference (default: the policy's own weights)
    revision: str | None  # of a hub --model
    trust_remote_code: bool
    dtype: str  # fp32 or bf16 (--dtype auto resolved for the device)
    seed: int  # random weights (policy and reference alike) and the adapters' initialisation
    lora: LoraSettings | None  # None: every weight trains
    gradient_checkpointing: bool
    compile_layers: bool = False  # torch.compile of each decoder layer (model/kernels.py)
    liger_kernels: bool = False  # liger-kernel's norm/SwiGLU/rotary patched in (resolved: only where they run)

    def __post_init__(self):
        if self.dtype not in TORCH_DTYPES:
            raise ValueError(f"ModelSpec.dtype {self.dtype!r}: resolve --dtype first")
        if self.path is not None and self.config is not None:
            raise InputError("--model and --model-config are exclusive: load a folder or build from a config")
        for name, where in ((self.path, "--model"), (self.reference, "--ref-model")):
            if name is not None:
                check_model_source(name, where)
        if self.revision is not None and (self.path is None or not is_hub_id(self.path)):
            raise InputError(f"--revision {self.revision}: names a revision of a hub --model, and --model "
                             f"{self.path or '(none)'} is not a hub id")
        if self.path is None and self.reference is not None:
            raise InputError("--ref-model needs --model (a model built from a config is its own reference)")

    @property
    def built_config(self) -> str:
        """The config random weights are built from (without --model)."""
        return self.config or "tiny"

    @property
    def source(self) -> str:
        """The flag that names the policy, for messages."""
        return f"--model {self.path}" if self.path else f"--model-config {self.built_config}"

    @property
    def name(self) -> str:
        """The policy's folder, hub id or built config, for reports."""
        return self.path or self.built_config


def tiny_config(arch: str = "llama", vocab_size: int = 1024, hidden_size: int = 64, layers: int = 2, heads: int = 4,
                kv_heads: int = 2, max_position_embeddings: int = 4096, **overrides):
    """A small random-weight config of a real architecture (grouped-query attention, RoPE): ``arch`` is a
    config class (:data:`CONFIG_CLASSES`) or an entry of the matrix (:data:`ARCHITECTURES`)."""
    if arch in ARCHITECTURES:
        arch, matrix = ARCHITECTURES[arch]
        overrides = {**matrix, **overrides}
    if arch not in CONFIG_CLASSES:
        raise ValueError(f"tiny_config: unknown arch {arch!r} (choices: {', '.join([*CONFIG_CLASSES, *ARCHITECTURES])})")
    settings = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=4 * hidden_size,
                    num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                    head_dim=hidden_size // heads, max_position_embeddings=max_position_embeddings,
                    tie_word_embeddings=False)
    return CONFIG_CLASSES[arch](**{**settings, **overrides})


def load_model_config(model_config: str, vocab_size: int, check_buildable: bool = False):
    """A name of :data:`TINY_CONFIGS` ('tiny': Llama, 'tiny-mistral', ...), or a config.json / a folder holding one.

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
                seed: int = 0, trust_remote_code: bool = False, revision: str | None = None):
    """``from_pretrained(model)`` for a local HF folder or a hub id (at ``revision``), else random weights from
    ``model_config`` (default 'tiny').

    Random weights depend on ``seed`` only (the global RNG is left as it was), so a
    policy and a reference built alike are identical.
    """
    if model is not None:
        check_model_source(model)
        try:
            lm = AutoModelForCausalLM.from_pretrained(model, dtype=dtype, attn_implementation=attn_implementation(attn),
                                                      trust_remote_code=trust_remote_code, revision=revision)
        except (OSError, ValueError) as error:
            if is_hub_id(model) and isinstance(error, OSError):
                raise hub_load_error("--model", model, error) from None
            raise InputError(f"--model {model}: cannot load with --attn {attn} ({first_line(error)})") from None
        _check_vocab(lm.config, vocab_size, f"--model {model}")
        return lm
    config = load_model_config(model_config or "tiny", vocab_size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation(attn),
                                                trust_remote_code=trust_remote_code)


def load_pretrained_config(model: str, where: str = "--model", revision: str | None = None,
                           trust_remote_code: bool = False):
    """The HF config of a local folder or hub id (phase one: the config alone, no weights)."""
    check_model_source(model, where)
    try:
        return AutoConfig.from_pretrained(model, revision=revision, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        if is_hub_id(model) and isinstance(error, OSError):
            raise hub_load_error(where, model, error) from None
        raise InputError(f"{where} {model}: unreadable model config ({first_line(error)})") from None
