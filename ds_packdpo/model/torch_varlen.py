"""``torch_varlen``: PyTorch's own FlashAttention varlen kernel (``torch.nn.attention.varlen.varlen_attn``, CUDA).

torch ships the FlashAttention-2 varlen kernel behind ``varlen_attn`` (torch >= 2.11 has the
``window_size`` argument this module needs), so a CUDA run gets flash-speed packed attention
without the flash-attn package, a long source build many clusters cannot do.  Its semantics,
as read in torch 2.11 and 2.13 (``torch/nn/attention/varlen.py``):

* ``query`` ``[Tq, Hq, D]``, ``key``/``value`` ``[Tk, Hk, D]``, int32 ``cu_seq_q`` / ``cu_seq_k``
  offsets and python-int ``max_q`` / ``max_k``, half precision only;
* causality is a window: ``window_size=(-1, 0)`` is causal (torch tests the tuple for equality,
  so it must be a tuple), ``(W - 1, 0)`` causal with the last W keys (query i sees key j iff
  ``i - j < W``, transformers' ``sliding_window``); FlashAttention-2 aligns both bottom-right
  when a segment has fewer queries than keys, which is the rejected block of a prefix-shared row;
* grouped KV heads: ``enable_gqa=True`` from torch 2.13; torch 2.11 has no such argument and
  checks nothing, and its kernel takes the grouped heads as they are (measured on an H200: the
  same output as with repeated heads, ``scripts/gpu_check.py``'s probe), so they are never repeated;
* no soft-capping of scores (Gemma 2 is refused in phase one) and no dropout.

Packed rows run one call with the row's ``cu_seqlens`` (no boundary rediscovery, no loop);
prefix-shared rows one call with separate query/key boundaries and the prompt's keys gathered
in front of each rejected block (``prefix_attention.flash_segments``, shared with flash-attn).
The tests run this module through an emulation of those semantics on CPU
(``tests/varlen_emulation.py``); ``scripts/gpu_acceptance.sh`` checks the real kernel.
"""

from __future__ import annotations

import functools
import inspect

import torch

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # torch before 2.10: no such kernel
    varlen_attn = None

from .collate import PrefixLayout
from .prefix_attention import flash_segments

TORCH_VARLEN = "torch_varlen"
# The attn_implementation it is registered under (no "sdpa" or "flash" in it: transformers would apply its own
# checks of those backends to the name).
TORCH_VARLEN_IMPLEMENTATION = "ds_packdpo_torch_varlen"
CAUSAL = (-1, 0)


@functools.cache
def varlen_kernel():
    """``(varlen_attn, takes_enable_gqa)`` of the installed torch, or None when it has no usable one (before 2.11:
    no ``window_size``, through which causality is asked for)."""
    if varlen_attn is None:
        return None
    parameters = inspect.signature(varlen_attn).parameters
    if "window_size" not in parameters:
        return None
    return varlen_attn, "enable_gqa" in parameters


def torch_varlen_available() -> bool:
    """True when the installed torch has a usable ``varlen_attn`` and sees a CUDA device."""
    return varlen_kernel() is not None and torch.cuda.is_available()


def window_size(sliding_window: int | None) -> tuple[int, int]:
    """``varlen_attn``'s causal ``window_size`` for a layer's sliding window (None: the whole causal past)."""
    return CAUSAL if not sliding_window else (int(sliding_window) - 1, 0)


def segment_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_q: torch.Tensor,
                      cu_seq_k: torch.Tensor, max_q: int, max_k: int, scale: float | None = None,
                      sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Causal attention of every query segment over its key segment, bottom-right aligned: ``[Tq, Hq, D]``."""
    if softcap is not None:
        raise NotImplementedError(f"attention {TORCH_VARLEN!r}: torch's varlen kernel has no soft-capping "
                                  f"(phase one refuses such models)")
    kernel = varlen_kernel()
    if kernel is None:
        raise RuntimeError(f"attention {TORCH_VARLEN!r}: torch {torch.__version__} has no varlen_attn with "
                           f"window_size (torch >= 2.11)")
    varlen_attn, takes_enable_gqa = kernel
    options = {"scale": scale, "window_size": window_size(sliding_window)}
    if takes_enable_gqa and query.shape[1] != key.shape[1]:
        options["enable_gqa"] = True
    return varlen_attn(query, key, value, cu_seq_q.to(torch.int32), cu_seq_k.to(torch.int32), int(max_q),
                       int(max_k), **options)


def packed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                     max_seqlen: int, *, scale: float | None = None, sliding_window: int | None = None,
                     softcap: float | None = None) -> torch.Tensor:
    """A packed row ``[T, H, D]``: each ``cu_seqlens`` segment causal with itself (the local kernel's signature,
    ``sequence_parallel.LocalVarlenAttention``)."""
    return segment_attention(query, key, value, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, scale,
                             sliding_window, softcap)


def shared_prefix_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: PrefixLayout,
                            scale: float | None = None, sliding_window: int | None = None,
                            softcap: float | None = None) -> torch.Tensor:
    """A prefix-shared row (``prefix_attention.shared_prefix_attention``'s signature) in one varlen call."""
    if layout.tokens != query.shape[0]:
        raise ValueError(f"the prefix layout covers {layout.tokens} tokens, the row has {query.shape[0]}")
    cu_q, cu_k, index, max_q, max_k = flash_segments(layout, query.device)
    return segment_attention(query, key.index_select(0, index), value.index_select(0, index), cu_q, cu_k, max_q,
                             max_k, scale, sliding_window, softcap)
