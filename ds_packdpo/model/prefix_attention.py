"""Attention of prefix-shared rows: each prompt computed once for all of its responses (a pair's two, or a
prompt group's k: every later response below is handled like the rejected one).

A pair of a prefix-shared row is one block ``[prompt | chosen | rejected]``
(:class:`~ds_packdpo.model.collate.PrefixLayout`).  Its attention is two causal pieces:

* prompt + chosen: ordinary causal attention over the P + C tokens;
* rejected: R queries against the prompt's keys and the rejected block's own, causal and
  aligned bottom-right (rejected token j, at position P + j, sees keys 0 .. P + j of
  ``[prompt | rejected]``) -- never the chosen tokens.

Kernels, every one exact:

* CPU (:func:`shared_prefix_attention`): per block one causal sdpa for prompt + chosen and,
  for the rejected queries, torch's fused CPU flash kernel run twice -- against the prompt's
  keys with no mask, and against the rejected keys causally -- merged through their
  log-sum-exps (:class:`_PrefixedCausal`).  That costs R x P + R^2 / 2 and builds no mask,
  where one sdpa call with a lower-right mask computes the whole R x (P + R) rectangle and
  stores the mask for backward (measured here, 1 thread, forward + backward: P = R = 1000,
  192 ms against 282 ms).  torch has no public sdpa that returns the log-sum-exp, hence the
  private ``aten`` ops and the hand-written backward (flash's backward evaluated with the
  merged output and log-sum-exp gives each key set's exact gradient share).
  Like :func:`~ds_packdpo.model.attention.varlen_attention` it keeps 4-D inputs with
  repeated KV heads and ``split`` views (the fast CPU paths).  A sliding window that binds, or
  soft-capping, takes the per-sequence kernel of every backend
  (:func:`~ds_packdpo.model.sequence_attention.attend_sequence`) over the prompt's and the
  rejected block's keys: exact, slower.
* CUDA with flash-attn (:func:`flash_shared_prefix`): one varlen call, queries in row order,
  the prompt's keys and values gathered in front of every rejected block, separate
  ``cu_seqlens_q`` / ``cu_seqlens_k``; flash-attn >= 2.1 aligns the causal mask bottom-right
  when a segment has fewer queries than keys, which is exactly the rejected block's mask.
  Windows and soft-capping go to flash as ``window_size`` / ``softcap``.

A window of W follows transformers' ``sliding_window_overlay``: key j is visible to query i
iff ``i - j < W`` (positions; ``sequence_attention.causal_window_mask``).

Under sequence parallelism the same kernels run locally after the Ulysses all-to-all
(``run/sequence_parallel.py``).  At one rank, ``sdpa_varlen`` dispatches shared rows here,
and with flash-attn the model runs ``PREFIX_FLASH[attn]``, registered below.
"""

from __future__ import annotations

import functools
import math

import torch
from transformers import AttentionInterface
from transformers.integrations.flash_attention import get_target_dtype
from transformers.modeling_flash_attention_utils import (_flash_attention_forward, flash_attn_supports_top_left_mask,
                                                         lazy_import_flash_attention)

from ..errors import InputError
from .collate import PrefixLayout
from .sequence_attention import attend_sequence

# attn_implementation of a model that runs flash-attn with prefix sharing (no "flash" in the name: transformers
# would treat the name as its own flash backend).
PREFIX_FLASH = {"flash_attention_2": "ds_packdpo_prefix_fa2", "flash_attention_3": "ds_packdpo_prefix_fa3"}

