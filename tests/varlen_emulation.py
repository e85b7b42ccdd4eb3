"""CPU emulations of the CUDA varlen kernels' documented semantics, so the code that calls them is tested here.

* :func:`emulated_flash_varlen`: flash-attn's ``flash_attn_varlen_func`` (>= 2.1).
* :func:`emulated_torch_varlen`: torch's ``torch.nn.attention.varlen.varlen_attn`` as read in torch 2.13
  (``enable_gqa``); :func:`emulated_torch_varlen_2_11` the torch 2.11 signature, which has no ``enable_gqa`` and
  takes grouped heads as they are (seen on an H200: scripts/gpu_check.py's probe).

Both are differentiable (einsum on the inputs), so gradients through the callers are checked too.  A real kernel
is checked on a GPU by scripts/gpu_acceptance.sh.
"""

from __future__ import annotations

import torch


def emulated_flash_varlen(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False,
                          window_size=(-1, -1), softcap=0.0):
    """flash_attn_varlen_func's documented semantics (>= 2.1): per segment, query i of Lq sees key j of Lk iff
    j <= i + Lk - Lq (causal, bottom-right) and i + Lk - Lq - j <= window_size[0]."""
    assert causal and max_q == int(torch.diff(cu_q).max()) and max_k == int(torch.diff(cu_k).max())
    assert cu_q.dtype == cu_k.dtype == torch.int32 and isinstance(max_q, int) and isinstance(max_k, int)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    out = []
    for qs, qe, ks, ke in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist()):
        lq, lk = qe - qs, ke - ks
        i, j = torch.arange(lq)[:, None] + lk - lq, torch.arange(lk)[None]
        visible = (j <= i) & ((i - j <= window_size[0]) if window_size[0] >= 0 else True)
        groups = q.shape[1] // k.shape[1]
        ks_, vs_ = (t[ks:ke].repeat_interleave(groups, 1) for t in (k, v))
        scores = torch.einsum("thd,shd->hts", q[qs:qe], ks_) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        out.append(torch.einsum("hts,shd->thd", scores.masked_fill(~visible, float("-inf")).softmax(-1), vs_))
    return torch.cat(out)


def emulated_torch_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                          window_size=(-1, -1), enable_gqa=False):
    """varlen_attn (torch 2.13): causal iff ``window_size == (-1, 0)`` (a tuple), ``(W, 0)`` causal with W keys back
    besides the query's own, bottom-right aligned; unequal head counts need ``enable_gqa``."""
    if not enable_gqa and query.shape[1] != key.shape[1]:
        raise ValueError(f"Expect query and key/value to have the same number of heads but got Hq={query.shape[1]} "
                         f"and Hkv={key.shape[1]}. Try setting enable_gqa=True for GQA.")
    assert return_aux is None
    # only causal attention is emulated (every caller asks for it): right bound 0, left bound -1 or a window
    assert isinstance(window_size, tuple) and window_size[1] == 0, window_size
    return emulated_flash_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, softmax_scale=scale,
                                 causal=True, window_size=window_size)


def emulated_torch_varlen_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                               window_size=(-1, -1)):
    """varlen_attn's torch 2.11 signature (no ``enable_gqa``; grouped heads taken as they are)."""
    return emulated_torch_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, return_aux=return_aux,
                                 scale=scale, window_size=window_size, enable_gqa=True)


def use_torch_varlen_emulation(monkeypatch, kernel=emulated_torch_varlen) -> None:
    """Makes ``torch_varlen`` run ``kernel`` (an emulation above) and count as available (CUDA and the kernel)."""
    from ds_packdpo.model import torch_varlen

    takes_enable_gqa = kernel is emulated_torch_varlen
    monkeypatch.setattr(torch_varlen, "varlen_kernel", lambda: (kernel, takes_enable_gqa))
    monkeypatch.setattr(torch_varlen.torch.cuda, "is_available", lambda: True)
