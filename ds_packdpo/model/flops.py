"""Analytic model FLOPs of a DPO step, and the throughput figures built on them (bench and trainer share this).

The count follows the usual dense-transformer convention (Kaplan et al.; PaLM's MFU):
a forward costs ``2 N`` FLOPs per token for the N matmul parameters (every weight
except the input embedding, a lookup), a backward twice that, and attention adds
``4 * layers * d_attn * L^2`` per forward of a sequence of length L (QK^T and AV,
with d_attn = heads x head_dim, counted without the causal halving).  So one step is

    policy (forward + backward):  6 N tokens + 12 layers d_attn S
    reference (forward only):     2 N tokens +  4 layers d_attn S

with ``tokens`` the computed tokens (padding included: the hardware runs it; a shared
prompt once) and ``S`` the attention term of the layout: the sum of squared sequence
lengths of a packed row (with prefix sharing (P + C)^2 + R (P + R) per pair:
``data.plan.pair_attention_sq``), ``rows x width^2`` of a padded micro-batch.  Frozen
weights (the base of a LoRA run, whose adapters count in N) need no weight gradient:
their backward is ``2 N_frozen`` per token, not ``4 N_frozen``.

Model FLOPs are the work of the loss computed in one pass (PaLM's convention): work a run repeats
to save memory is not in them, though its time is in every step time.  That is the second forward
of ``--gradient-checkpointing`` and the no-grad policy pre-pass of ``--loss aot``/``aot_unpaired``
(``run/step_statistics.py``: one more policy forward per row, ``2 N tokens + 4 layers d_attn S``,
which a step of one micro-batch would not need); :func:`prepass_flops` counts the latter so the
bench can say how much its MFU leaves out.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..data.plan import RowLayout, pair_attention_sq


@dataclass(frozen=True)
class FlopModel:
    """What the FLOP count needs to know about the model."""

    matmul_params: int  # N: every parameter but the input embedding
    layers: int
    attn_width: int  # d_attn = query heads x head dim
    with_reference: bool
    frozen_params: int = 0  # of N, those that get no gradient (a LoRA run's base weights)

    @classmethod
    def of(cls, model, with_reference: bool) -> "FlopModel":
        """From an HF causal LM (or a DeepSpeed engine around one); counts ZeRO-3-partitioned weights in full."""
        module = getattr(model, "module", model)
        embedding = module.get_input_embeddings().weight

        def numel(p) -> int:
            return int(getattr(p, "ds_numel", p.numel()))

        total = sum(numel(p) for p in module.parameters())
        frozen = sum(numel(p) for p in module.parameters() if not p.requires_grad and p is not embedding)
        config = module.config
        heads = int(config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        return cls(matmul_params=total - numel(embedding), layers=int(config.num_hidden_layers),
                   attn_width=heads * head_dim, with_reference=with_reference, frozen_params=frozen)


def step_flops(model: FlopModel, computed_tokens: float, attention_sq: float) -> float:
    """Model FLOPs of one optimizer step over all ranks (see the module docstring for the formula)."""
    linear = (6.0 * model.matmul_params - 2.0 * model.frozen_params) * computed_tokens
    attention = 12.0 * model.layers * model.attn_width * attention_sq
    if model.with_reference:
        linear += 2.0 * model.matmul_params * computed_tokens
        attention += 4.0 * model.layers * model.attn_width * attention_sq
    return linear + attention


def prepass_flops(model: FlopModel, computed_tokens: float, attention_sq: float) -> float:
    """FLOPs of the no-grad policy pre-pass of one step (a forward of every row): not in :func:`step_flops`."""
    return 2.0 * model.matmul_params * computed_tokens + 4.0 * model.layers * model.attn_width * attention_sq


def row_attention_sq(pairs, chosen_lengths, rejected_lengths, layout: RowLayout, prompt_lengths=None) -> int:
    """The attention term S of one planned row: sum(L^2) packed (the prefix-shared blocks' term when ``layout``
    shares prefixes), rows x width^2 padded (2 rows per pair)."""
    if not pairs:
        return 1  # the one-token dummy row
    index = np.asarray(pairs, dtype=np.int64)
    chosen, rejected = np.asarray(chosen_lengths)[index], np.asarray(rejected_lengths)[index]
    if layout.packed:
        sharing = layout.shares_prefixes
        prompt = np.asarray(prompt_lengths)[index] if sharing else None
        return int(pair_attention_sq(chosen, rejected, prompt, sharing).sum())
    return int(2 * index.size * int(max(chosen.max(), rejected.max())) ** 2)


def response_row_attention_sq(responses, row) -> int:
    """S of a row of spread responses (``StepPlan.responses``): each prompt copy P^2, each response R (P + R)."""
    if not row.responses:
        return 1  # the one-token dummy row
    members = np.asarray(row.responses, dtype=np.int64)
    prompt, length = responses.prompt[members], responses.length[members]
    _, first = np.unique(responses.unit[members], return_index=True)
    return int((prompt[first] ** 2).sum() + (length * (prompt + length)).sum())


def plan_attention_sq(plan, chosen_lengths, rejected_lengths, layout: RowLayout, prompt_lengths=None) -> int:
    """S of a whole step: every row of every rank."""
    if plan.row_layout(layout).spreads_responses:
        return sum(response_row_attention_sq(plan.responses, row) for rows in plan.ranks for row in rows)
    return sum(row_attention_sq(row.pairs, chosen_lengths, rejected_lengths, layout, prompt_lengths)
               for rows in plan.ranks for row in rows)


class ThroughputMeter:
    """Model TFLOP/s and MFU of one step, for the trainer's per-step log and the bench."""

    def __init__(self, model: FlopModel, chosen_lengths, rejected_lengths, layout: RowLayout, world_size: int,
                 peak_tflops: float | None, prompt_lengths=None, policy_prepass: bool = False):
        self.model = model
        self.policy_prepass = policy_prepass  # the step runs the policy once more, without gradients (aot)
        self.lengths = (chosen_lengths, rejected_lengths)
        self.layout = layout
        self.world_size = world_size
        self.peak_tflops = peak_tflops
        self.prompt_lengths = prompt_lengths

    def attention_sq(self, plan) -> int:
        return plan_attention_sq(plan, *self.lengths, self.layout, self.prompt_lengths)

    def step_flops(self, plan) -> float:
        computed = sum(plan.rank_computed_tokens)
        return step_flops(self.model, computed, self.attention_sq(plan))

    def prepass_flops(self, plan) -> float:
        """The step's uncounted pre-pass FLOPs (0 when the loss needs no pre-pass)."""
        if not self.policy_prepass:
            return 0.0
        return prepass_flops(self.model, sum(plan.rank_computed_tokens), self.attention_sq(plan))

    def figures(self, flops: float, seconds: float) -> dict:
        """``model_tflops_per_s`` (all ranks) and ``mfu`` (None without a peak per device)."""
        tflops = flops / seconds / 1e12 if seconds > 0 else float("nan")
        mfu = tflops / (self.peak_tflops * self.world_size) if self.peak_tflops else None
        return {"model_tflops_per_s": tflops, "mfu": mfu}