_cpu_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_cpu_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class _PrefixedCausal(torch.autograd.Function):
    """Attention of ``q`` [1, H, Lq, D] over ``[prefix keys (all visible) | own keys (causal, Lq of them)]``.

    Two fused CPU flash calls, one per key set, merged with their log-sum-exps:
    ``out = sum_s exp(lse_s - lse) out_s``, ``lse = logaddexp(lse_prefix, lse_own)``.  Backward runs flash's
    backward once per key set with the merged output and log-sum-exp, which is each set's exact share (its
    softmax probabilities are ``exp(scores - lse)`` either way); the query gradient is their sum.
    """

    @staticmethod
    def forward(ctx, q, k_prefix, v_prefix, k_own, v_own, scale):
        out_prefix, lse_prefix = _cpu_flash(q, k_prefix, v_prefix, 0.0, False, scale=scale)
        out_own, lse_own = _cpu_flash(q, k_own, v_own, 0.0, True, scale=scale)
        lse = torch.logaddexp(lse_prefix, lse_own)
        out = (out_prefix.float() * (lse_prefix - lse).exp()[..., None]
               + out_own.float() * (lse_own - lse).exp()[..., None]).to(q.dtype)
        ctx.save_for_backward(q, k_prefix, v_prefix, k_own, v_own, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k_prefix, v_prefix, k_own, v_own, out, lse = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        dq_prefix, dk_prefix, dv_prefix = _cpu_flash_backward(grad_out, q, k_prefix, v_prefix, out, lse, 0.0, False,
                                                              scale=ctx.scale)
        dq_own, dk_own, dv_own = _cpu_flash_backward(grad_out, q, k_own, v_own, out, lse, 0.0, True, scale=ctx.scale)
        return dq_prefix + dq_own, dk_prefix, dv_prefix, dk_own, dv_own, None


def _block_attention(q, k_prefix, v_prefix, k_own, v_own, scale: float, window: int | None,
                     softcap: float | None) -> torch.Tensor:
    """``q`` [1, H, Lq, D] over the prefix keys (positions 0..Lp-1, none when ``k_prefix`` is None) and its own Lq
    keys (causal), aligned bottom-right; returns [1, H, Lq, D].  A window that binds or a soft-cap goes to the
    per-sequence kernel over the concatenated keys (exact, slower)."""
    prefix = 0 if k_prefix is None else k_prefix.shape[2]
    binds = window is not None and window < prefix + q.shape[2]
    if prefix and q.device.type == "cpu" and not (binds or softcap):
        return _PrefixedCausal.apply(q, k_prefix, v_prefix, k_own, v_own, scale)
    if prefix:
        k_own, v_own = torch.cat([k_prefix, k_own], dim=2), torch.cat([v_prefix, v_own], dim=2)
    return attend_sequence(q, k_own, v_own, scale, window, softcap)


def shared_prefix_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: PrefixLayout,
                            scale: float | None = None, sliding_window: int | None = None,
                            softcap: float | None = None) -> torch.Tensor:
    """Attention of a prefix-shared row: ``[T, Hq, D]`` queries, ``[T, Hk, D]`` keys/values -> ``[T, Hq, D]``.

    Any device and dtype, differentiable; one Python iteration per pair block.
    """
    if layout.tokens != query.shape[0]:
        raise ValueError(f"the prefix layout covers {layout.tokens} tokens, the row has {query.shape[0]}")
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # repeated KV heads, not enable_gqa: the fused CPU kernel skips GQA inputs (attention.py)
        key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    sizes = [n for block in layout.blocks for n in (block[0] + block[1], *block[2:])]
    q, k, v = (t.transpose(0, 1)[None].split(sizes, dim=2) for t in (query, key, value))  # [1, H, L, D] views
    outputs, first = [], 0
    for block in layout.blocks:  # prompt + r1 causal; every later response over the prompt's keys and its own
        prompt = block[0]
        outputs.append(_block_attention(q[first], None, None, k[first], v[first], scale, sliding_window, softcap))
        for piece, size in enumerate(block[2:], start=first + 1):
            if size:
                outputs.append(_block_attention(q[piece], k[first][:, :, :prompt], v[first][:, :, :prompt], k[piece],
                                                v[piece], scale, sliding_window, softcap))
        first += len(block) - 1
    return torch.cat(outputs, dim=2)[0].transpose(0, 1)


# ----------------------------------------------------------------------------- flash-attn (CUDA)


