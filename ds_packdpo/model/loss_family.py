"""TRL 1.16 ``DPOTrainer`` loss family, under TRL's names, on per-sequence log-probs.

Every loss maps per-pair fp64 log-prob sums to per-pair losses [P]; a combination
``--loss a,b --loss-weights wa,wb`` is ``sum_k w_k * loss_k`` per pair, so the mean over
the step's pairs (:func:`losses.global_normalized_loss`) equals TRL's
``sum_k w_k * mean(loss_k)``.  Notation: ``c = logp(y_w) - ref(y_w)``,
``r = logp(y_l) - ref(y_l)`` (log-ratios), ``s(.)`` the f-divergence score
(identity for reverse_kl), ``d = s(c) - s(r)``, ``b`` = beta, ``e`` = label smoothing,
``n_w, n_l`` completion token counts, ``sig`` the logistic function.

Batch-coupled losses (``aot``, ``aot_unpaired`` sort over the batch; ``sft`` is a
token mean over the batch) are per-pair terms of :mod:`.coupled_losses`, matched against the
whole step's statistic (``partners``) or, without one, against the pairs given here as TRL does;
TRL 1.16 keeps no BCO running mean (``bco_pair`` is a plain per-pair loss).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import InputError
from .coupled_losses import COUPLED_LOSSES, PairPartners, batch_partners, coupled_loss
from .logps import SequenceLogps

TRL_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
                  "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")
F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
# Losses that read the f-divergence score d; the others use the plain log-ratios, so TRL
# silently ignores a non-default f-divergence there - refused instead.
_SCORE_LOSSES = ("sigmoid", "hinge", "ipo", "exo_pair", "robust", "discopop", "sigmoid_norm")


@dataclass(frozen=True)
class FamilyConfig:
    loss_types: tuple[str, ...] = ("sigmoid",)
    loss_weights: tuple[float, ...] | None = None
    beta: float = 0.1
    label_smoothing: float = 0.0
    f_divergence_type: str = "reverse_kl"
    f_alpha_divergence_coef: float = 1.0
    discopop_tau: float = 0.05

    @property
    def weights(self) -> tuple[float, ...]:
        return self.loss_weights if self.loss_weights is not None else (1.0,) * len(self.loss_types)

    def validate(self) -> None:
        for name in self.loss_types:
            if name not in TRL_LOSS_TYPES:
                raise InputError(f"--loss: unknown loss {name!r} (choices: {', '.join(TRL_LOSS_TYPES)})")
        if self.loss_weights is not None and len(self.loss_weights) != len(self.loss_types):
            raise InputError(f"--loss-weights: {len(self.loss_weights)} weights for {len(self.loss_types)} losses "
                             f"({','.join(self.loss_types)}); give one weight per loss")
        if self.loss_weights is not None and not all(math.isfinite(w) for w in self.loss_weights):
            raise InputError(f"--loss-weights must be finite, got {self.loss_weights}")
        if not (math.isfinite(self.beta) and self.beta > 0):
            raise InputError(f"--beta must be a finite number > 0, got {self.beta}")
        if self.f_divergence_type not in F_DIVERGENCES:
            raise InputError(f"--f-divergence-type: unknown {self.f_divergence_type!r} "
                             f"(choices: {', '.join(F_DIVERGENCES)})")
        if self.f_divergence_type != "reverse_kl":
            ignored = [name for name in self.loss_types if name not in _SCORE_LOSSES]
            if ignored:
                raise InputError(f"--f-divergence-type {self.f_divergence_type} has no effect on --loss "
                                 f"{','.join(ignored)} (only {', '.join(_SCORE_LOSSES)} use it)")
        if "exo_pair" in self.loss_types and not 0.0 < self.label_smoothing < 1.0:
            raise InputError(f"--label-smoothing must be in (0, 1) for --loss exo_pair (log(eps) in its KL), "
                             f"got {self.label_smoothing}")
        if not (math.isfinite(self.discopop_tau) and self.discopop_tau > 0):
            raise InputError(f"--discopop-tau must be a finite number > 0, got {self.discopop_tau}")


def f_divergence_score(logratios: torch.Tensor, cfg: FamilyConfig) -> torch.Tensor:
    """f'(exp(logratio)): reverse_kl log t, forward_kl 1 - 1/t, js log(2t/(t+1)), alpha (t^(a-1) - 1)/(a-1)."""
    kind, alpha = cfg.f_divergence_type, cfg.f_alpha_divergence_coef
    if kind == "reverse_kl" or (kind == "alpha_divergence" and abs(alpha - 1.0) < 1e-6):
        return logratios
    if kind == "forward_kl":
        return 1 - torch.exp(-logratios)
    if kind == "js_divergence":
        return math.log(2) + F.logsigmoid(logratios)
    return (torch.exp(torch.clamp((alpha - 1.0) * logratios, max=80.0)) - 1.0) / (alpha - 1.0)


