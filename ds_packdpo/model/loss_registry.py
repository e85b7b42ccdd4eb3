"""Every loss ``--loss`` can name: one row of :data:`LOSSES` each, its function (the equation beside it) and, as
fields, everything the rest of the trainer needs to know about it.  Nothing outside this module compares a loss's
name: it asks the row (does the run need a reference, does a step need the sorted pre-pass, may WPO weight it ...).

Adding a loss is one function and one row here (its line in docs/losses.md, and its check against TRL in
tests/test_loss_family.py); the chain (:func:`ds_packdpo.model.losses.pair_losses`), the validation
(:meth:`LossConfig.validate`), the reference, the step statistic and the report read its fields.

Formulas and names are TRL 1.16's ``DPOTrainer`` (``CPOTrainer`` for SimPO), on per-pair fp64 log-prob sums.
Notation: ``c = logp(y_w) - ref(y_w)``, ``r = logp(y_l) - ref(y_l)`` (log-ratios; a reference-free loss reads the
policy's log-probs, a reference of log-prob 0), ``s(.)`` the ``--f-divergence-type`` score (identity for
reverse_kl), ``d = s(c) - s(r)``, or ``d = s(c)/n_w - s(r)/n_l`` for a length-normalized loss (``n_w, n_l`` the
completion token counts, clamped at 1, of EACH sequence: TRL's padding-free path divided by the whole packed row's
token count instead), ``b`` = --beta, ``e`` = --label-smoothing as the loss reads it, ``sig`` the logistic function.
A combination ``--loss a,b --loss-weights wa,wb`` is ``sum_k w_k loss_k`` per pair, so the step's mean
(:func:`ds_packdpo.model.losses.global_normalized_loss`) is TRL's ``sum_k w_k mean(loss_k)``.

The batch-coupled losses (``aot``, ``aot_unpaired`` sort over the batch, ``sft`` is a token mean over it) are per-pair
terms matched against the whole step's statistic (``partners``, :mod:`.coupled_losses` says why their sums and
gradients are TRL's); TRL 1.16 keeps no BCO running mean (``bco_pair`` is a plain per-pair loss).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..errors import InputError
from .token_weights import TokenWeighting

if TYPE_CHECKING:
    from .coupled_losses import PairPartners
    from .logps import SequenceLogps

F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")


class Smoothing(Enum):
    """What a loss does with --label-smoothing ``e``."""

    NONE = "none"  # reads none: a non-zero --label-smoothing with only such losses is refused
    READS = "reads"
    NEEDS = "needs"  # reads it and needs e > 0 (exo_pair: log e in its KL)
    ALONE = "alone"  # reads it as the run's only loss: DPO's conservative form; TRL 1.16's sigmoid term reads none


class Coupling(Enum):
    """What a loss needs of the rest of the step (:mod:`ds_packdpo.run.step_statistics` gathers it)."""

    NONE = "none"  # a per-pair loss
    TOKEN_MEAN = "token_mean"  # the step's chosen completion token count (a token mean over the step)
    SORTED = "sorted"  # every pair's four sums before the gradient pass: the no-grad policy pre-pass


@dataclass(frozen=True)
class LossInputs:
    """What a loss function reads: the pairs' log-probs and their log-ratios, one value per pair [P] (fp64,
    differentiable in the policy's log-probs), and the settings as this loss reads them."""

    policy: SequenceLogps
    reference: SequenceLogps | None  # None for a reference-free loss
    c: torch.Tensor  # chosen log-ratio (a reference-free loss: the policy's chosen log-prob)
    r: torch.Tensor  # rejected log-ratio
    d: torch.Tensor  # s(c) - s(r); a length-normalized loss: s(c)/n_w - s(r)/n_l
    eps: float  # --label-smoothing as this loss reads it (0 where it reads none, LossConfig.label_smoothing_of)
    settings: LossConfig
    partners: PairPartners | None  # the step's matches of these pairs; set when a batch-coupled loss is trained

    @property
    def beta(self) -> float:
        return self.settings.beta


def smoothed_sigmoid(z: torch.Tensor, eps: float) -> torch.Tensor:
    """``-(1 - e) log sig(z) - e log sig(-z)`` (DPO's conservative, label-smoothed form; AOT's)."""
    return -F.logsigmoid(z) * (1 - eps) - F.logsigmoid(-z) * eps


