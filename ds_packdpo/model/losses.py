"""The one loss chain: every loss of the run (rows of :mod:`.loss_registry`) evaluated the same way on per-sequence
log-probs, weighted and summed per pair; TRL's metrics; the globally normalized loss.

Losses are returned per pair and reduced by :func:`global_normalized_loss`: under token-budget packing ranks hold
different numbers of pairs, so a per-rank mean averaged by DeepSpeed would weight pairs unequally.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .coupled_losses import PairPartners, batch_partners
from .loss_registry import LossConfig, LossInputs, f_divergence_score
from .token_weights import wpo_pair_weights

if TYPE_CHECKING:
    from .logps import SequenceLogps

ENTROPY, TOKEN_ACCURACY = "entropy", "mean_token_accuracy"  # TRL's names; means over completion tokens


def pair_losses(policy: SequenceLogps, reference: SequenceLogps | None, cfg: LossConfig,
                partners: PairPartners | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``sum_k w_k loss_k`` per pair [P] (differentiable) and per-pair metrics [P] (detached, TRL names).

    ``partners``: the whole step's statistic for this row's pairs (batch-coupled losses, run/step_statistics.py);
    without it a batch-coupled loss couples the pairs given, as TRL does.

    ``rewards/*`` are ``beta`` times the log-ratios (of the policy's log-probs alone for a reference-free loss),
    ``logps/*`` the policy's sums; both per-token averages of each sequence when every loss of the run reports
    normalized metrics (IPO, SimPO: what their losses see; TRL's CPOTrainer for SimPO).  With --rpo-alpha the RPO
    NLL term (of the unweighted log-probs) is added and reported as ``nll_loss``; with --use-weighting the pair's
    loss is then multiplied by its WPO weight (TRL's order while it had both).
    """
    if reference is None and cfg.needs_reference:
        raise ValueError(f"loss {cfg.loss_type!r} needs reference log-probs")
    if partners is None and cfg.batch_coupled:
        partners = batch_partners(policy, reference)
    chosen, rejected = policy.chosen_logps, policy.rejected_logps
    if cfg.needs_reference:
        c, r = chosen - reference.chosen_logps, rejected - reference.rejected_logps
    else:  # a reference-free loss: the policy's log-probs stand for the log-ratios
        c, r = chosen, rejected
        reference = None
    score_c, score_r = f_divergence_score(c, cfg), f_divergence_score(r, cfg)
    n_chosen, n_rejected = policy.chosen_tokens.clamp_min(1), policy.rejected_tokens.clamp_min(1)
    per_sequence, per_token = score_c - score_r, score_c / n_chosen - score_r / n_rejected
    losses = sum(weight * spec.loss(LossInputs(policy, reference, c, r,
                                               per_token if spec.length_normalized else per_sequence,
                                               cfg.label_smoothing_of(spec), cfg, partners))
                 for spec, weight in zip(cfg.specs, cfg.weights))

    if cfg.normalized_metrics:
        chosen, rejected, c, r = chosen / n_chosen, rejected / n_rejected, c / n_chosen, r / n_rejected
    chosen_rewards, rejected_rewards = cfg.beta * c.detach(), cfg.beta * r.detach()
    metrics = {
        "rewards/chosen": chosen_rewards,
        "rewards/rejected": rejected_rewards,
        "rewards/accuracies": (chosen_rewards > rejected_rewards).to(chosen_rewards.dtype),
        "rewards/margins": chosen_rewards - rejected_rewards,
        "logps/chosen": chosen.detach(),
        "logps/rejected": rejected.detach(),
        "logits/chosen": policy.chosen_logits_sum / policy.chosen_tokens,
        "logits/rejected": policy.rejected_logits_sum / policy.rejected_tokens,
    }
    if cfg.rpo_alpha > 0:
        nll = -policy.unweighted_logps[0::2] / policy.chosen_tokens  # NLL per chosen token, per pair
        losses = losses + cfg.rpo_alpha * nll
        metrics["nll_loss"] = nll.detach()
    if cfg.use_weighting:
        losses = losses * wpo_pair_weights(policy)
    return losses, metrics


def metric_sums(per_pair_metrics: dict[str, torch.Tensor], policy: SequenceLogps) -> dict[str, torch.Tensor]:
    """Sums to all-reduce across ranks; :func:`metric_means` turns the global sums into TRL's means.

    Per-pair metrics are summed (mean = sum / ``pairs``); ``logits/*`` are summed over
    completion tokens with their token counts in ``tokens/*`` (mean over tokens, as TRL), and so are TRL's
    ``entropy`` (over every completion token) and ``mean_token_accuracy`` (over the chosen ones) when the
    policy's forward gave them (not the fused kernel: it holds no logits).
    """
    sums = {name: values.sum() for name, values in per_pair_metrics.items() if not name.startswith("logits/")}
    sums["logits/chosen"] = policy.chosen_logits_sum.sum()
    sums["logits/rejected"] = policy.rejected_logits_sum.sum()
    if policy.entropy_sum is not None:
        sums[ENTROPY] = policy.entropy_sum.sum()
        sums[TOKEN_ACCURACY] = policy.top1_sum[0::2].sum()
    sums["tokens/chosen"] = policy.chosen_tokens.sum()
    sums["tokens/rejected"] = policy.rejected_tokens.sum()
    sums["pairs"] = torch.tensor(float(policy.chosen_logps.numel()), device=policy.logps.device)
    return sums


def metric_means(global_sums: dict[str, torch.Tensor | float]) -> dict[str, float]:
    """TRL-style means from (all-reduced) :func:`metric_sums` (a step with no pairs reports 0)."""
    totals = {name: float(value) for name, value in global_sums.items()}
    pairs = max(totals["pairs"], 1.0)
    means = {}
    for name, total in totals.items():
        if name.startswith("logits/"):
            means[name] = total / max(totals["tokens/" + name.split("/", 1)[1]], 1.0)
        elif name == ENTROPY:
            means[name] = total / max(totals["tokens/chosen"] + totals["tokens/rejected"], 1.0)
        elif name == TOKEN_ACCURACY:
            means[name] = total / max(totals["tokens/chosen"], 1.0)
        elif name != "pairs" and not name.startswith("tokens/"):
            means[name] = total / pairs
    return means


def global_normalized_loss(per_pair_losses: torch.Tensor, global_pairs: int, gradient_divisor: int) -> torch.Tensor:
    """``sum / global_pairs * gradient_divisor``.

    DeepSpeed divides the rank-summed gradients by ``gradient_divisor`` (the run's
    ``ParallelLayout.gradient_divisor``); scaling by it makes that average equal the
    gradient of the mean loss over all pairs of the step, however the pairs are split
    over ranks and rows.
    """
    if global_pairs < 1:
        raise ValueError(f"global_pairs must be >= 1, got {global_pairs}")
    return per_pair_losses.sum() * (gradient_divisor / global_pairs)