def one_loss(name: str, policy: SequenceLogps, reference: SequenceLogps, cfg: FamilyConfig,
             partners: PairPartners | None = None) -> torch.Tensor:
    """Per-pair loss [P] of one TRL loss type (equations in the branch comments); a batch-coupled one is matched
    against ``partners`` (the whole step's statistic), else against the pairs given."""
    b, eps = cfg.beta, cfg.label_smoothing
    if name in COUPLED_LOSSES:  # aot: smoothed sig of b (sort(pc - pr) - sort(rc - rr)); aot_unpaired: of
        # b (sort(c) - sort(r)); sft: -sum(chosen token log-probs) / sum(n_w), as a per-pair share
        return coupled_loss(name, policy, reference, partners or batch_partners(policy, reference), b, eps)
    pc, pr, rc, rr = policy.chosen_logps, policy.rejected_logps, reference.chosen_logps, reference.rejected_logps
    nw, nl = policy.chosen_tokens.clamp_min(1), policy.rejected_tokens.clamp_min(1)
    c, r = pc - rc, pr - rr
    sc, sr = f_divergence_score(c, cfg), f_divergence_score(r, cfg)
    d = sc - sr
    if name == "sigmoid":  # -log sig(b d)
        return -F.logsigmoid(b * d)
    if name == "hinge":  # relu(1 - b d)
        return torch.relu(1 - b * d)
    if name == "ipo":  # (s(c)/n_w - s(r)/n_l - 1/(2b))^2
        return (sc / nw - sr / nl - 1 / (2 * b)) ** 2
    if name == "exo_pair":  # sig(b d)(log sig(b d) - log(1-e)) + sig(-b d)(log sig(-b d) - log e)
        z = b * d
        return (torch.sigmoid(z) * (F.logsigmoid(z) - math.log1p(-eps))
                + torch.sigmoid(-z) * (F.logsigmoid(-z) - math.log(eps)))
    if name == "nca_pair":  # -log sig(b c) - 1/2 log sig(-b c) - 1/2 log sig(-b r)
        return -F.logsigmoid(b * c) - 0.5 * F.logsigmoid(-b * c) - 0.5 * F.logsigmoid(-b * r)
    if name == "robust":  # (-(1-e) log sig(b d) + e log sig(-b d)) / (1 - 2e)
        return (-(1 - eps) * F.logsigmoid(b * d) + eps * F.logsigmoid(-b * d)) / (1 - 2 * eps)
    if name == "bco_pair":  # -log sig(b c) - log sig(-b r)
        return -F.logsigmoid(b * c) - F.logsigmoid(-b * r)
    if name == "sppo_hard":  # (c - 1/(2b))^2 + (r + 1/(2b))^2
        return (c - 0.5 / b) ** 2 + (r + 0.5 / b) ** 2
    if name == "apo_zero":  # 1 - sig(b c) + sig(b r)
        return 1 - torch.sigmoid(b * c) + torch.sigmoid(b * r)
    if name == "apo_down":  # sig(b c) + 1 - sig(b (c - r))
        return torch.sigmoid(b * c) + 1 - torch.sigmoid(b * (c - r))
    if name == "discopop":  # m = sig(b d / tau): (1-m)(-log sig(b d)) + m exp(-b d)
        z = b * d
        m = torch.sigmoid(z / cfg.discopop_tau)
        return -F.logsigmoid(z) * (1 - m) + torch.exp(-z) * m
    if name == "sigmoid_norm":  # -log sig(b (s(c)/n_w - s(r)/n_l))
        return -F.logsigmoid(b * (sc / nw - sr / nl))
    raise ValueError(f"unknown loss {name!r}")


def family_pair_losses(policy: SequenceLogps, reference: SequenceLogps, cfg: FamilyConfig,
                       partners: PairPartners | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``sum_k w_k loss_k`` per pair [P], and TRL's per-pair metrics (rewards = b * log-ratio, sums)."""
    losses = sum(w * one_loss(name, policy, reference, cfg, partners) for name, w in zip(cfg.loss_types, cfg.weights))
    chosen_rewards = cfg.beta * (policy.chosen_logps - reference.chosen_logps).detach()
    rejected_rewards = cfg.beta * (policy.rejected_logps - reference.rejected_logps).detach()
    metrics = {
        "rewards/chosen": chosen_rewards,
        "rewards/rejected": rejected_rewards,
        "rewards/accuracies": (chosen_rewards > rejected_rewards).to(chosen_rewards.dtype),
        "rewards/margins": chosen_rewards - rejected_rewards,
        "logps/chosen": policy.chosen_logps.detach(),
        "logps/rejected": policy.rejected_logps.detach(),
    }
    return losses, metrics