def sigmoid(x: LossInputs) -> torch.Tensor:
    """``-(1-e) log sig(b d) - e log sig(-b d)``: DPO (cDPO with e); on per-token averages, sigmoid_norm."""
    return smoothed_sigmoid(x.beta * x.d, x.eps)


def robust(x: LossInputs) -> torch.Tensor:
    """``(-(1-e) log sig(b d) + e log sig(-b d)) / (1 - 2e)``: robust DPO, unbiased under label noise e."""
    return (-(1 - x.eps) * F.logsigmoid(x.beta * x.d) + x.eps * F.logsigmoid(-x.beta * x.d)) / (1 - 2 * x.eps)


def hinge(x: LossInputs) -> torch.Tensor:
    """``relu(1 - b d)``: SLiC's hinge."""
    return torch.relu(1 - x.beta * x.d)


def ipo(x: LossInputs) -> torch.Tensor:
    """``(s(c)/n_w - s(r)/n_l - 1/(2b))^2``: IPO (Eq. 17, beta as its tau), on per-token averages."""
    return (x.d - 1 / (2 * x.beta)) ** 2


def simpo(x: LossInputs) -> torch.Tensor:
    """``-(1-e) log sig(b (logp(y_w)/n_w - logp(y_l)/n_l) - gamma) - e log sig(-...)``: SimPO, reference-free."""
    return smoothed_sigmoid(x.beta * (x.d - x.settings.simpo_gamma / x.beta), x.eps)


def exo_pair(x: LossInputs) -> torch.Tensor:
    """``sig(b d)(log sig(b d) - log(1-e)) + sig(-b d)(log sig(-b d) - log e)``: EXO-pref (Eq. 16)."""
    z = x.beta * x.d
    return (torch.sigmoid(z) * (F.logsigmoid(z) - math.log1p(-x.eps))
            + torch.sigmoid(-z) * (F.logsigmoid(-z) - math.log(x.eps)))


def nca_pair(x: LossInputs) -> torch.Tensor:
    """``-log sig(b c) - 1/2 log sig(-b c) - 1/2 log sig(-b r)``: NCA."""
    b = x.beta
    return -F.logsigmoid(b * x.c) - 0.5 * F.logsigmoid(-b * x.c) - 0.5 * F.logsigmoid(-b * x.r)


def bco_pair(x: LossInputs) -> torch.Tensor:
    """``-log sig(b c) - log sig(-b r)``: BCO on pairs, without a running reward mean (TRL 1.16 keeps none)."""
    return -F.logsigmoid(x.beta * x.c) - F.logsigmoid(-x.beta * x.r)


def sppo_hard(x: LossInputs) -> torch.Tensor:
    """``(c - 1/(2b))^2 + (r + 1/(2b))^2``: SPPO with hard labels."""
    return (x.c - 0.5 / x.beta) ** 2 + (x.r + 0.5 / x.beta) ** 2


def aot(x: LossInputs) -> torch.Tensor:
    """``smoothed(b (sort(pc - pr) - sort(rc - rr)))`` over the step: pair i, whose policy margin ``pc - pr`` has
    rank k_i in the step, is matched with the k_i-th smallest reference margin (``partners.aot_reference``)."""
    policy = x.policy
    margin = policy.chosen_logps - policy.rejected_logps
    return smoothed_sigmoid(x.beta * (margin - _sorted_partners(x).aot_reference), x.eps)


def aot_unpaired(x: LossInputs) -> torch.Tensor:
    """``smoothed(b (sort(c) - sort(r)))`` over the step, as ``A + B - (A + B).detach() / 2`` with
    ``A = smoothed(b (c - sort(r)[rank of c]))`` and ``B = smoothed(b (sort(c)[rank of r] - r))``: half of both as its
    value (the sums are TRL's), the gradient of A + B (each log-ratio's own sorted term)."""
    partners = _sorted_partners(x)
    chosen_term = smoothed_sigmoid(x.beta * (x.c - partners.unpaired_rejected), x.eps)
    rejected_term = smoothed_sigmoid(x.beta * (partners.unpaired_chosen - x.r), x.eps)
    both = chosen_term + rejected_term
    return both - 0.5 * both.detach()


def _sorted_partners(x: LossInputs) -> PairPartners:
    if x.partners is None or x.partners.aot_reference is None:
        raise ValueError("a sorted loss needs the step's sorted log-ratios (StepStatistic.from_values with values)")
    return x.partners


