"""The DPO loss family against a plain TRL-style padded implementation, and global normalization."""

from __future__ import annotations

import ast
import dataclasses
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_packdpo.config import flag_fields
from ds_packdpo.errors import InputError
from ds_packdpo.model.logps import SequenceLogps, sequence_logps
from ds_packdpo.model.loss_registry import LOSS_NAMES
from ds_packdpo.model.losses import LossConfig, global_normalized_loss, metric_means, metric_sums, pair_losses

VOCAB = 40
LOSS_TYPES = ("sigmoid", "robust", "hinge", "ipo", "simpo")  # the losses trl_reference computes


def padded_example(pairs: int, seed: int, max_len: int = 12):
    """TRL layout: rows 0..P-1 the chosen, P..2P-1 the rejected, right padding; logits a leaf."""
    g = torch.Generator().manual_seed(seed)
    rows = 2 * pairs
    labels = torch.full((rows, max_len), -100)
    loss_mask = torch.zeros(rows, max_len, dtype=torch.bool)
    for row in range(rows):
        prompt = int(torch.randint(1, 5, (), generator=g))
        total = int(torch.randint(prompt + 1, max_len + 1, (), generator=g))
        # position t predicts token t+1; completion tokens are prompt..total-1
        labels[row, prompt - 1:total - 1] = torch.randint(0, VOCAB, (total - prompt,), generator=g)
        loss_mask[row, prompt - 1:total - 1] = True
    logits = (torch.randn(rows, max_len, VOCAB, generator=g) * 3).requires_grad_()
    seq_index = torch.cat([2 * torch.arange(pairs), 2 * torch.arange(pairs) + 1])[:, None].expand(rows, max_len)
    return logits, labels, loss_mask, seq_index


def trl_reference(logits, labels, loss_mask, ref_chosen, ref_rejected, cfg: LossConfig):
    """A straightforward TRL DPOTrainer/CPOTrainer computation from padded logits (mean loss, metrics)."""
    pairs = logits.shape[0] // 2
    per_token = torch.log_softmax(logits, dim=-1).gather(2, labels.clamp_min(0)[..., None]).squeeze(2)
    all_logps = (per_token * loss_mask).sum(-1)
    counts = loss_mask.sum(-1)
    if cfg.loss_type in ("ipo", "simpo"):
        all_logps = all_logps / counts
    chosen, rejected = all_logps[:pairs], all_logps[pairs:]
    beta, ls = cfg.beta, cfg.label_smoothing
    if cfg.loss_type == "simpo":
        z = (chosen - rejected) - cfg.simpo_gamma / beta
        losses = -F.logsigmoid(beta * z) * (1 - ls) - F.logsigmoid(-beta * z) * ls
        chosen_rewards, rejected_rewards = beta * chosen.detach(), beta * rejected.detach()
    else:
        z = (chosen - ref_chosen) - (rejected - ref_rejected)
        if cfg.loss_type == "sigmoid":
            losses = -F.logsigmoid(beta * z) * (1 - ls) - F.logsigmoid(-beta * z) * ls
        elif cfg.loss_type == "robust":
            losses = (-F.logsigmoid(beta * z) * (1 - ls) + F.logsigmoid(-beta * z) * ls) / (1 - 2 * ls)
        elif cfg.loss_type == "hinge":
            losses = torch.relu(1 - beta * z)
        else:
            losses = (z - 1 / (2 * beta)) ** 2
        chosen_rewards = beta * (chosen - ref_chosen).detach()
        rejected_rewards = beta * (rejected - ref_rejected).detach()
    if cfg.rpo_alpha > 0:
        token_counts = loss_mask[:pairs].sum(-1)
        losses = losses - cfg.rpo_alpha * (per_token[:pairs] * loss_mask[:pairs]).sum(-1) / token_counts
    mask = loss_mask[..., None]
    metrics = {
        "rewards/chosen": chosen_rewards.mean(), "rewards/rejected": rejected_rewards.mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
        "logps/chosen": chosen.detach().mean(), "logps/rejected": rejected.detach().mean(),
        # TRL: logits[:n][loss_mask[:n]].mean() - the mean over completion tokens and the vocabulary
        "logits/chosen": logits[:pairs].detach().masked_select(mask[:pairs]).mean(),
        "logits/rejected": logits[pairs:].detach().masked_select(mask[pairs:]).mean(),
    }
    return losses.mean(), metrics