@functools.lru_cache(maxsize=16)
def flash_segments(layout: PrefixLayout, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """(cu_seqlens_q, cu_seqlens_k, key index, max_seqlen_q, max_seqlen_k) of one varlen call over a shared row.

    Query segments are the row's own pieces, prompt + first response then each later response, block by block;
    the key segment of a later response is the prompt's keys followed by its own (the key index gathers them).  Computed once per row
    and device, not per layer.
    """
    query_lengths, key_lengths, index = [], [], []
    start = 0
    for prompt, head, *rest in layout.blocks:
        query_lengths.append(prompt + head)
        key_lengths.append(prompt + head)
        index.append(torch.arange(start, start + prompt + head))
        offset = start + prompt + head
        for size in rest:
            if size:
                query_lengths.append(size)
                key_lengths.append(prompt + size)
                index += [torch.arange(start, start + prompt), torch.arange(offset, offset + size)]
            offset += size
        start = offset

    def offsets(lengths: list[int]) -> torch.Tensor:
        return torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)

    return (offsets(query_lengths), offsets(key_lengths), torch.cat(index).to(device), max(query_lengths),
            max(key_lengths))


def flash_shared_prefix(attn: str):
    """The shared-row kernel of flash-attn 2 or 3 in :func:`shared_prefix_attention`'s signature (CUDA)."""
    if flash_attn_supports_top_left_mask():
        raise InputError(f"--attn {attn}: this flash-attn aligns causal masks top-left (before 2.1), which cannot "
                         f"express prefix sharing; upgrade flash-attn or pass --no-prefix-sharing")
    varlen = lazy_import_flash_attention(attn)[0][1]

    def attend(query, key, value, layout: PrefixLayout, scale=None, sliding_window=None, softcap=None):
        cu_q, cu_k, index, max_q, max_k = flash_segments(layout, query.device)
        options = {}
        if sliding_window:
            options["window_size"] = (sliding_window - 1, 0)
        if softcap:
            options["softcap"] = softcap
        out = varlen(query, key.index_select(0, index), value.index_select(0, index), cu_q, cu_k, max_q, max_k,
                     softmax_scale=scale, causal=True, **options)
        return out[0] if isinstance(out, tuple) else out  # some flash-attn 3 builds also return the LSE

    return attend


# ----------------------------------------------------------------------------- transformers' attention functions


def prefix_attention_forward(kernel, query, key, value, prefix_layout: PrefixLayout, dropout: float = 0.0,
                             scaling=None, sliding_window=None, softcap=None):
    """A shared row through ``kernel`` in transformers' attention-function terms: q/k/v ``[1, H, L, D]`` ->
    ``([1, L, H, D], None)``."""
    if dropout:
        raise NotImplementedError("attention dropout with prefix sharing (pass --no-prefix-sharing)")
    if query.shape[0] != 1:
        raise ValueError("a prefix-shared row is one packed row ([1, T])")
    out = kernel(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), prefix_layout,
                 scale=scaling, sliding_window=sliding_window, softcap=softcap)
    return out[None], None


def _flash_prefix_forward(attn: str):
    """The attention function of ``PREFIX_FLASH[attn]``: shared rows through :func:`flash_shared_prefix`, any other
    input (a sequence alone, an unshared packed row) through transformers' own flash path of ``attn``."""

    def forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                softcap=None, prefix_layout: PrefixLayout | None = None, **kwargs):
        if prefix_layout is not None:  # flash_shared_prefix looks flash-attn up in transformers' cache: cheap
            return prefix_attention_forward(flash_shared_prefix(attn), query, key, value, prefix_layout, dropout,
                                            scaling, sliding_window, softcap)
        out = _flash_attention_forward(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                       attention_mask, query_length=query.shape[2], is_causal=True, dropout=dropout,
                                       softmax_scale=scaling, sliding_window=sliding_window, softcap=softcap,
                                       target_dtype=get_target_dtype(query, module), attn_implementation=attn,
                                       **kwargs)
        return out, None

    return forward


def register_prefix_flash() -> None:
    """Makes the ``PREFIX_FLASH`` names known to transformers (idempotent; nothing of flash-attn is imported)."""
    for attn, name in PREFIX_FLASH.items():
        AttentionInterface.register(name, _flash_prefix_forward(attn))


register_prefix_flash()
