"""The TRL 1.16 loss family against TRL's own ``DPOTrainer._compute_loss`` on the same per-token log-probs."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from trl.trainer.dpo_trainer import DPOTrainer

from ds_packdpo.config import TrainConfig
from ds_packdpo.errors import InputError
from ds_packdpo.model.logps import SequenceLogps
from ds_packdpo.model.loss_family import TRL_LOSS_TYPES, FamilyConfig, family_pair_losses
from ds_packdpo.model.losses import global_normalized_loss, pair_losses

PAIRS, LENGTH = 6, 10


def example(seed: int):
    """TRL layout [chosen; rejected]; per-token log-probs a leaf, zeroed off the completion (as TRL's fused head); reference sums."""
    g = torch.Generator().manual_seed(seed)
    completion = torch.zeros(2 * PAIRS, LENGTH, dtype=torch.long)
    for row in range(2 * PAIRS):
        start = int(torch.randint(1, 4, (), generator=g))
        end = int(torch.randint(start + 1, LENGTH + 1, (), generator=g))
        completion[row, start:end] = 1
    shifted = completion[:, 1:].float()
    leaf = (-torch.rand(2 * PAIRS, LENGTH - 1, generator=g) * 3).requires_grad_()
    ref = (leaf.detach() * shifted * (1 + 0.3 * torch.randn(2 * PAIRS, 1, generator=g))).sum(1)
    return completion, shifted, leaf, ref


def trl_loss(cfg: FamilyConfig, completion, per_token, ref):
    """TRL 1.16's ``_compute_loss`` run with a stub trainer and a stub model that returns ``per_token``."""
    accelerator = SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda x: x, gather=lambda x: x)
    trainer = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=accelerator, aux_loss_enabled=False, ld_alpha=None,
        precompute_ref_logps=True, f_divergence_type=cfg.f_divergence_type,
        f_alpha_divergence_coef=cfg.f_alpha_divergence_coef, loss_types=list(cfg.loss_types),
        loss_weights=list(cfg.weights), beta=cfg.beta, label_smoothing=cfg.label_smoothing,
        args=SimpleNamespace(discopop_tau=cfg.discopop_tau), use_weighting=False,
        _metrics=defaultdict(lambda: defaultdict(list)), _tp_size=1, _total_train_tokens=0)
    zeros = torch.zeros_like(per_token)

    def model(**_):
        return SimpleNamespace(log_probs=per_token * completion[:, 1:], entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())

    inputs = {"input_ids": torch.ones_like(completion), "attention_mask": torch.ones_like(completion),
              "completion_mask": completion, "ref_chosen_logps": ref[:PAIRS], "ref_rejected_logps": ref[PAIRS:]}
    return DPOTrainer._compute_loss(trainer, model, inputs, False), trainer._metrics["train"]


def canonical(values: torch.Tensor) -> torch.Tensor:
    """[chosen; rejected] -> interleaved (2p chosen, 2p+1 rejected), fp64 as logps.py gives them."""
    return torch.stack([values[:PAIRS], values[PAIRS:]], 1).reshape(-1).double()


def ours(cfg: FamilyConfig, shifted, per_token, ref):
    tokens = canonical(shifted.sum(1))
    policy = SequenceLogps(canonical((per_token * shifted).sum(1)), tokens, torch.zeros_like(tokens))
    reference = SequenceLogps(canonical(ref), tokens, torch.zeros_like(tokens))
    losses, metrics = family_pair_losses(policy, reference, cfg)
    return global_normalized_loss(losses, global_pairs=PAIRS, gradient_divisor=1), metrics