CONFIGS = [LossConfig(loss_type=t) for t in LOSS_TYPES] + [
    LossConfig("sigmoid", beta=0.3, label_smoothing=0.2),
    LossConfig("robust", beta=0.2, label_smoothing=0.1),
    LossConfig("simpo", beta=2.0, simpo_gamma=1.0, label_smoothing=0.1),
    LossConfig("ipo", beta=0.5),
    LossConfig("sigmoid", rpo_alpha=0.7),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.loss_type}-b{c.beta}-ls{c.label_smoothing}-rpo{c.rpo_alpha}")
def test_each_loss_matches_trl_style_padded_reference(cfg):
    pairs = 5
    logits, labels, loss_mask, seq_index = padded_example(pairs, seed=3)
    g = torch.Generator().manual_seed(7)
    ref_sums = -torch.rand(2 * pairs, generator=g) * 30 - 5  # precomputed reference sums, canonical order
    tokens = torch.cat([loss_mask[:pairs].sum(-1), loss_mask[pairs:].sum(-1)])
    canonical_tokens = torch.stack([tokens[:pairs], tokens[pairs:]], 1).reshape(-1).float()
    reference = SequenceLogps(ref_sums, canonical_tokens, torch.zeros(2 * pairs))
    ref_c, ref_r = ref_sums[0::2], ref_sums[1::2]
    if cfg.loss_type == "ipo":
        ref_c, ref_r = ref_c / canonical_tokens[0::2], ref_r / canonical_tokens[1::2]

    expected_loss, expected_metrics = trl_reference(logits, labels, loss_mask, ref_c, ref_r, cfg)
    (expected_grad,) = torch.autograd.grad(expected_loss, logits)

    policy = sequence_logps(logits, labels, seq_index, 2 * pairs, chunk_tokens=7)
    losses, metrics = pair_losses(policy, None if cfg.loss_type == "simpo" else reference, cfg)
    loss = global_normalized_loss(losses, global_pairs=pairs, gradient_divisor=1)
    (grad,) = torch.autograd.grad(loss, logits)

    torch.testing.assert_close(loss, expected_loss.double(), rtol=1e-5, atol=1e-6)  # fp64 sums: an fp64 loss
    torch.testing.assert_close(grad, expected_grad, rtol=1e-4, atol=1e-7)
    assert grad.abs().max() > 1e-4  # the loss really depends on the logits here
    means = metric_means(metric_sums(metrics, policy))
    for name, value in expected_metrics.items():
        assert means[name] == pytest.approx(float(value), rel=1e-5, abs=1e-6), name
    assert all(not m.requires_grad for m in metrics.values())
    assert ("nll_loss" in metrics) == (cfg.rpo_alpha > 0)


def test_metric_sums_are_sums_and_survive_splitting():
    """Summing metric_sums of two halves (as an all-reduce would) gives the metrics of the whole."""
    pairs = 6
    logits, labels, loss_mask, seq_index = padded_example(pairs, seed=5)
    cfg = LossConfig("sigmoid")
    with torch.no_grad():
        policy = sequence_logps(logits, labels, seq_index, 2 * pairs)
        offsets = torch.randn(2 * pairs, generator=torch.Generator().manual_seed(0)) * 3
        reference = SequenceLogps(policy.logps + offsets, policy.tokens, policy.logits_sum)
        whole = metric_means(metric_sums(pair_losses(policy, reference, cfg)[1], policy))

        def part(sl):
            pol = SequenceLogps(policy.logps[sl], policy.tokens[sl], policy.logits_sum[sl])
            ref = SequenceLogps(reference.logps[sl], reference.tokens[sl], reference.logits_sum[sl])
            return metric_sums(pair_losses(pol, ref, cfg)[1], pol)

        first, second = part(slice(0, 4)), part(slice(4, None))  # 2 pairs and 4 pairs
    summed = metric_means({k: first[k] + second[k] for k in first})
    assert first["pairs"] == 2 and second["pairs"] == 4
    assert summed == pytest.approx(whole, rel=1e-6)
    assert 0.0 < whole["rewards/accuracies"] < 1.0


def test_simpo_needs_no_reference_and_others_do():
    pairs = 2
    logits, labels, _, seq_index = padded_example(pairs, seed=1)
    policy = sequence_logps(logits, labels, seq_index, 2 * pairs)
    losses, _ = pair_losses(policy, None, LossConfig("simpo"))
    assert losses.shape == (pairs,)
    with pytest.raises(ValueError, match="needs reference"):
        pair_losses(policy, None, LossConfig("sigmoid"))