def sft(x: LossInputs) -> torch.Tensor:
    """``-sum logp(y_w) / sum n_w`` over the step, a pair's share ``-logp(y_w) N / T`` (N pairs, T chosen completion
    tokens of the step); of the unweighted sums (TRL's sft reads the plain per-token log-probs, no LD-DPO)."""
    return -x.policy.unweighted_logps[0::2] * x.partners.sft_scale


def apo_zero(x: LossInputs) -> torch.Tensor:
    """``1 - sig(b c) + sig(b r)``: APO-zero (for chosen answers better than the model's own)."""
    return 1 - torch.sigmoid(x.beta * x.c) + torch.sigmoid(x.beta * x.r)


def apo_down(x: LossInputs) -> torch.Tensor:
    """``sig(b c) + 1 - sig(b (c - r))``: APO-down (for chosen answers worse than the model's own)."""
    return torch.sigmoid(x.beta * x.c) + 1 - torch.sigmoid(x.beta * (x.c - x.r))


def discopop(x: LossInputs) -> torch.Tensor:
    """``m = sig(b d / tau)``: ``(1-m)(-log sig(b d)) + m exp(-b d)``: DiscoPOP's log-ratio modulated loss."""
    z = x.beta * x.d
    m = torch.sigmoid(z / x.settings.discopop_tau)
    return -F.logsigmoid(z) * (1 - m) + torch.exp(-z) * m


@dataclass(frozen=True)
class LossSpec:
    """One loss: its function and, as fields, every rule about it."""

    title: str  # as papers and messages name it
    loss: Callable[[LossInputs], torch.Tensor]  # per-pair loss [P]
    needs_reference: bool = True  # False: reference-free (no reference is loaded; it is the run's only loss)
    length_normalized: bool = False  # d is of per-token averages of each sequence
    normalized_metrics: bool = False  # rewards/* and logps/* as per-token averages (when every loss of the run has it)
    label_smoothing: Smoothing = Smoothing.NONE
    f_divergence: bool = False  # reads the --f-divergence-type score (the others read the plain log-ratios)
    coupling: Coupling = Coupling.NONE
    dpo_trainer: bool = True  # a TRL DPOTrainer loss: --ld-alpha and --use-weighting (its settings) have its form
    parameters: tuple[str, ...] = ()  # the LossConfig fields (PARAMETER_RULES) only this loss reads

    @property
    def weightable(self) -> bool:
        """Whether WPO may weight its per-pair value: not a statistic of the whole batch (TRL 1.16 refuses the sorted
        ones and fails on sft, an in-place product on an expanded scalar)."""
        return self.coupling is Coupling.NONE


# --loss names, in the order its choices are listed: the DPO family of --loss's help first, then TRL 1.16's others
LOSSES: dict[str, LossSpec] = {
    "sigmoid": LossSpec("DPO", sigmoid, label_smoothing=Smoothing.ALONE, f_divergence=True),
    "robust": LossSpec("robust DPO", robust, label_smoothing=Smoothing.READS, f_divergence=True),
    "hinge": LossSpec("SLiC", hinge, f_divergence=True),
    "ipo": LossSpec("IPO", ipo, length_normalized=True, normalized_metrics=True, f_divergence=True),
    "simpo": LossSpec("SimPO", simpo, needs_reference=False, length_normalized=True, normalized_metrics=True,
                      label_smoothing=Smoothing.READS, dpo_trainer=False, parameters=("simpo_gamma",)),
    "exo_pair": LossSpec("EXO", exo_pair, label_smoothing=Smoothing.NEEDS, f_divergence=True),
    "nca_pair": LossSpec("NCA", nca_pair),
    "bco_pair": LossSpec("BCO", bco_pair),
    "sppo_hard": LossSpec("SPPO", sppo_hard),
    "aot": LossSpec("AOT", aot, label_smoothing=Smoothing.READS, coupling=Coupling.SORTED),
    "aot_unpaired": LossSpec("AOT unpaired", aot_unpaired, label_smoothing=Smoothing.READS, coupling=Coupling.SORTED),
    "apo_zero": LossSpec("APO-zero", apo_zero),
    "apo_down": LossSpec("APO-down", apo_down),
    "discopop": LossSpec("DiscoPOP", discopop, f_divergence=True, parameters=("discopop_tau",)),
    "sft": LossSpec("SFT", sft, coupling=Coupling.TOKEN_MEAN),
    "sigmoid_norm": LossSpec("length-normalized DPO", sigmoid, length_normalized=True, f_divergence=True),
}
LOSS_NAMES = tuple(LOSSES)