CONFIGS = [FamilyConfig((name,), label_smoothing=0.1 if name in ("exo_pair", "robust", "aot", "aot_unpaired") else 0.0)
           for name in TRL_LOSS_TYPES] + [
    FamilyConfig(("sigmoid", "aot", "bco_pair", "ipo", "sft"), (1.0, 0.5, 0.25, 0.1, 0.3), beta=0.3),
    FamilyConfig(("discopop",), beta=0.5, discopop_tau=0.2),
] + [FamilyConfig(("sigmoid", "hinge", "ipo", "exo_pair", "robust", "discopop", "sigmoid_norm"), beta=0.2,
                  label_smoothing=0.1, f_divergence_type=f, f_alpha_divergence_coef=0.5)
     for f in ("forward_kl", "js_divergence", "alpha_divergence")]

MEASURED: dict[str, float] = {}


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "+".join(c.loss_types) + f"-{c.f_divergence_type}")
def test_loss_and_gradient_match_trl_compute_loss(cfg):
    cfg.validate()
    completion, shifted, per_token, ref = example(seed=11)
    expected, trl_metrics = trl_loss(cfg, completion, per_token, ref)
    (expected_grad,) = torch.autograd.grad(expected, per_token)
    loss, metrics = ours(cfg, shifted, per_token, ref)
    (grad,) = torch.autograd.grad(loss, per_token)
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, expected.double(), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-4, atol=1e-6)
    assert grad.abs().max() > 1e-4  # the loss really depends on the log-probs
    for name in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen"):
        assert float(metrics[name].mean()) == pytest.approx(trl_metrics[name][0], rel=1e-5, abs=1e-6), name


@pytest.mark.parametrize("kwargs, flag", [
    ({"loss_types": ("dpo",)}, "--loss"),
    ({"loss_types": ("sigmoid", "ipo"), "loss_weights": (1.0,)}, "--loss-weights"),
    ({"loss_types": ("bco_pair",), "f_divergence_type": "forward_kl"}, "--f-divergence-type"),
    ({"f_divergence_type": "chi2"}, "--f-divergence-type"),
    ({"loss_types": ("exo_pair",)}, "--label-smoothing"),
    ({"discopop_tau": 0.0}, "--discopop-tau"),
    ({"beta": 0.0}, "--beta"),
])
def test_bad_combinations_are_refused_in_one_line(kwargs, flag):
    with pytest.raises(InputError) as info:
        FamilyConfig(**kwargs).validate()
    assert str(info.value).startswith(flag) and "\n" not in str(info.value)


def test_loss_flags_reach_the_loss_and_change_it():
    """--loss a,b --loss-weights and --f-divergence-type/--discopop-tau go through TrainConfig.loss_config()."""
    completion, shifted, per_token, ref = example(seed=5)
    tokens = canonical(shifted.sum(1))
    policy = SequenceLogps(canonical((per_token * shifted).sum(1)).detach(), tokens, torch.zeros_like(tokens))
    reference = SequenceLogps(canonical(ref), tokens, torch.zeros_like(tokens))

    def loss_of(**flags):
        return pair_losses(policy, reference, TrainConfig(**flags).loss_config())[0].mean()

    plain = loss_of(loss="sigmoid")
    assert loss_of(loss="sigmoid,aot", loss_weights="1,0") == pytest.approx(float(plain), rel=1e-12)
    combined = loss_of(loss="sigmoid,aot", loss_weights="1,0.5")
    aot = loss_of(loss="aot")
    assert combined == pytest.approx(float(plain + 0.5 * aot), rel=1e-12)
    assert loss_of(loss="sigmoid", f_divergence_type="js_divergence") != pytest.approx(float(plain))
    assert loss_of(loss="discopop", discopop_tau=0.5) != pytest.approx(float(loss_of(loss="discopop")))
    for flags, flag in (({"loss": "sigmoid,dpo"}, "--loss"), ({"loss": "sigmoid,ipo", "loss_weights": "1"},
                                                                "--loss-weights")):
        with pytest.raises(InputError) as info:
            TrainConfig(**flags).validate()
        assert str(info.value).startswith(flag) and "\n" not in str(info.value)
