"""Attention backends for packed rows, and the keyword arguments of the model forward.

A packed row holds many sequences back to back; each must attend only to itself.
Two ways get there in transformers 5.x:

* ``sdpa`` / ``eager`` / ``flex_attention``: transformers builds a block-diagonal
  causal mask from ``position_ids`` (which restart at 0 for every sequence) - but
  only when ``attention_mask is None`` and there is no KV cache.  A forward without
  ``use_cache=False`` silently attends across sequences (measured here: max logit
  difference ~1.0 instead of ~3e-7), so every forward built here passes
  ``use_cache=False`` and, for a packed row, no attention mask.
* ``sdpa_varlen`` (this module, registered with transformers' ``AttentionInterface``):
  torch's causal sdpa run once per sequence of the row, so attention costs
  sum(L_i^2) instead of the T^2 of a dense block-diagonal mask (on small models,
  where attention dominates, the dense mask would eat the whole gain of packing).
  It is exact by construction and needs nothing but torch, so ``auto`` picks it
  on CPU.  Padded batches (an attention mask is given) run plain sdpa.
* ``flash_attention_2`` / ``flash_attention_3``: the varlen kernels take the
  sequence boundaries directly.  We pass ``cu_seqlens`` and ``max_seqlen`` from the
  collated batch as flash-attention kwargs, so transformers does not rediscover the
  boundaries from ``position_ids`` (which costs a device->host sync every layer call).

flash-attn is an optional extra that cannot even be installed without CUDA; only
its presence is probed (through transformers, which does not import it).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.utils import is_flash_attn_2_available, is_flash_attn_3_available

from ..errors import InputError
from .collate import ModelBatch
from .prefix_attention import PREFIX_FLASH, prefix_attention_forward, shared_prefix_attention

FLASH_BACKENDS = ("flash_attention_2", "flash_attention_3")
SDPA_VARLEN = "sdpa_varlen"
# The attention_implementation name of DeepSpeed-Ulysses (ds_packdpo.sequence_parallel registers it).
ULYSSES_ATTN = "ds_packdpo_ulysses"
# Backends that take the boundaries as cu_seqlens kwargs.
VARLEN_BACKENDS = (*FLASH_BACKENDS, SDPA_VARLEN, ULYSSES_ATTN, *PREFIX_FLASH.values())
ATTN_CHOICES = ("auto", SDPA_VARLEN, "sdpa", "eager", "flex_attention", *FLASH_BACKENDS)


def flash_attention_available(name: str) -> bool:
    """True when the flash-attn package for ``name`` is installed and CUDA works (nothing is imported)."""
    probe = {"flash_attention_2": is_flash_attn_2_available, "flash_attention_3": is_flash_attn_3_available}[name]
    return bool(probe())


def is_flash(attn: str) -> bool:
    return attn in FLASH_BACKENDS


def resolve_attn(name: str, device_type: str, needs_backward: bool = True) -> str:
    """The backend a run will use, or InputError; called before any process group starts.

    ``auto`` is flash varlen on CUDA when flash-attn is importable, else sdpa_varlen:
    exact, and on CPU 2.5x (4.5k-token row, 8 sequences) to 5.3x (10.7k tokens, 16
    sequences) faster than sdpa's dense block-diagonal mask for forward+backward of the
    bench model on dpo_en_demo rows (measured here, 1 thread, min of 3).
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
        return SDPA_VARLEN
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
    elif batch.prefix_layout is not None:  # a prefix-shared row: the pair blocks, for model/prefix_attention.py
        kwargs["prefix_layout"] = batch.prefix_layout
    elif attn in VARLEN_BACKENDS and batch.cu_seqlens is not None:
        kwargs.update(flash_varlen_kwargs(batch.cu_seqlens, batch.max_seqlen))
    return kwargs


def varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens,
                     scale: float | None = None) -> torch.Tensor:
    """Causal attention of every sequence of a packed row with itself only: ``[T, Hq, D]`` -> ``[T, Hq, D]``.

    ``query`` is ``[T, Hq, D]``, ``key``/``value`` ``[T, Hk, D]`` with ``Hq`` a multiple of
    ``Hk`` (grouped-query attention), the flash-attention varlen layout; ``cu_seqlens``
    the sequence offsets ``[0, L0, L0+L1, ..., T]`` (tensor or ints).  One sdpa call per
    sequence: exact, O(sum L^2) compute and memory, any device and dtype, differentiable.
    torch has no varlen sdpa kernel outside CUDA (nested-tensor sdpa needs CUDA for
    causal masks), hence the loop; its cost is one small kernel launch per sequence.
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
    outputs = [torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
               for q, k, v in zip(*pieces)]
    return torch.cat(outputs, dim=2)[0].transpose(0, 1)


def _sequence_offsets(position_ids: torch.Tensor) -> torch.Tensor:
    """Offsets of the sequences of a flattened ``[B, L]`` batch: a new one wherever the position does not count on."""
    flat = position_ids.reshape(-1)
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = flat[1:] != flat[:-1] + 1
    starts.view(position_ids.shape)[:, 0] = True  # a row never continues the previous one
    boundaries = starts.nonzero().squeeze(1)
    return torch.cat([boundaries, boundaries.new_tensor([flat.numel()])])


def _sdpa_varlen_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                         is_causal=None, **kwargs):
    """transformers' attention-function signature: q/k/v ``[B, H, L, D]``, returns ``([B, L, H, D], None)``.

    With an attention mask (padded batches) this is plain sdpa.  Without, the row's
    sequence boundaries come from the ``cu_seq_lens_q`` kwarg (``model_forward_kwargs``
    passes it) or, failing that, from where ``position_ids`` restart.  A prefix-shared row (the
    ``prefix_layout`` kwarg) runs :func:`~ds_packdpo.model.prefix_attention.shared_prefix_attention`.
    """
    if kwargs.get("prefix_layout") is not None:
        return prefix_attention_forward(shared_prefix_attention, query, key, value, kwargs["prefix_layout"], dropout,
                                        scaling, kwargs.get("sliding_window"), kwargs.get("softcap"))
    if attention_mask is not None or dropout or query.shape[2] != key.shape[2]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    batch, heads, length, dim = query.shape
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if cu_seqlens is None or batch != 1:
        position_ids = kwargs.get("position_ids")
        if position_ids is None:
            position_ids = torch.arange(length, device=query.device).expand(batch, length)
        cu_seqlens = _sequence_offsets(position_ids.expand(batch, length))

    def flat(t: torch.Tensor) -> torch.Tensor:  # [B, H, L, D] -> [B*L, H, D]
        return t.transpose(1, 2).reshape(batch * length, t.shape[1], dim)

    out = varlen_attention(flat(query), flat(key), flat(value), cu_seqlens, scale=scaling)
    return out.reshape(batch, length, heads, dim), None


def _sdpa_varlen_mask(*args, attention_mask=None, **kwargs):
    """No mask for packed rows (the boundaries travel as cu_seqlens); sdpa's mask for padded batches."""
    return None if attention_mask is None else sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def register_sdpa_varlen() -> None:
    """Makes ``attn_implementation="sdpa_varlen"`` known to transformers (idempotent)."""
    AttentionInterface.register(SDPA_VARLEN, _sdpa_varlen_forward)
    AttentionMaskInterface.register(SDPA_VARLEN, _sdpa_varlen_mask)


register_sdpa_varlen()
