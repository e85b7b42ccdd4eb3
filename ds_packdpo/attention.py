"""Attention backends for packed rows, and the keyword arguments of the model forward.

A packed row holds many sequences back to back; each must attend only to itself.
Two ways get there in transformers 5.x:

* ``sdpa`` / ``eager`` / ``flex_attention``: transformers builds a block-diagonal
  causal mask from ``position_ids`` (which restart at 0 for every sequence) - but
  only when ``attention_mask is None`` and there is no KV cache.  A forward without
  ``use_cache=False`` silently attends across sequences (measured here: max logit
  difference ~1.0 instead of ~3e-7), so every forward built here passes
  ``use_cache=False`` and, for a packed row, no attention mask.
* ``flash_attention_2`` / ``flash_attention_3``: the varlen kernels take the
  sequence boundaries directly.  We pass ``cu_seqlens`` and ``max_seqlen`` from the
  collated batch as flash-attention kwargs, so transformers does not rediscover the
  boundaries from ``position_ids`` (which costs a device->host sync every layer call).

flash-attn is an optional extra that cannot even be installed without CUDA; only
its presence is probed (through transformers, which does not import it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .errors import InputError

if TYPE_CHECKING:
    from .collate import ModelBatch

FLASH_BACKENDS = ("flash_attention_2", "flash_attention_3")
# The attention_implementation name of DeepSpeed-Ulysses (ds_packdpo.sequence_parallel registers it).
ULYSSES_ATTN = "ds_packdpo_ulysses"
ATTN_CHOICES = ("auto", "sdpa", "eager", "flex_attention", *FLASH_BACKENDS)


def flash_attention_available(name: str) -> bool:
    """True when the flash-attn package for ``name`` is installed and CUDA works (nothing is imported)."""
    from transformers.utils import is_flash_attn_2_available, is_flash_attn_3_available

    probe = {"flash_attention_2": is_flash_attn_2_available, "flash_attention_3": is_flash_attn_3_available}[name]
    return bool(probe())


def is_flash(attn: str) -> bool:
    return attn in FLASH_BACKENDS


def resolve_attn(name: str, device_type: str, needs_backward: bool = True) -> str:
    """The backend a run will use, or InputError; called before any process group starts.

    ``auto`` is flash varlen on CUDA when flash-attn is importable, else sdpa.
    ``needs_backward=False`` (the ``check`` command, a frozen reference) allows
    flex_attention on CPU, which torch 2.13 runs forward only.
    """
    if name not in ATTN_CHOICES:
        raise InputError(f"--attn: unknown backend {name!r} (choices: {', '.join(ATTN_CHOICES)})")
    if name == "auto":
        if device_type == "cuda":
            for flash in FLASH_BACKENDS:
                if flash_attention_available(flash):
                    return flash
        return "sdpa"
    if is_flash(name):
        if device_type != "cuda":
            raise InputError(f"--attn {name}: needs a CUDA device, this run is on {device_type} "
                             f"(use --attn sdpa, eager or flex_attention)")
        if not flash_attention_available(name):
            package = "flash-attn" if name == "flash_attention_2" else "flash-attn-3 (flash_attn_interface)"
            raise InputError(f"--attn {name}: the {package} package is not installed or too old "
                             f"(pip install flash-attn --no-build-isolation), or use --attn sdpa")
    if name == "flex_attention" and device_type == "cpu" and needs_backward:
        raise InputError("--attn flex_attention: torch has no FlexAttention backward on CPU "
                         "(training needs one); use --attn sdpa or eager on CPU")
    return name


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
    elif (is_flash(attn) or attn == ULYSSES_ATTN) and batch.cu_seqlens is not None:
        kwargs.update(flash_varlen_kwargs(batch.cu_seqlens, batch.max_seqlen))
    return kwargs