@pytest.mark.parametrize("kwargs, flag", [
    ({"loss_type": "dpo"}, "--loss"),
    ({"beta": 0.0}, "--beta"),
    ({"beta": math.nan}, "--beta"),
    ({"label_smoothing": 0.5}, "--label-smoothing"),
    ({"label_smoothing": -0.1}, "--label-smoothing"),
    ({"loss_type": "hinge", "label_smoothing": 0.1}, "--label-smoothing"),
    ({"loss_type": "ipo", "label_smoothing": 0.1}, "--label-smoothing"),
    ({"simpo_gamma": math.inf}, "--simpo-gamma"),
    ({"rpo_alpha": -1.0}, "--rpo-alpha"),
])
def test_config_validation_names_the_flag(kwargs, flag):
    with pytest.raises(InputError) as info:
        LossConfig(**kwargs).validate()
    message = str(info.value)
    assert message.startswith(flag) and "\n" not in message


def test_valid_configs_pass_validation():
    for cfg in CONFIGS:
        cfg.validate()


@settings(max_examples=40, deadline=None)
@given(
    rank_pair_counts=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=3), min_size=1, max_size=4)
    .filter(lambda ranks: sum(map(sum, ranks)) > 0),
    loss_type=st.sampled_from(LOSS_TYPES),
    seed=st.integers(0, 2**16),
)
def test_global_normalization_makes_rank_average_the_full_batch_gradient(rank_pair_counts, loss_type, seed):
    """DeepSpeed averages gradients over ranks; each rank sums its rows' globally normalized losses.

    ``rank_pair_counts[r]`` are the pair counts of rank r's rows (ranks hold different
    numbers of pairs and rows, as under token-budget packing).  The rank-averaged
    gradient must equal the gradient of the mean loss over all pairs.
    """
    g = torch.Generator().manual_seed(seed)
    total_pairs = sum(map(sum, rank_pair_counts))
    features = torch.randn(2 * total_pairs, 3, generator=g)
    tokens = torch.randint(1, 20, (2 * total_pairs,), generator=g).float()
    reference = SequenceLogps(-torch.rand(2 * total_pairs, generator=g) * 10, tokens, torch.zeros(2 * total_pairs))
    theta = torch.randn(3, generator=g, requires_grad=True)
    cfg = LossConfig(loss_type, beta=0.5)

    def losses_of(sequences: slice) -> torch.Tensor:
        policy = SequenceLogps(-(features[sequences] @ theta).abs() - 1, tokens[sequences], torch.zeros_like(tokens[sequences]))
        ref = SequenceLogps(reference.logps[sequences], tokens[sequences], reference.logits_sum[sequences])
        return pair_losses(policy, ref, cfg)[0]

    (full_grad,) = torch.autograd.grad(losses_of(slice(None)).mean(), theta)

    world = len(rank_pair_counts)
    rank_grads, start = [], 0
    for rows in rank_pair_counts:
        rank_loss = torch.zeros(())
        for count in rows:  # one micro-step per row; gradients accumulate
            rank_loss = rank_loss + global_normalized_loss(losses_of(slice(2 * start, 2 * (start + count))),
                                                           total_pairs, world)
            start += count
        rank_grads.append(torch.autograd.grad(rank_loss, theta)[0])  # a row of 0 pairs (dummy) adds 0
    averaged = torch.stack(rank_grads).mean(0)
    torch.testing.assert_close(averaged, full_grad, rtol=1e-5, atol=1e-7)


def test_global_normalized_loss_value_and_bad_count():
    losses = torch.tensor([1.0, 2.0, 3.0])
    assert float(global_normalized_loss(losses, global_pairs=12, gradient_divisor=4)) == pytest.approx(6.0 / 12 * 4)
    with pytest.raises(ValueError):
        global_normalized_loss(losses, global_pairs=0, gradient_divisor=1)


# ----------------------------------------------------------------------------- one chain, one table
def _pairs(seed: int, pairs: int = 6) -> tuple[SequenceLogps, SequenceLogps]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 30, (2 * pairs,), generator=g).double()
    policy = -torch.rand(2 * pairs, generator=g, dtype=torch.float64) * 40
    reference = policy + torch.randn(2 * pairs, generator=g, dtype=torch.float64) * 3
    zeros = torch.zeros_like(tokens)
    return SequenceLogps(policy, tokens, zeros), SequenceLogps(reference, tokens, zeros)


@pytest.mark.parametrize("cfg", [LossConfig("sigmoid", label_smoothing=0.2), LossConfig("robust", label_smoothing=0.1),
                                 LossConfig("hinge"), LossConfig("ipo", beta=0.5),
                                 LossConfig("simpo", beta=2.0, label_smoothing=0.1)], ids=lambda c: c.loss_type)