# The settings only some losses read (LossSpec.parameters): what each value must be, whichever loss the run trains
PARAMETER_RULES: dict[str, tuple[str, Callable[[float], bool]]] = {
    "simpo_gamma": ("finite", math.isfinite),
    "discopop_tau": ("a finite number > 0", lambda tau: math.isfinite(tau) and tau > 0),
}


def needs_policy_prepass(names: Iterable[str]) -> bool:
    """Whether a run of the losses ``names`` sorts the whole step, so that each step runs the no-grad policy pre-pass
    first (a name of no loss counts as none: a report's settings may be of an older version)."""
    return any(LOSSES[name].coupling is Coupling.SORTED for name in names if name in LOSSES)


def f_divergence_score(logratios: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """f'(exp(logratio)): reverse_kl log t, forward_kl 1 - 1/t, js log(2t/(t+1)), alpha (t^(a-1) - 1)/(a-1)."""
    kind, alpha = cfg.f_divergence_type, cfg.f_alpha_divergence_coef
    if kind == "reverse_kl" or (kind == "alpha_divergence" and abs(alpha - 1.0) < 1e-6):
        return logratios
    if kind == "forward_kl":
        return 1 - torch.exp(-logratios)
    if kind == "js_divergence":
        return math.log(2) + F.logsigmoid(logratios)
    return (torch.exp(torch.clamp((alpha - 1.0) * logratios, max=80.0)) - 1.0) / (alpha - 1.0)


def _readers(predicate: Callable[[LossSpec], bool]) -> str:
    return ", ".join(name for name, spec in LOSSES.items() if predicate(spec))


@dataclass(frozen=True)
class LossConfig:
    """The loss settings of a run, built once from the flags (``TrainConfig.loss_config``)."""

    loss_type: str = "sigmoid"  # --loss: one name of LOSSES, or several comma-separated
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

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.loss_type.split(","))

    @property
    def specs(self) -> tuple[LossSpec, ...]:
        return tuple(LOSSES[name] for name in self.names)

    @property
    def weights(self) -> tuple[float, ...]:
        return self.loss_weights if self.loss_weights is not None else (1.0,) * len(self.names)

    @property
    def needs_reference(self) -> bool:
        """Whether the run needs reference log-probs (a model or --ref-logps): not for a reference-free loss."""
        return any(spec.needs_reference for spec in self.specs)

    @property
    def batch_coupled(self) -> bool:
        """Whether a loss of the run needs the whole step's statistic (run/step_statistics.py)."""
        return any(spec.coupling is not Coupling.NONE for spec in self.specs)

    @property
    def needs_policy_prepass(self) -> bool:
        return needs_policy_prepass(self.names)

    @property
    def normalized_metrics(self) -> bool:
        return all(spec.normalized_metrics for spec in self.specs)

    def reads_label_smoothing(self, spec: LossSpec) -> bool:
        return spec.label_smoothing in (Smoothing.READS, Smoothing.NEEDS) or (
            spec.label_smoothing is Smoothing.ALONE and len(self.names) == 1)

    def label_smoothing_of(self, spec: LossSpec) -> float:
        """--label-smoothing as the loss ``spec`` of this run reads it (0 where it reads none)."""
        return self.label_smoothing if self.reads_label_smoothing(spec) else 0.0

    def token_weighting(self, policy: bool) -> TokenWeighting:
        """What the policy's (``policy``) or the reference's forward computes besides the plain sums."""
        return TokenWeighting(self.ld_alpha, self.use_weighting and policy, token_stats=policy)

    def validate(self, together: bool = True) -> None:
        """Every rule about the loss settings, each once: a value out of range, then (``together``) a combination TRL
        refuses or cannot run and a setting no loss of the run reads (TRL would ignore it silently), in one line."""
        unknown = [name for name in self.names if name not in LOSSES]
        if unknown:
            raise InputError(f"--loss: unknown loss {unknown[0]!r} (choices: {', '.join(LOSS_NAMES)})")
        if self.loss_weights is not None and len(self.loss_weights) != len(self.names):
            raise InputError(f"--loss-weights: {len(self.loss_weights)} weights for {len(self.names)} losses "
                             f"({self.loss_type}); give one weight per loss")
        if not all(math.isfinite(w) for w in self.weights):
            raise InputError(f"--loss-weights must be finite, got {self.loss_weights}")
        if not (math.isfinite(self.beta) and self.beta > 0):
            raise InputError(f"--beta must be a finite number > 0, got {self.beta}")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise InputError(f"--label-smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if not (math.isfinite(self.rpo_alpha) and self.rpo_alpha >= 0):
            raise InputError(f"--rpo-alpha must be a finite number >= 0, got {self.rpo_alpha}")
        if self.ld_alpha is not None and not 0.0 <= self.ld_alpha <= 1.0:
            raise InputError(f"--ld-alpha must be in [0, 1] (the weight of the tokens past the shorter completion's "
                             f"length), got {self.ld_alpha}")
        for field, (rule, valid) in PARAMETER_RULES.items():
            if not valid(getattr(self, field)):
                raise InputError(f"--{field.replace('_', '-')} must be {rule}, got {getattr(self, field)}")
        if self.f_divergence_type not in F_DIVERGENCES:
            raise InputError(f"--f-divergence-type: unknown {self.f_divergence_type!r} "
                             f"(choices: {', '.join(F_DIVERGENCES)})")
        if together:
            self._check_combination()
            self._check_settings_read()

    def _check_combination(self) -> None:
        """The losses of the run together, and with the token weighting."""
        for name, spec in zip(self.names, self.specs):
            if not spec.needs_reference and len(self.names) > 1:
                raise InputError(f"--loss {self.loss_type}: {spec.title} is reference-free and cannot be combined with "
                                 f"another loss")
            if not spec.dpo_trainer and (self.ld_alpha is not None or self.use_weighting):
                raise InputError(f"--loss {name}: --ld-alpha and --use-weighting are TRL DPOTrainer settings with no "
                                 f"{spec.title} form; drop them or pick a DPO-family loss")
            if self.use_weighting and not spec.weightable:
                raise InputError(f"--use-weighting with --loss {name}: WPO weights each pair's loss, and {name} is a "
                                 f"statistic of the whole batch (TRL 1.16 refuses or fails on it too)")

    def _check_settings_read(self) -> None:
        """A setting away from its default that no loss of the run reads is refused (TRL ignores it silently)."""
        ignored = [name for name, spec in zip(self.names, self.specs) if not spec.f_divergence]
        if self.f_divergence_type != "reverse_kl" and ignored:
            raise InputError(f"--f-divergence-type {self.f_divergence_type} has no effect on --loss "
                             f"{','.join(ignored)} (only {_readers(lambda spec: spec.f_divergence)} use it)")
        if self.label_smoothing and not any(self.reads_label_smoothing(spec) for spec in self.specs):
            readers = ", ".join(name + (" as the only loss" if spec.label_smoothing is Smoothing.ALONE else "")
                                for name, spec in LOSSES.items() if spec.label_smoothing is not Smoothing.NONE)
            raise InputError(f"--label-smoothing {self.label_smoothing} has no effect with --loss {self.loss_type} "
                             f"(only {readers} use it); set it to 0")
        for name, spec in zip(self.names, self.specs):
            if spec.label_smoothing is Smoothing.NEEDS and not self.label_smoothing > 0:
                raise InputError(f"--label-smoothing must be in (0, 0.5) for --loss {name} (log(e) in its KL), got "
                                 f"{self.label_smoothing}")
        unused = [(f"--{field.replace('_', '-')}", getattr(self, field), f"--loss {self.loss_type}",
                   "--loss " + _readers(lambda spec: field in spec.parameters))
                  for field in PARAMETER_RULES
                  if getattr(self, field) != getattr(LossConfig, field)
                  and not any(field in spec.parameters for spec in self.specs)]
        if self.f_alpha_divergence_coef != LossConfig.f_alpha_divergence_coef and \
                self.f_divergence_type != "alpha_divergence":
            unused.append(("--f-alpha-divergence-coef", self.f_alpha_divergence_coef,
                           f"--f-divergence-type {self.f_divergence_type}", "--f-divergence-type alpha_divergence"))
        if unused:
            flag, value, this_run, needs = unused[0]
            raise InputError(f"{flag} {value:g} has no effect with {this_run} (only {needs} uses it); drop it")
