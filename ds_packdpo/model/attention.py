"""Attention backends for packed rows, and the keyword arguments of the model forward.

A packed row holds many sequences back to back; each must attend only to itself.
Two ways get there in transformers 5.x:

* ``sdpa`` / ``eager`` / ``flex_attention``: transformers builds a block-diagonal
  causal mask from ``position_ids`` (which restart at 0 for every sequence) - but
  only when ``attention_mask is None`` and there is no KV cache.  A forward without
  ``use_cache=False`` silently attends across sequences (measured here: max logit
  difference ~1.0 instead of ~3e-7), so every forward built here passes
  ``use_cache=False`` and, for a packed row, no attention mask.
* ``sdpa_varlen`` (this module, registered with transformers' ``AttentionInterface`` as
  ``ds_packdpo_varlen``):
  torch's causal sdpa run once per sequence of the row, so attention costs
  sum(L_i^2) instead of the T^2 of a dense block-diagonal mask (on small models,
  where attention dominates, the dense mask would eat the whole gain of packing).
  It is exact by construction and needs nothing but torch, so ``auto`` picks it
  on CPU.  Padded batches (an attention mask is given) run plain sdpa.
* ``torch_varlen`` (``model/torch_varlen.py``, registered as ``ds_packdpo_torch_varlen``):
  PyTorch's own FlashAttention varlen kernel on CUDA, one call per row with its
  ``cu_seqlens``; the CUDA default in half precision when flash-attn is not installed.
* ``flash_attention_2`` / ``flash_attention_3``: the varlen kernels take the
  sequence boundaries directly.  We pass ``cu_seqlens`` and ``max_seqlen`` from the
  collated batch as flash-attention kwargs, so transformers does not rediscover the
  boundaries from ``position_ids`` (which costs a device->host sync every layer call).

What each backend can do (half precision only, CUDA only, prefix-shared rows, Ulysses'
local kernel, attention soft-caps, a CPU backward, ...) is one row of :data:`BACKENDS`:
phase one's refusals and the run-time choices read those fields, nothing else.

flash-attn is an optional extra that cannot even be installed without CUDA; only
its presence is probed (through transformers, which does not import it).

Sliding windows and soft-capping (Mistral, Qwen2, Gemma 2/3, Phi-3) are per-layer
features that transformers hands to the attention function as the ``sliding_window``
and ``softcap`` keyword arguments (None on a layer without them).  Every kernel here
applies them with transformers' own meaning (``sequence_attention.causal_window_mask``,
the one per-sequence kernel ``attend_sequence``; prefix-shared rows in
``prefix_attention.py``), or the run is refused in phase one
(:func:`check_model_attention`): a kernel that drops one trains on silently wrong log-probs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, AutoModelForCausalLM
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.utils import is_flash_attn_2_available, is_flash_attn_3_available

from ..errors import InputError
from .collate import ModelBatch
from .prefix_attention import PREFIX_FLASH, prefix_attention_forward, shared_prefix_attention
from .sequence_attention import attend_sequence, causal_window_mask, mask_safe_kernels, masked_attention
from . import torch_varlen
from .torch_varlen import TORCH_VARLEN, TORCH_VARLEN_IMPLEMENTATION

SDPA_VARLEN = "sdpa_varlen"
# The attn_implementation sdpa_varlen is registered under: transformers applies its sdpa checks to any name that
# contains "sdpa" (and refuses Gemma 2, whose soft-capping its sdpa lacks), which this kernel does not need.
VARLEN_IMPLEMENTATION = "ds_packdpo_varlen"
# The attention_implementation name of DeepSpeed-Ulysses (ds_packdpo.sequence_parallel registers it).
ULYSSES_ATTN = "ds_packdpo_ulysses"
AUTO = "auto"


def flash_attention_available(name: str) -> bool:
    """True when the flash-attn package for ``name`` is installed and CUDA works (nothing is imported)."""
    probe = {"flash_attention_2": is_flash_attn_2_available, "flash_attention_3": is_flash_attn_3_available}[name]
    return bool(probe())


def _flash_missing(name: str) -> str | None:
    if flash_attention_available(name):
        return None
    package = "flash-attn" if name == "flash_attention_2" else "flash-attn-3 (flash_attn_interface)"
    return (f"the {package} package is not installed or too old (pip install flash-attn --no-build-isolation), or "
            f"use --attn {TORCH_VARLEN}")


def _torch_varlen_missing(name: str) -> str | None:
    if torch_varlen.varlen_kernel() is not None:
        return None
    return (f"torch {torch.__version__} has no varlen_attn with window_size (torch >= 2.11 has it); upgrade torch, or "
            f"use --attn {SDPA_VARLEN}")


@dataclass(frozen=True)
class AttentionBackend:
    """One ``--attn`` backend and what it can do.  Phase one's refusals (:func:`resolve_attn`,
    :func:`check_model_attention`, :func:`prefix_sharing_obstacle`, the sequence-parallel check) and the run-time
    choices (the model's attention implementation, Ulysses' local kernel) read these fields and nothing else: a new
    backend is one row of :data:`BACKENDS` (and its kernel)."""

    name: str
    implementation: str  # the attn_implementation a model is built with
    half_precision_only: bool = False  # FlashAttention kernels: bf16/fp16
    cuda_only: bool = False
    varlen: bool = False  # takes a packed row's boundaries as cu_seqlens kwargs (no mask from position ids)
    own_kernel: bool = False  # this package's per-sequence kernels: causal and sliding-window layers only
    prefix_sharing: bool = False  # runs prefix-shared rows ([prompt | chosen | rejected]) at one rank
    # why its prefix-shared rows are not trusted on CUDA in half precision (None: they are)
    cuda_half_prefix_caveat: str | None = None
    shared_implementation: str | None = None  # the attn_implementation of its prefix-shared rows, when not its own
    ulysses_local: str | None = None  # the backend whose kernel runs locally under Ulysses (None: cannot)
    no_softcap: str | None = None  # what to say of a layer's attention soft-cap it cannot apply (None: it applies it)
    backward_on_cpu: bool = True  # has a backward on CPU (training needs one)
    transformers_flag: str | None = None  # transformers' flag on a model class that supports it
    missing: Callable[[str], str | None] = lambda name: None  # why this install cannot run it (None: it can)

    def model_implementation(self, sp_size: int, shares_prefixes: bool) -> str:
        """The model's attention: Ulysses (around this backend) under sequence parallelism, the shared-row variant of
        a backend that has one for prefix-shared rows, else this backend."""
        if sp_size > 1:
            return ULYSSES_ATTN
        return self.shared_implementation if shares_prefixes and self.shared_implementation else self.name


_FLASH = dict(half_precision_only=True, cuda_only=True, varlen=True, prefix_sharing=True,
              transformers_flag="_supports_flash_attn", missing=_flash_missing)
BACKENDS: dict[str, AttentionBackend] = {backend.name: backend for backend in (
    AttentionBackend(SDPA_VARLEN, VARLEN_IMPLEMENTATION, varlen=True, own_kernel=True, prefix_sharing=True,
                     cuda_half_prefix_caveat=f"{SDPA_VARLEN}'s prefix-shared rows gave non-finite gradients on CUDA in "
                                             f"half precision (README 'On a GPU'); {TORCH_VARLEN} or flash-attn share "
                                             f"prefixes there",
                     ulysses_local=SDPA_VARLEN),
    AttentionBackend(TORCH_VARLEN, TORCH_VARLEN_IMPLEMENTATION, half_precision_only=True, cuda_only=True, varlen=True,
                     own_kernel=True, prefix_sharing=True, ulysses_local=TORCH_VARLEN,
                     no_softcap=f"torch's varlen kernel cannot; use --attn flash_attention_2 (flash-attn >= 2.6) or "
                                f"{SDPA_VARLEN}",
                     missing=_torch_varlen_missing),
    AttentionBackend("sdpa", "sdpa", ulysses_local=SDPA_VARLEN, transformers_flag="_supports_sdpa"),
    AttentionBackend("eager", "eager"),
    AttentionBackend("flex_attention", "flex_attention", backward_on_cpu=False, transformers_flag="_supports_flex_attn"),
    *(AttentionBackend(name, name, shared_implementation=PREFIX_FLASH[name], ulysses_local=name, **_FLASH)
      for name in ("flash_attention_2", "flash_attention_3")),
)}
ATTN_CHOICES = (AUTO, *BACKENDS)
# auto on CUDA in half precision: the first of these whose probe says it runs here, else sdpa_varlen
AUTO_ON_CUDA: dict[str, Callable[[], bool]] = {
    "flash_attention_2": lambda: flash_attention_available("flash_attention_2"),
    "flash_attention_3": lambda: flash_attention_available("flash_attention_3"),
    TORCH_VARLEN: lambda: torch_varlen.torch_varlen_available(),
}
# The names model_forward_kwargs hands a packed row's boundaries to: the varlen backends, Ulysses and the shared-row
# implementations (they run other rows through their backend's own path).
VARLEN_NAMES = (*(b.name for b in BACKENDS.values() if b.varlen), ULYSSES_ATTN, *PREFIX_FLASH.values())


@dataclass(frozen=True)
class AttentionSpec:
    """A run's attention: the backend that runs (--attn resolved), what the model is built with, and whether phase
    two checks its packed rows against each sequence alone before training (model/guard.py)."""

    backend: str  # a key of BACKENDS
    model_attn: str  # AttentionBackend.model_implementation for the run's layout and row layout
    packing_check: bool  # --skip-packing-check turns it off


def attn_implementation(attn: str) -> str:
    """The ``attn_implementation`` a model is built with for backend ``attn`` (or an implementation name itself)."""
    return BACKENDS[attn].implementation if attn in BACKENDS else attn


def resolve_attn(name: str, device_type: str, needs_backward: bool = True, dtype: str = "bf16") -> str:
    """The backend a run will use, or InputError; called before any process group starts.

    ``auto`` on CUDA with ``dtype`` (the resolved --dtype) in half precision is flash-attn's
    varlen kernel when flash-attn is importable, else torch's own (``torch_varlen``, torch >=
    2.11), else sdpa_varlen; on CPU and in fp32 it is sdpa_varlen:
    exact, and on CPU 2.5x (4.5k-token row, 8 sequences) to 5.3x (10.7k tokens, 16
    sequences) faster than sdpa's dense block-diagonal mask for forward+backward of the
    bench model on dpo_en_demo rows (measured here, 1 thread, min of 3).
    ``needs_backward=False`` (the ``check`` command, a frozen reference) allows
    flex_attention on CPU, which torch 2.13 runs forward only.
    """
    if name not in ATTN_CHOICES:
        raise InputError(f"--attn: unknown backend {name!r} (choices: {', '.join(ATTN_CHOICES)})")
    if name == AUTO:
        if device_type == "cuda" and dtype != "fp32":
            for candidate, runs_here in AUTO_ON_CUDA.items():
                if runs_here():
                    return candidate
        return SDPA_VARLEN
    backend = BACKENDS[name]
    if backend.cuda_only and device_type != "cuda":
        raise InputError(f"--attn {name}: needs a CUDA device, this run is on {device_type} "
                         f"(use --attn {SDPA_VARLEN}, sdpa, eager or flex_attention)")
    if backend.half_precision_only and dtype == "fp32":
        raise InputError(f"--attn {name} with --dtype fp32: flash attention kernels run bf16/fp16 only; use "
                         f"--dtype bf16 (or auto, bf16 on CUDA), or --attn {SDPA_VARLEN} for fp32")
    missing = backend.missing(name)
    if missing:
        raise InputError(f"--attn {name}: {missing}")
    if not backend.backward_on_cpu and device_type == "cpu" and needs_backward:
        raise InputError(f"--attn {name}: torch has no FlexAttention backward on CPU "
                         "(training needs one); use --attn sdpa or eager on CPU")
    return name


def prefix_sharing_obstacle(attn: str, sp_size: int, device_type: str, dtype: str) -> str | None:
    """Why ``attn`` cannot run prefix-shared rows here (None: it can).  Every local kernel of Ulysses shares them;
    transformers' sdpa, eager and flex_attention derive their masks from position ids, which cannot say
    [prompt | chosen | rejected]; sdpa_varlen's shared rows gave non-finite or huge gradients on CUDA in half
    precision (H200, torch 2.11, two runs of the matrix) while its kernel alone was exact: not trusted there until
    understood."""
    backend = BACKENDS[attn]
    if sp_size > 1:
        return None
    if not backend.prefix_sharing:
        return f"{attn} derives its masks from position ids, which cannot say [prompt | chosen | rejected]"
    if device_type == "cuda" and dtype != "fp32":
        return backend.cuda_half_prefix_caveat
    return None


def prefix_sharing_backends() -> list[str]:
    """The backends that run prefix-shared rows at one rank (what a refusal names as the way out)."""
    return [name for name, backend in BACKENDS.items() if backend.prefix_sharing]


# ----------------------------------------------------------------------------- what a model's layers need

# Layer kinds the per-sequence kernels implement (transformers' ``config.layer_types`` names).
KERNEL_LAYER_TYPES = ("full_attention", "sliding_attention")


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def sliding_window_of(config) -> int | None:
    """The sliding window of the model's sliding layers (None: every layer attends to the whole sequence).

    Models with ``layer_types`` (Qwen2/3, Gemma 2/3, Qwen2-MoE) window only their
    ``sliding_attention`` layers; those without (Mistral, Phi-3, Mixtral) window every
    layer when ``sliding_window`` is set.  0 counts as none (Qwen2-MoE's "off").
    """
    text = _text_config(config)
    window = getattr(text, "sliding_window", None) or None
    layer_types = getattr(text, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window) if window else None


def attention_features(config) -> dict:
    """The per-layer attention features of a model's config (the README's matrix names them)."""
    text = _text_config(config)
    return {"sliding_window": sliding_window_of(config),
            "attn_logit_softcapping": getattr(text, "attn_logit_softcapping", None),
            "final_logit_softcapping": getattr(text, "final_logit_softcapping", None)}


def check_model_attention(config, attn: str, where: str) -> None:
    """Phase one: the backend honours every attention feature of the model's layers, or one InputError naming the
    model, the feature and a backend that works (before any weights or process group exist).

    transformers refuses some combinations itself (Gemma 2 soft-caps its attention scores, which torch's sdpa
    cannot: ``_supports_sdpa = False``), but only when the model is built, in every rank; the kernels of this
    package (sdpa_varlen, the Ulysses local attention) implement causal, sliding-window and soft-capped layers,
    and nothing else: chunked, bidirectional or other layer kinds are refused rather than run as causal.
    """
    text = _text_config(config)
    backend = BACKENDS[attn]
    model_class = AutoModelForCausalLM._model_mapping.get(type(config), None)  # None: remote code, unchecked
    name = f"{where} ({getattr(text, 'model_type', '?')})"
    flag = backend.transformers_flag
    if flag and model_class is not None and not getattr(model_class, flag, True):
        softcap = getattr(text, "attn_logit_softcapping", None)
        reason = (f"soft-caps its attention scores (attn_logit_softcapping {softcap:g}), which torch's sdpa cannot"
                  if attn == "sdpa" and softcap is not None else f"has no {attn} attention in transformers")
        raise InputError(f"--attn {attn}: {name} {reason}; use --attn {SDPA_VARLEN} or eager")
    softcap = getattr(text, "attn_logit_softcapping", None)
    if backend.no_softcap and softcap is not None:
        raise InputError(f"--attn {attn}: {name} soft-caps its attention scores (attn_logit_softcapping "
                         f"{softcap:g}), which {backend.no_softcap}")
    if backend.own_kernel:  # also the local kernels of Ulysses (phase one passes them for sequence parallelism)
        other = sorted(set(getattr(text, "layer_types", None) or ()) - set(KERNEL_LAYER_TYPES))
        for feature, present in (("attention_chunk_size", getattr(text, "attention_chunk_size", None)),
                                 ("use_bidirectional_attention", getattr(text, "use_bidirectional_attention", None)),
                                 ("layer_types " + ", ".join(other), other)):
            if present:
                raise InputError(f"--attn {attn}: {name} has {feature}, which the per-sequence causal kernel does not "
                                 f"implement; use --attn eager")


def flash_varlen_kwargs(cu_seqlens, max_seqlen: int) -> dict:
    """transformers' names for the varlen boundaries (see ``_flash_attention_forward``).

    The kernels want int32 offsets on the device of the activations and python-int
    maximum lengths (a tensor there would force a sync).
    """
    cu = cu_seqlens.to(dtype=torch.int32)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": int(max_seqlen), "max_length_k": int(max_seqlen)}


def model_forward_kwargs(batch: ModelBatch, attn: str) -> dict:
    """Everything the HF forward needs for ``batch`` with backend ``attn``.

    Packed rows (``attention_mask is None``) get no mask so transformers derives the
    per-sequence causal mask from ``position_ids`` - or, for flash, the explicit
    varlen boundaries.  Padded batches keep their right-padding mask.
    """
    kwargs = {"input_ids": batch.input_ids, "position_ids": batch.position_ids, "use_cache": False}
    if batch.attention_mask is not None:
        kwargs["attention_mask"] = batch.attention_mask
    elif batch.prefix_layout is not None:  # a prefix-shared row: the pair blocks, for model/prefix_attention.py
        kwargs["prefix_layout"] = batch.prefix_layout
    elif attn in VARLEN_NAMES and batch.cu_seqlens is not None:
        kwargs.update(flash_varlen_kwargs(batch.cu_seqlens, batch.max_seqlen))
    return kwargs


# ----------------------------------------------------------------------------- a packed row's attention

def varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens,
                     scale: float | None = None, sliding_window: int | None = None,
                     softcap: float | None = None) -> torch.Tensor:
    """Causal attention of every sequence of a packed row with itself only: ``[T, Hq, D]`` -> ``[T, Hq, D]``.

    ``query`` is ``[T, Hq, D]``, ``key``/``value`` ``[T, Hk, D]`` with ``Hq`` a multiple of
    ``Hk`` (grouped-query attention), the flash-attention varlen layout; ``cu_seqlens``
    the sequence offsets ``[0, L0, L0+L1, ..., T]`` (tensor or ints).  One
    :func:`attend_sequence` call per sequence: exact, O(sum L^2) compute and memory,
    any device and dtype, differentiable; the window and the cap apply inside each
    sequence.  torch has no varlen sdpa kernel outside CUDA (nested-tensor sdpa needs
    CUDA for causal masks), hence the loop; its cost is one small kernel launch per sequence.
    """
    offsets = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    if offsets[0] != 0 or offsets[-1] != query.shape[0]:
        raise ValueError(f"cu_seqlens must run from 0 to {query.shape[0]} tokens, got {offsets[0]}..{offsets[-1]}")
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        # Repeated KV heads rather than enable_gqa: with enable_gqa (or 3-D inputs) torch 2.13 falls back
        # from the fused CPU flash kernel to the math one, measured 2-3x slower here.
        key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    lengths = [end - start for start, end in zip(offsets[:-1], offsets[1:]) if end > start]
    # split (not slicing): its backward is one cat of the pieces' gradients, where every slice's
    # backward would write a zero-filled full-row gradient (O(sequences x T) memory traffic).
    pieces = [t.transpose(0, 1)[None].split(lengths, dim=2) for t in (query, key, value)]  # [1, H, L, D] views
    outputs = [attend_sequence(q, k, v, scale, sliding_window, softcap) for q, k, v in zip(*pieces)]
    return torch.cat(outputs, dim=2)[0].transpose(0, 1)


def _sequence_offsets(position_ids: torch.Tensor) -> torch.Tensor:
    """Offsets of the sequences of a flattened ``[B, L]`` batch: a new one wherever the position does not count on."""
    flat = position_ids.reshape(-1)
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = flat[1:] != flat[:-1] + 1
    starts.view(position_ids.shape)[:, 0] = True  # a row never continues the previous one
    boundaries = starts.nonzero().squeeze(1)
    return torch.cat([boundaries, boundaries.new_tensor([flat.numel()])])


# Attention-function keyword arguments of features no kernel here implements: refused when set, never dropped.
UNSUPPORTED_ATTENTION_KWARGS = ("s_aux", "sinks")


def refuse_unsupported_kwargs(kernel: str, kwargs: dict) -> None:
    """A layer feature the kernel would silently drop (attention sinks, ...) stops the forward instead."""
    for name in UNSUPPORTED_ATTENTION_KWARGS:
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"attention {kernel!r}: the model's layers pass {name!r}, which it does not "
                                      f"implement; use --attn eager")


def sdpa_segments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                  *, scale: float | None = None, sliding_window: int | None = None,
                  softcap: float | None = None) -> torch.Tensor:
    """:func:`varlen_attention` in the packed-row kernels' signature (``max_seqlen`` unused): sdpa_varlen's kernel,
    and the local kernel of Ulysses for sdpa."""
    del max_seqlen
    return varlen_attention(q, k, v, cu_seqlens, scale=scale, sliding_window=sliding_window, softcap=softcap)


# own-kernel backend -> (its packed-row kernel, its prefix-shared-row kernel); its attention function is built from
# them (and they are Ulysses' local kernels).
PACKED_KERNELS = {SDPA_VARLEN: (sdpa_segments, shared_prefix_attention),
                  TORCH_VARLEN: (torch_varlen.packed_attention, torch_varlen.shared_prefix_attention)}


def _own_kernel_forward(attn: str):
    """transformers' attention function of backend ``attn``'s implementation (one of this package's kernels): q/k/v ``[B, H, L, D]`` -> ``([B, L, H, D], None)``.

    Without a mask (packed rows) the row's sequence boundaries come from the ``cu_seq_lens_q`` /
    ``max_length_q`` kwargs (``model_forward_kwargs`` passes them) or, failing that, from where
    ``position_ids`` restart, and the row runs the backend's packed kernel with the layer's window
    and cap.  A prefix-shared row (the ``prefix_layout`` kwarg) runs its shared-row kernel.  With a
    mask (padded batches) it is sdpa on transformers' mask (which holds the window), or the scores
    materialized when the layer soft-caps.
    """
    packed_kernel, shared_kernel = PACKED_KERNELS[attn]

    def forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None,
                sliding_window: int | None = None, softcap: float | None = None, **kwargs):
        refuse_unsupported_kwargs(attn, kwargs)
        if kwargs.get("prefix_layout") is not None:
            return prefix_attention_forward(shared_kernel, query, key, value, kwargs["prefix_layout"], dropout,
                                            scaling, sliding_window, softcap)
        if attention_mask is not None or dropout or query.shape[2] != key.shape[2]:
            return _masked_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal,
                                   sliding_window, softcap, **kwargs)
        batch, heads, length, dim = query.shape
        cu_seqlens, max_seqlen = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
        if cu_seqlens is None or batch != 1:
            position_ids = kwargs.get("position_ids")
            if position_ids is None:
                position_ids = torch.arange(length, device=query.device).expand(batch, length)
            cu_seqlens = _sequence_offsets(position_ids.expand(batch, length))
            max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())

        def flat(t: torch.Tensor) -> torch.Tensor:  # [B, H, L, D] -> [B*L, H, D]
            return t.transpose(1, 2).reshape(batch * length, t.shape[1], dim)

        out = packed_kernel(flat(query), flat(key), flat(value), cu_seqlens, max_seqlen, scale=scaling,
                            sliding_window=sliding_window, softcap=softcap)
        return out.reshape(batch, length, heads, dim), None

    return forward


def _masked_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, sliding_window, softcap,
                    **kwargs):
    """A padded batch (or a layer with dropout): sdpa on transformers' mask, or the scores materialized when the
    layer soft-caps (sdpa cannot)."""
    if softcap is None:
        with mask_safe_kernels(query.device):
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, is_causal=is_causal, **kwargs)
    if dropout:
        raise NotImplementedError("attention dropout with soft-capping")
    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    if attention_mask is None:
        attention_mask = causal_window_mask(query.shape[2], key.shape[2], sliding_window, query.device)
    elif attention_mask.dtype != torch.bool:
        attention_mask = attention_mask == 0  # an additive float mask: 0 where attending
    out = masked_attention(query, key, value, attention_mask, scaling, softcap)
    return out.transpose(1, 2).contiguous(), None


def _sdpa_varlen_mask(*args, attention_mask=None, **kwargs):
    """No mask for packed rows (the boundaries travel as cu_seqlens); sdpa's mask for padded batches."""
    return None if attention_mask is None else sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def register_own_kernels() -> None:
    """Makes the ``attn_implementation`` names of sdpa_varlen and torch_varlen known to transformers (idempotent;
    nothing CUDA is touched)."""
    for backend in BACKENDS.values():
        if backend.own_kernel:
            AttentionInterface.register(backend.implementation, _own_kernel_forward(backend.name))
            AttentionMaskInterface.register(backend.implementation, _sdpa_varlen_mask)


register_own_kernels()