def test_a_loss_is_the_same_whatever_other_settings_are_given(cfg):
    """--loss-weights (or LD-DPO, WPO, an f-divergence) once moved a loss to a second copy of it that read
    --label-smoothing and reported its metrics otherwise; a weight of 1 now changes nothing, a weight w scales the loss
    alone, and sigmoid's label smoothing is that of cDPO whenever it is the only loss."""
    policy, reference = _pairs(4)
    losses, metrics = pair_losses(policy, reference, cfg)
    weighted = dataclasses.replace(cfg, loss_weights=(1.0,))
    weighted.validate()
    again, again_metrics = pair_losses(policy, reference, weighted)
    assert torch.equal(losses, again) and all(torch.equal(metrics[k], again_metrics[k]) for k in metrics)
    doubled, doubled_metrics = pair_losses(policy, reference, dataclasses.replace(cfg, loss_weights=(2.0,)))
    assert torch.equal(doubled, 2 * losses) and all(torch.equal(metrics[k], doubled_metrics[k]) for k in metrics)
    if cfg.loss_type == "sigmoid":
        js = dataclasses.replace(cfg, f_divergence_type="js_divergence", ld_alpha=0.5, use_weighting=True)
        js.validate()  # refused once: "--label-smoothing has no effect" on the second copy
        unsmoothed, _ = pair_losses(policy, reference, dataclasses.replace(cfg, label_smoothing=0.0))
        assert not torch.allclose(losses, unsmoothed)


@pytest.mark.parametrize("kwargs, message", [
    ({"loss_type": "sigmoid,hinge", "label_smoothing": 0.1}, "--label-smoothing 0.1 has no effect"),  # TRL 1.16 too
    ({"loss_type": "robust", "label_smoothing": 0.5, "loss_weights": (1.0,)}, "--label-smoothing must be in [0, 0.5)"),
    ({"loss_type": "aot", "label_smoothing": -0.1}, "--label-smoothing must be in [0, 0.5)"),
    ({"loss_type": "simpo,sigmoid"}, "--loss simpo,sigmoid: SimPO is reference-free"),
    ({"loss_type": "simpo", "f_divergence_type": "js_divergence"}, "--f-divergence-type js_divergence has no effect"),
])
def test_each_rule_is_one_for_every_loss(kwargs, message):
    """Ranges and combinations once checked on one of two paths only are refused on every one."""
    with pytest.raises(InputError) as info:
        LossConfig(**kwargs).validate()
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_sigmoid_in_a_combination_reads_no_label_smoothing():
    """TRL 1.16's sigmoid term takes no label smoothing: in a combination --label-smoothing is robust's, aot's ..."""
    policy, reference = _pairs(5)
    combined, _ = pair_losses(policy, reference, LossConfig("sigmoid,robust", label_smoothing=0.1))
    plain, _ = pair_losses(policy, reference, LossConfig("sigmoid"))
    robust, _ = pair_losses(policy, reference, LossConfig("robust", label_smoothing=0.1))
    torch.testing.assert_close(combined, plain + robust, rtol=1e-15, atol=0)


def _package_modules():
    package = Path(__file__).resolve().parents[1] / "ds_packdpo"
    return {path.relative_to(package.parent).as_posix(): ast.parse(path.read_text()) for path in package.rglob("*.py")}


def test_no_module_but_the_registry_names_a_loss():
    """Every property of a loss is a field of its row (model/loss_registry.py): no module compares a loss name or
    keeps a collection of them (the name tuples and ``== "simpo"`` spread over five modules before)."""
    named = []
    for module, tree in _package_modules().items():
        if module == "ds_packdpo/model/loss_registry.py":
            continue
        for node in ast.walk(tree):
            operands = ([node.left, *node.comparators] if isinstance(node, ast.Compare)
                        else node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set))
                        else node.keys if isinstance(node, ast.Dict) else [])
            for operand in operands:
                values = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
                named += [(module, node.lineno, v.value) for v in values
                          if isinstance(v, ast.Constant) and v.value in LOSS_NAMES]
    assert named == []


def test_the_loss_flag_lists_every_loss_of_the_registry():
    """--loss's help (and docs/cli.md, generated from it) is written by hand: it names every row."""
    (loss,) = [f for f in flag_fields() if f.name == "loss"]
    assert set(LOSS_NAMES) <= set(re.findall(r"[a-z_]+", loss.metadata["help"]))
