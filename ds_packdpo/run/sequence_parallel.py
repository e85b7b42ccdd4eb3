"""Sequence parallelism: one packed row split along its tokens over the S ranks of a group.

A pair longer than one rank's memory still trains when S ranks share its row:

* **Groups.**  Consecutive ranks form a sequence-parallel (SP) group; groups are
  data-parallel replicas.  DeepSpeed's own Ulysses parallel state
  (``deepspeed.runtime.sequence_parallel.parallel_state_sp``, the ``mpu`` ALST
  uses) builds them and is handed to ``deepspeed.initialize``, so ZeRO shards over
  all ranks and sums gradients over all ranks (``ParallelLayout.gradient_divisor``
  gives the count it then divides by, which the loss is scaled by).
* **Slicing** (:func:`slice_row`).  The collated row is padded to a multiple of S
  with tokens that form their own ignored segment, and rank r keeps tokens
  ``[r*T/S, (r+1)*T/S)``.  ``labels`` were computed on the whole row (label t is
  token t+1), so the last token of a slice keeps the first token of the next slice
  as its label: slicing them with the tokens is all the boundary needs.
* **Attention** (:func:`register_ulysses_attention`).  DeepSpeed-Ulysses
  (``DistributedAttention``): an all-to-all turns [T/S tokens, all heads] into
  [T tokens, H/S heads], a local varlen attention runs over the whole row's
  ``cu_seqlens`` (a prefix-shared row: the shared-prefix kernel over its ``PrefixLayout``),
  and an all-to-all turns it back.  It is registered through
  transformers' ``AttentionInterface`` so the HF model calls it.
* **Log-probs** (:func:`all_reduce_sequence_logps`).  Each rank sums its slice's
  token log-probs per sequence; one all-reduce(sum) of the 2P-float vectors over
  the group gives every rank the whole sequences' log-probs before the nonlinear
  loss -- not an all-gather of per-token log-probs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import deepspeed.runtime.sequence_parallel.parallel_state_sp as mpu
import torch
import torch.distributed as dist
from deepspeed.sequence.layer import DistributedAttention
from transformers import AttentionInterface, modeling_flash_attention_utils

from ..errors import InputError
from ..model.attention import BACKENDS, PACKED_KERNELS, ULYSSES_ATTN, refuse_unsupported_kwargs
from ..model.collate import IGNORE_INDEX, ModelBatch, PrefixLayout
from ..model.logps import AUTO_CHUNK, SequenceLogps, TokenWeighting, forward_logps
from ..model.prefix_attention import flash_shared_prefix, shared_prefix_attention
from .layout import ParallelLayout

# (q, k, v, cu_seqlens, max_seqlen, *, scale, sliding_window, softcap) -> out; q [T, Hq, D], k/v [T, Hkv, D] with Hq % Hkv == 0, out [T, Hq, D].
LocalVarlenAttention = Callable[..., torch.Tensor]


# ----------------------------------------------------------------------------- settings (no process group)


def kv_replication(num_kv_heads: int, sp_size: int) -> int:
    """How many times each KV head is repeated so the KV heads split evenly over the group.

    The smallest factor f with ``num_kv_heads * f`` divisible by S (e.g. 2 KV heads
    and S=4: f=2).  Query heads h..h+H/S of one rank then still meet the KV head they
    belong to, since repeating heads in place keeps the GQA grouping.
    """
    return sp_size // math.gcd(num_kv_heads, sp_size)


def check_model_heads(hf_config, sp_size: int, where: str) -> None:
    """The head count must split over the group; checked on the config, before any weights or process group."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    if heads % sp_size != 0:
        raise InputError(f"--sequence-parallel-size {sp_size}: {where} has {heads} attention heads, not divisible by "
                         f"{sp_size} (Ulysses gives every rank of the group heads/{sp_size} whole heads); use a size "
                         f"that divides {heads}")
    if heads % (kv_heads * kv_replication(kv_heads, sp_size)) != 0:
        raise InputError(f"--sequence-parallel-size {sp_size}: {where} has {kv_heads} key/value heads for {heads} "
                         f"query heads; they cannot be split evenly over {sp_size} ranks")


