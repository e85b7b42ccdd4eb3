"""The DPO loss family on per-sequence log-probs, and the globally normalized loss.

Formulas and metric names follow TRL's ``DPOTrainer`` (``CPOTrainer`` for SimPO) so
results compare one to one.  Two deliberate differences:

* IPO and SimPO use the average log-prob per completion token of EACH sequence.
  TRL's padding-free path divided by the whole packed row's token count instead.
* Losses are returned per pair and reduced by :func:`global_normalized_loss`:
  under token-budget packing ranks hold different numbers of pairs, so a per-rank
  mean averaged by DeepSpeed would weight pairs unequally.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import InputError
from .coupled_losses import PairPartners
from .logps import SequenceLogps
from .loss_family import FamilyConfig, family_pair_losses
from .token_weights import TokenWeighting, check_token_weighting, wpo_pair_weights

LOSS_TYPES = ("sigmoid", "robust", "hinge", "ipo", "simpo")
LENGTH_NORMALIZED = ("ipo", "simpo")
REFERENCE_FREE = ("simpo",)
ENTROPY, TOKEN_ACCURACY = "entropy", "mean_token_accuracy"  # TRL's names; means over completion tokens
_SMOOTHABLE = ("sigmoid", "robust", "simpo")
_FAMILY_SMOOTHABLE = ("exo_pair", "robust", "aot", "aot_unpaired")


@dataclass(frozen=True)
class LossConfig:
    loss_type: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    rpo_alpha: float = 0.0
    loss_weights: tuple[float, ...] | None = None
    f_divergence_type: str = "reverse_kl"
    f_alpha_divergence_coef: float = 1.0
    discopop_tau: float = 0.05
    ld_alpha: float | None = None  # LD-DPO (model/token_weights.py): applied in the forwards, policy and reference
    use_weighting: bool = False  # WPO: each pair's loss times the policy's w(y_w) w(y_l)

    def token_weighting(self, policy: bool) -> TokenWeighting:
        """What the policy's (``policy``) or the reference's forward computes besides the plain sums."""
        return TokenWeighting(self.ld_alpha, self.use_weighting and policy, token_stats=policy)

    @property
    def family(self) -> FamilyConfig | None:
        """The TRL 1.16 family settings (model.loss_family) when the loss needs them, else None.

        A single loss of :data:`LOSS_TYPES` with TRL's defaults keeps this module's path (it also
        takes label smoothing for sigmoid, as older TRL did); --ld-alpha and --use-weighting, TRL 1.16
        settings, take TRL's."""
        names = tuple(self.loss_type.split(","))
        if (len(names) == 1 and names[0] in LOSS_TYPES and self.loss_weights is None
                and self.f_divergence_type == "reverse_kl" and self.ld_alpha is None and not self.use_weighting):
            return None
        return FamilyConfig(names, self.loss_weights, self.beta, self.label_smoothing, self.f_divergence_type,
                            self.f_alpha_divergence_coef, self.discopop_tau)

    def validate(self) -> None:
        check_token_weighting(self.ld_alpha, self.use_weighting, tuple(self.loss_type.split(",")))
        self._check_parameters_used()
        family = self.family
        if family is not None:
            if "simpo" in family.loss_types:
                raise InputError("--loss simpo is reference-free and cannot be combined with TRL's reference losses "
                                 "or --loss-weights/--f-divergence-type")
            family.validate()
            if self.label_smoothing and not set(family.loss_types) & set(_FAMILY_SMOOTHABLE):
                raise InputError(f"--label-smoothing {self.label_smoothing} has no effect with --loss "
                                 f"{self.loss_type} (only {', '.join(_FAMILY_SMOOTHABLE)} use it); set it to 0")
            if not (math.isfinite(self.rpo_alpha) and self.rpo_alpha >= 0):
                raise InputError(f"--rpo-alpha must be a finite number >= 0, got {self.rpo_alpha}")
            return
        if self.loss_type not in LOSS_TYPES:
            raise InputError(f"--loss: unknown loss {self.loss_type!r} (choices: {', '.join(LOSS_TYPES)})")
        if not (math.isfinite(self.beta) and self.beta > 0):
            raise InputError(f"--beta must be a finite number > 0, got {self.beta}")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise InputError(f"--label-smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if self.label_smoothing > 0 and self.loss_type not in _SMOOTHABLE:
            raise InputError(f"--label-smoothing {self.label_smoothing} has no effect with --loss {self.loss_type} "
                             f"(only {', '.join(_SMOOTHABLE)} use it); set it to 0")
        if not math.isfinite(self.simpo_gamma):
            raise InputError(f"--simpo-gamma must be finite, got {self.simpo_gamma}")
        if not (math.isfinite(self.rpo_alpha) and self.rpo_alpha >= 0):
            raise InputError(f"--rpo-alpha must be a finite number >= 0, got {self.rpo_alpha}")


    def _check_parameters_used(self) -> None:
        """A loss parameter set away from its default that no loss of the run reads is refused (as --label-smoothing
        is), on both paths: TRL would ignore it silently."""
        names = self.loss_type.split(",")
        loss = f"--loss {self.loss_type}"
        unused = [(flag, value, needs, this_run) for flag, value, default, needs, this_run, used in (
            ("--f-alpha-divergence-coef", self.f_alpha_divergence_coef, LossConfig.f_alpha_divergence_coef,
             "--f-divergence-type alpha_divergence", f"--f-divergence-type {self.f_divergence_type}",
             self.f_divergence_type == "alpha_divergence"),
            ("--discopop-tau", self.discopop_tau, LossConfig.discopop_tau, "--loss discopop", loss, "discopop" in names),
            ("--simpo-gamma", self.simpo_gamma, LossConfig.simpo_gamma, "--loss simpo", loss, "simpo" in names),
        ) if value != default and not used]
        if unused:
            flag, value, needs, this_run = unused[0]
            raise InputError(f"{flag} {value:g} has no effect with {this_run} (only {needs} uses it); drop it")


def _chosen_rejected(seqs: SequenceLogps, length_normalized: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if length_normalized:
        return seqs.chosen_logps / seqs.chosen_tokens, seqs.rejected_logps / seqs.rejected_tokens
    return seqs.chosen_logps, seqs.rejected_logps


def _smoothed_sigmoid(scaled: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    return -F.logsigmoid(scaled) * (1 - label_smoothing) - F.logsigmoid(-scaled) * label_smoothing


def pair_losses(policy: SequenceLogps, reference: SequenceLogps | None, cfg: LossConfig,
                partners: PairPartners | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-pair losses [P] (differentiable) and per-pair metrics [P] (detached, TRL names).

    ``partners``: the whole step's statistic for this row's pairs (batch-coupled losses, run/step_statistics.py);
    without it a batch-coupled loss couples the pairs given.

    ``logps/*`` and ``rewards/*`` use the log-probs the loss sees: per-token averages
    for IPO and SimPO, sums otherwise (as TRL reports them).
    """
    family = cfg.family
    if family is not None:
        if reference is None:
            raise ValueError(f"loss {cfg.loss_type!r} needs reference log-probs")
        losses, metrics = family_pair_losses(policy, reference, family, partners)
        return _with_logits_and_rpo(losses, metrics, policy, cfg)
    normalized = cfg.loss_type in LENGTH_NORMALIZED
    chosen, rejected = _chosen_rejected(policy, normalized)
    beta, ls = cfg.beta, cfg.label_smoothing
    if cfg.loss_type in REFERENCE_FREE:
        logits = (chosen - rejected) - cfg.simpo_gamma / beta
        losses = _smoothed_sigmoid(beta * logits, ls)
        chosen_rewards, rejected_rewards = beta * chosen.detach(), beta * rejected.detach()
    else:
        if reference is None:
            raise ValueError(f"loss {cfg.loss_type!r} needs reference log-probs")
        ref_chosen, ref_rejected = _chosen_rejected(reference, normalized)
        logits = (chosen - ref_chosen) - (rejected - ref_rejected)
        if cfg.loss_type == "sigmoid":
            losses = _smoothed_sigmoid(beta * logits, ls)
        elif cfg.loss_type == "robust":
            losses = (-F.logsigmoid(beta * logits) * (1 - ls) + F.logsigmoid(-beta * logits) * ls) / (1 - 2 * ls)
        elif cfg.loss_type == "hinge":
            losses = torch.relu(1 - beta * logits)
        else:  # ipo
            losses = (logits - 1 / (2 * beta)) ** 2
        chosen_rewards = beta * (chosen - ref_chosen).detach()
        rejected_rewards = beta * (rejected - ref_rejected).detach()

    metrics = {
        "rewards/chosen": chosen_rewards,
        "rewards/rejected": rejected_rewards,
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float(),
        "rewards/margins": chosen_rewards - rejected_rewards,
        "logps/chosen": chosen.detach(),
        "logps/rejected": rejected.detach(),
    }
    return _with_logits_and_rpo(losses, metrics, policy, cfg)


def _with_logits_and_rpo(losses: torch.Tensor, metrics: dict[str, torch.Tensor], policy: SequenceLogps,
                         cfg: LossConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Adds TRL's ``logits/*`` metrics and, with --rpo-alpha, the RPO NLL term (of the unweighted log-probs) and its
    ``nll_loss`` metric; with --use-weighting the pair's loss times its WPO weight (after the RPO term, as TRL
    ordered them while it had both)."""
    metrics["logits/chosen"] = policy.chosen_logits_sum / policy.chosen_tokens
    metrics["logits/rejected"] = policy.rejected_logits_sum / policy.rejected_tokens
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
