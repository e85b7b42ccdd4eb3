"""One sequence's attention: causal, with a layer's sliding window and soft-capping.

The per-sequence kernel every backend of this package runs (``sdpa_varlen``, the local
attention of Ulysses on CPU, the blocks of a prefix-shared row), in its own module so
that ``attention.py`` (the backends) and ``prefix_attention.py`` (prefix-shared rows,
which ``attention.py`` dispatches to) both build on it.
"""

from __future__ import annotations

import contextlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

# Torch's SDPA picks cuDNN's kernel first on Hopper, whose backward returned NaN query gradients for calls with an
# explicit mask (pytorch/pytorch#196678, huggingface/trl#7181: a mask tensor, and a query row whose log-sum-exp
# is below -88.7); the other fused kernels are clean there.  Masked calls on CUDA leave it out.
_WITHOUT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def mask_safe_kernels(device: torch.device):
    """The SDPA kernels a call with a mask tensor may take on ``device`` (all but cuDNN's on CUDA)."""
    return sdpa_kernel(_WITHOUT_CUDNN) if device.type == "cuda" else contextlib.nullcontext()


def causal_window_mask(q_len: int, k_len: int, sliding_window: int | None, device=None) -> torch.Tensor:
    """``[q_len, k_len]`` boolean mask (True: attend) of causal attention with an optional sliding window.

    Keys end where the queries end (bottom-right aligned: query i sits at key position
    ``k_len - q_len + i``), so a block of later queries against a longer key prefix
    (prefix sharing) gets the same rule.  The window is transformers' (``masking_utils.
    sliding_window_overlay``: key j is seen by a query at position p iff ``p - j <
    sliding_window``, i.e. the last ``sliding_window`` positions, the query's own
    included), which is flash-attn's ``window_size=(sliding_window - 1, ...)``.
    """
    query_positions = torch.arange(k_len - q_len, k_len, device=device)[:, None]
    key_positions = torch.arange(k_len, device=device)[None, :]
    mask = key_positions <= query_positions
    if sliding_window:
        mask &= query_positions - key_positions < sliding_window
    return mask


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     scale: float | None = None, softcap: float | None = None) -> torch.Tensor:
    """Attention ``[..., Lq, D]`` with a boolean ``mask`` (True: attend) and optional tanh soft-capping of the scores.

    With ``softcap`` the scores are materialized (``softcap * tanh(scores / softcap)``,
    softmax in fp32, as transformers' eager Gemma attention does): torch's sdpa has no
    score modifier.  Without it this is torch's sdpa.
    """
    if softcap is None:
        with mask_safe_kernels(q.device):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = torch.matmul(q, k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:  # the dtype's minimum, as eager: a padding query that sees nothing stays finite
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v)


def attend_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                    sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """One sequence's causal attention, ``[B, H, Lq, D]`` queries against ``[B, H, Lk, D]`` keys ending with them.

    The one per-sequence kernel of every backend here (sdpa_varlen, the local attention
    of Ulysses on CPU): it honours the layer's sliding window and attention soft-capping
    (:func:`causal_window_mask`, :func:`masked_attention`).  A plain causal sequence (no
    window that binds, no cap) takes torch's fused causal sdpa with no mask tensor: ``is_causal`` for as many
    queries as keys, torch's lower-right causal bias for fewer (a prefix-shared row's rejected block).
    """
    q_len, k_len = q.shape[-2], k.shape[-2]
    window = sliding_window if sliding_window and sliding_window < k_len else None  # a longer window sees all
    if window is None and softcap is None:
        if q_len == k_len:
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q_len, k_len),
                                                                scale=scale)
    return masked_attention(q, k, v, causal_window_mask(q_len, k_len, window, q.device), scale, softcap)