def check_attention(attn: str, sp_size: int) -> None:
    """Under SP the local attention is a varlen kernel (flash-attn's or torch's, CUDA) or the exact per-sequence
    sdpa (``AttentionBackend.ulysses_local``); nothing else."""
    if sp_size > 1 and BACKENDS[attn].ulysses_local is None:
        able = [name for name, backend in BACKENDS.items() if backend.ulysses_local]
        raise InputError(f"--attn {attn} with --sequence-parallel-size {sp_size}: the local attention of Ulysses "
                         f"is a varlen kernel or per-sequence sdpa; use --attn {', '.join(able[:-1])} or {able[-1]}")


# ----------------------------------------------------------------------------- slicing a row


def slice_row(batch: ModelBatch, sp_size: int, sp_rank: int, pad_token_id: int) -> ModelBatch:
    """This rank's token slice of a packed row; ``cu_seqlens``/``max_seqlen`` stay those of the whole (padded) row.

    The row is padded to a multiple of S with tokens forming one extra segment
    (positions 0.., label -100, sequence -1), so no real sequence attends to them
    and nothing sums them.  A row without ``cu_seqlens`` (one sequence alone) is
    one segment.  A prefix-shared row keeps its whole (padded) ``PrefixLayout`` and slices
    its ``fork_labels`` like its labels.  Counts (``real_tokens``, ``computed_tokens``) are
    the whole row's.
    """
    if batch.attention_mask is not None or batch.input_ids.shape[0] != 1:
        raise ValueError("sequence parallelism slices packed rows ([1, T], no attention mask)")
    length = batch.input_ids.shape[1]
    padded = -(-length // sp_size) * sp_size
    pad = padded - length
    device = batch.input_ids.device
    cu_seqlens = batch.cu_seqlens
    if cu_seqlens is None:
        cu_seqlens = torch.tensor([0, length], dtype=torch.int32, device=device)

    def extend(values: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
        return torch.cat([values, tail.to(values).expand(values.shape[0], -1)], dim=1) if pad else values

    filler = torch.full((pad,), 0, dtype=torch.long, device=device)
    pieces = {
        "input_ids": extend(batch.input_ids, filler + pad_token_id),
        "position_ids": extend(batch.position_ids, torch.arange(pad, device=device)),
        "labels": extend(batch.labels, filler + IGNORE_INDEX),
        "seq_index": extend(batch.seq_index, filler - 1),
    }
    if batch.fork_labels is not None:
        pieces["fork_labels"] = extend(batch.fork_labels, filler + IGNORE_INDEX)
    if pad:
        cu_seqlens = torch.cat([cu_seqlens, cu_seqlens.new_tensor([padded])])
    local = padded // sp_size
    span = slice(sp_rank * local, (sp_rank + 1) * local)
    return dataclasses.replace(
        batch, **{name: value[:, span] for name, value in pieces.items()},
        cu_seqlens=cu_seqlens.to(torch.int32), max_seqlen=max(batch.max_seqlen, pad),
        computed_tokens=max(batch.computed_tokens, padded),
        prefix_layout=batch.prefix_layout.padded(pad) if batch.prefix_layout is not None else None)


# ----------------------------------------------------------------------------- local attention over the whole row


def flash_varlen(attn: str) -> LocalVarlenAttention:
    """The varlen kernel of flash-attn 2 or 3 (CUDA), resolved by transformers, imported only here.

    A layer's sliding window becomes flash's ``window_size=(w - 1, w - 1)`` (with ``causal`` only the
    left bound acts: the last w positions, the query's own included, transformers' meaning) and its
    attention soft-cap flash's ``softcap`` (flash-attn >= 2.6; flash-attn 3).
    """
    varlen_fn = modeling_flash_attention_utils.lazy_import_flash_attention(attn)[0][1]

    def attend(q, k, v, cu_seqlens, max_seqlen, *, scale=None, sliding_window=None, softcap=None):
        cu = cu_seqlens.to(dtype=torch.int32)
        features = {}
        if sliding_window and sliding_window < int(max_seqlen):
            features["window_size"] = (sliding_window - 1, sliding_window - 1)
        if softcap is not None:
            features["softcap"] = softcap
        out = varlen_fn(q, k, v, cu, cu, int(max_seqlen), int(max_seqlen), softmax_scale=scale, causal=True,
                        **features)
        return out[0] if isinstance(out, tuple) else out  # some flash-attn 3 builds also return the LSE

    return attend


def local_attention_for(attn: str) -> LocalVarlenAttention:
    """The local kernel of packed rows (``AttentionBackend.ulysses_local``): flash-attn's, torch's varlen kernel, or
    the per-sequence sdpa (also for ``sdpa``)."""
    local = BACKENDS[attn].ulysses_local
    return PACKED_KERNELS[local][0] if local in PACKED_KERNELS else flash_varlen(local)


def local_shared_attention_for(attn: str):
    """The local kernel of prefix-shared rows (``shared_prefix_attention``'s signature)."""
    local = BACKENDS[attn].ulysses_local
    return PACKED_KERNELS[local][1] if local in PACKED_KERNELS else flash_shared_prefix(local)


# ----------------------------------------------------------------------------- Ulysses through transformers


@dataclasses.dataclass
class _Ulysses:
    """What the registered attention function needs: the group and the local kernel (one per process)."""

    attention: object  # deepspeed.sequence.layer.DistributedAttention
    sp_size: int


_ULYSSES: _Ulysses | None = None


def _ulysses_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, *,
                       cu_seq_lens_q=None, max_length_q=None, sliding_window=None, softcap=None,
                       prefix_layout: PrefixLayout | None = None, **kwargs):
    """transformers attention function: q/k/v [1, heads, T/S, dim] of this rank's slice -> [1, T/S, heads, dim].

    The whole row's boundaries arrive as the varlen kwargs ``cu_seq_lens_q`` /
    ``max_length_q`` (see :func:`ds_packdpo.attention.model_forward_kwargs`), or for a
    prefix-shared row as its ``prefix_layout``; the mask transformers would build for the
    local slice is meaningless and ignored.  The layer's sliding window and soft-cap go
    to the local kernel, which applies them per sequence.
    """
    del attention_mask
    refuse_unsupported_kwargs(ULYSSES_ATTN, kwargs)
    if _ULYSSES is None:
        raise RuntimeError(f"attention {ULYSSES_ATTN!r} used before register_ulysses_attention()")
    if prefix_layout is None and cu_seq_lens_q is None:
        raise RuntimeError(f"attention {ULYSSES_ATTN!r} needs the whole row's cu_seqlens (cu_seq_lens_q)")
    if dropout:
        raise NotImplementedError("attention dropout under sequence parallelism")
    factor = kv_replication(key.shape[1], _ULYSSES.sp_size)
    if factor > 1:
        key, value = key.repeat_interleave(factor, dim=1), value.repeat_interleave(factor, dim=1)
    # DistributedAttention's layout: [seq, batch, heads, dim], batch in dim 1 (scatter heads, gather sequence).
    q, k, v = (x.permute(2, 0, 1, 3) for x in (query, key, value))
    out = _ULYSSES.attention(q, k, v, 1, None, cu_seq_lens_q, max_length_q, scale=scaling,
                             sliding_window=sliding_window, softcap=softcap, prefix_layout=prefix_layout)
    return out.permute(1, 0, 2, 3), None


def _local_on_row(local: LocalVarlenAttention, shared):
    """Adapts a (q, k, v, cu_seqlens, max_seqlen) kernel on [T, heads, dim], and the ``shared`` kernel of
    prefix-shared rows, to DistributedAttention's [T, 1, h, d]."""

    def attend(q, k, v, cu_seqlens, max_seqlen, prefix_layout=None, **features):  # scale, sliding_window, softcap
        if prefix_layout is not None:
            return shared(q[:, 0], k[:, 0], v[:, 0], prefix_layout, **features)[:, None]
        return local(q[:, 0], k[:, 0], v[:, 0], cu_seqlens, max_seqlen, **features)[:, None]

    return attend


def register_ulysses_attention(group, sp_size: int, local: LocalVarlenAttention, shared=shared_prefix_attention) -> str:
    """Registers the Ulysses attention with transformers for this process; returns its ``attn_implementation`` name."""
    global _ULYSSES
    _ULYSSES = _Ulysses(DistributedAttention(_local_on_row(local, shared), group, scatter_idx=2, gather_idx=0),
                        sp_size)
    AttentionInterface.register(ULYSSES_ATTN, _ulysses_attention)
    return ULYSSES_ATTN


# ----------------------------------------------------------------------------- log-probs over the group


class _SumOverGroup(torch.autograd.Function):
    """all-reduce(sum) forward; identity backward.

    Every rank of the group then computes the same loss from the same sums, and
    the gradient reaching rank r's partial sums is d(loss)/d(sums) itself: the
    ranks' partial gradients add up (in DeepSpeed's reduction) to exactly the
    gradient of the one group loss.  torch's ``all_reduce`` autograd would sum the
    S identical upstream gradients in backward, i.e. count the loss S times.
    """

    @staticmethod
    def forward(ctx, values, group):
        values = values.clone()
        dist.all_reduce(values, group=group)
        return values

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def all_reduce_sequence_logps(partial: SequenceLogps, group) -> SequenceLogps:
    """Whole-sequence sums from each rank's partial sums: one collective of 3 x 2P floats (and the LD-weighted and
    WPO sums, the policy's entropy and argmax-hit sums, when there are: up to 7 x 2P)."""
    present = [f.name for f in dataclasses.fields(partial) if getattr(partial, f.name) is not None]
    total = _SumOverGroup.apply(torch.stack([getattr(partial, name) for name in present]), group)
    differentiable = ("logps", "plain_logps")
    return SequenceLogps(**{name: total[i] if name in differentiable else total[i].detach()
                            for i, name in enumerate(present)})


@dataclasses.dataclass
class SequenceParallel:
    """This rank's place in the data-parallel x sequence-parallel layout."""

    size: int
    rank: int  # within the SP group
    group: object  # the SP process group
    pad_token_id: int

    def forward_logps(self, model, batch: ModelBatch, attn: str, chunk_tokens: int | str = AUTO_CHUNK,
                      impl: str = "lean", weighting: TokenWeighting | None = None) -> SequenceLogps:
        """Per-sequence log-probs of the whole row, on every rank of the group, from this rank's slice."""
        local = slice_row(batch, self.size, self.rank, self.pad_token_id)
        return all_reduce_sequence_logps(forward_logps(model, local, attn, chunk_tokens, impl, weighting), self.group)


def init_sequence_parallel(layout: ParallelLayout, attn: str, pad_token_id: int) -> tuple[SequenceParallel, object]:
    """After the process group: builds the groups (once per process) and registers Ulysses around ``attn``.

    Returns (SequenceParallel, mpu).  DeepSpeed's parallel state is global and built
    once; a later call (the next bench configuration) reuses its groups and only
    registers the local attention of its own backend.
    """
    if mpu._SEQUENCE_PARALLEL_GROUP is None:  # the module has no public "is initialized" query
        mpu.initialize_sequence_parallel(sequence_parallel_size=layout.sp_size)
    if mpu.get_sequence_parallel_world_size() != layout.sp_size:
        raise RuntimeError(f"sequence-parallel groups of {mpu.get_sequence_parallel_world_size()} ranks exist already; "
                           f"this run needs {layout.sp_size}")
    if mpu.get_sequence_parallel_rank() != layout.sp_rank:
        raise RuntimeError(f"DeepSpeed puts this rank at {mpu.get_sequence_parallel_rank()} of its sequence-parallel "
                           f"group; the layout says {layout.sp_rank}")
    group = mpu.get_sequence_parallel_group()
    register_ulysses_attention(group, layout.sp_size, local_attention_for(attn), local_shared_attention_for(attn))
    return SequenceParallel(layout.sp_size, layout.sp_rank, group, pad_token_id), mpu
