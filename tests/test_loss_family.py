"""The TRL 1.16 loss family against TRL's own ``DPOTrainer._compute_loss`` on the same per-token log-probs."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from trl.trainer.dpo_trainer import DPOTrainer

from ds_packdpo.config import TrainConfig
from ds_packdpo.errors import InputError
from ds_packdpo.model.attention import attn_implementation
from ds_packdpo.model.build import build_model
from ds_packdpo.model.collate import collate_grouped, collate_packed
from ds_packdpo.model.logps import SequenceLogps, forward_logps
from ds_packdpo.model.loss_registry import LOSSES
from ds_packdpo.model.losses import LossConfig, global_normalized_loss, metric_means, metric_sums, pair_losses

from test_token_weights import VOCAB, grouped_pairs

PAIRS, LENGTH = 6, 10
TRL_LOSS_TYPES = tuple(name for name, spec in LOSSES.items() if spec.dpo_trainer)  # TRL 1.16 DPOTrainer's 15


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


def trl_loss(cfg: LossConfig, completion, per_token, ref):
    """TRL 1.16's ``_compute_loss`` run with a stub trainer and a stub model that returns ``per_token``."""
    accelerator = SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda x: x, gather=lambda x: x)
    trainer = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=accelerator, aux_loss_enabled=False, ld_alpha=None,
        precompute_ref_logps=True, f_divergence_type=cfg.f_divergence_type,
        f_alpha_divergence_coef=cfg.f_alpha_divergence_coef, loss_types=list(cfg.names),
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


def ours(cfg: LossConfig, shifted, per_token, ref):
    tokens = canonical(shifted.sum(1))
    policy = SequenceLogps(canonical((per_token * shifted).sum(1)), tokens, torch.zeros_like(tokens))
    reference = SequenceLogps(canonical(ref), tokens, torch.zeros_like(tokens))
    losses, metrics = pair_losses(policy, reference, cfg)
    return global_normalized_loss(losses, global_pairs=PAIRS, gradient_divisor=1), metrics


CONFIGS = [LossConfig(name, label_smoothing=0.1 if name in ("exo_pair", "robust", "aot", "aot_unpaired") else 0.0)
           for name in TRL_LOSS_TYPES] + [
    LossConfig("sigmoid,aot,bco_pair,ipo,sft", loss_weights=(1.0, 0.5, 0.25, 0.1, 0.3), beta=0.3),
    LossConfig("discopop", beta=0.5, discopop_tau=0.2),
] + [LossConfig("sigmoid,hinge,ipo,exo_pair,robust,discopop,sigmoid_norm", beta=0.2, label_smoothing=0.1,
                f_divergence_type=f, f_alpha_divergence_coef=0.5 if f == "alpha_divergence" else 1.0)
     for f in ("forward_kl", "js_divergence", "alpha_divergence")]  # (TRL reads the coefficient of alpha alone)

MEASURED: dict[str, float] = {}


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.loss_type.replace(",", "+") + f"-{c.f_divergence_type}")
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
    if cfg.normalized_metrics:  # IPO alone: per-token averages, as its loss sees them (tests/test_losses.py)
        return
    for name in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen"):
        assert float(metrics[name].mean()) == pytest.approx(trl_metrics[name][0], rel=1e-5, abs=1e-6), name


@pytest.mark.parametrize("kwargs, flag", [
    ({"loss_type": "dpo"}, "--loss"),
    ({"loss_type": "sigmoid,ipo", "loss_weights": (1.0,)}, "--loss-weights"),
    ({"loss_type": "bco_pair", "f_divergence_type": "forward_kl"}, "--f-divergence-type"),
    ({"f_divergence_type": "chi2"}, "--f-divergence-type"),
    ({"loss_type": "exo_pair"}, "--label-smoothing"),
    ({"discopop_tau": 0.0}, "--discopop-tau"),
    ({"beta": 0.0}, "--beta"),
])
def test_bad_combinations_are_refused_in_one_line(kwargs, flag):
    with pytest.raises(InputError) as info:
        LossConfig(**kwargs).validate()
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
    # a parameter no loss of the run reads is refused (the audit found them
    # accepted and ignored: the same loss, to the last bit, with and without them)
    assert loss_of(loss="sigmoid", f_divergence_type="alpha_divergence", f_alpha_divergence_coef=0.5) != \
        pytest.approx(float(loss_of(loss="sigmoid", f_divergence_type="alpha_divergence")))
    for flags, flag, why in (({"f_alpha_divergence_coef": 0.5, "f_divergence_type": "js_divergence"},
                              "--f-alpha-divergence-coef", "with --f-divergence-type js_divergence"),
                             ({"f_alpha_divergence_coef": 0.5}, "--f-alpha-divergence-coef", "reverse_kl"),
                             ({"loss": "sigmoid,bco_pair", "discopop_tau": 0.2}, "--discopop-tau",
                              "with --loss sigmoid,bco_pair (only --loss discopop uses it)"),
                             ({"discopop_tau": 0.2}, "--discopop-tau", "--loss sigmoid"),
                             ({"loss": "ipo", "simpo_gamma": 1.0}, "--simpo-gamma", "only --loss simpo uses it")):
        with pytest.raises(InputError) as info:
            TrainConfig(**flags).loss_config()
        assert str(info.value).startswith(flag) and why in str(info.value) and "\n" not in str(info.value)


# ----------------------------------------------------------------------------- LD-DPO and WPO on a model
def trl_padded(pairs) -> dict:
    """TRL's batch of ``pairs``: [chosen rows; rejected rows], prompt + completion right-padded."""
    rows = [(p["prompt_ids"], p[key]) for key in ("chosen_ids", "rejected_ids") for p in pairs]
    width = max(len(prompt) + len(completion) for prompt, completion in rows)
    batch = {name: torch.zeros(len(rows), width, dtype=torch.long)
             for name in ("input_ids", "attention_mask", "completion_mask")}
    for i, (prompt, completion) in enumerate(rows):
        ids = prompt + completion
        batch["input_ids"][i, :len(ids)] = torch.tensor(ids)
        batch["attention_mask"][i, :len(ids)] = 1
        batch["completion_mask"][i, len(prompt):len(ids)] = 1
    return batch


def full_logits_head(model):
    """TRL's fused lm head (``log_probs``, ``log_sum_sq_probs``) computed the plain way, from the model's full
    logits on the padded batch: an independent route to the per-token values."""

    def call(input_ids, attention_mask, labels, use_cache, fused_lm_head):
        model.config._attn_implementation = "sdpa"
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=use_cache).logits[:, :-1]
        logp = torch.log_softmax(logits.float(), -1)
        targets = labels[:, 1:]
        log_probs = logp.gather(-1, targets.clamp_min(0)[..., None]).squeeze(-1) * (targets != -100)
        zeros = torch.zeros_like(log_probs)
        return SimpleNamespace(log_probs=log_probs, entropy=-(logp.exp() * logp).sum(-1), mean_logits=zeros,
                               is_top1=logits.argmax(-1) == targets, log_sum_sq_probs=torch.logsumexp(2 * logp, -1))

    return call


def trl_model_loss(cfg: LossConfig, policy, reference, pairs, metrics=None):
    """TRL 1.16's ``_compute_loss`` with its reference run live (``compute_ref_log_probs``' LD branch too); TRL's
    logged metrics land in ``metrics`` (``metrics["train"][name]``) when given."""
    accelerator = SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda x: x, gather=lambda x: x)
    stand_in = torch.nn.Module()  # what TRL asks of its model here: training, no adapters, no checkpointing
    stand_in.is_gradient_checkpointing = False
    trainer = SimpleNamespace(
        model=stand_in, ref_model=full_logits_head(reference),
        accelerator=accelerator, aux_loss_enabled=False, ld_alpha=cfg.ld_alpha, precompute_ref_logps=False,
        f_divergence_type=cfg.f_divergence_type, f_alpha_divergence_coef=cfg.f_alpha_divergence_coef,
        loss_types=list(cfg.names), loss_weights=list(cfg.weights), beta=cfg.beta,
        label_smoothing=cfg.label_smoothing, use_weighting=cfg.use_weighting,
        args=SimpleNamespace(discopop_tau=cfg.discopop_tau, gradient_checkpointing_kwargs=None),
        _metrics=defaultdict(lambda: defaultdict(list)) if metrics is None else metrics, _tp_size=1,
        _total_train_tokens=0)
    return DPOTrainer._compute_loss(trainer, full_logits_head(policy), trl_padded(pairs), False)


def ours_on_rows(cfg: LossConfig, policy, reference, batch):
    """This trainer's loss of one packed or grouped row: the forwards with their token weighting, then the loss."""
    for model in (policy, reference):
        model.config._attn_implementation = attn_implementation("sdpa_varlen")
    with torch.no_grad():
        ref = forward_logps(reference, batch, "sdpa_varlen", 4, "lean", cfg.token_weighting(policy=False))
    pol = forward_logps(policy, batch, "sdpa_varlen", 4, "lean", cfg.token_weighting(policy=True))
    losses, _ = pair_losses(pol, ref, cfg)
    return global_normalized_loss(losses, global_pairs=batch.num_pairs, gradient_divisor=1)


WEIGHTED = [
    LossConfig("sigmoid", ld_alpha=0.5),
    LossConfig("sigmoid,ipo,sigmoid_norm,sft,bco_pair", beta=0.3, loss_weights=(1.0, 0.2, 0.5, 0.3, 0.4), ld_alpha=0.5),
    LossConfig("sigmoid", use_weighting=True),
    LossConfig("sigmoid,apo_zero,nca_pair,apo_down,discopop", beta=0.5, loss_weights=(1.0, 0.5, 0.25, 0.5, 0.3),
               use_weighting=True),
    LossConfig("ipo,robust", beta=0.2, label_smoothing=0.1, ld_alpha=0.0, use_weighting=True),
]


@pytest.mark.parametrize("cfg", WEIGHTED, ids=lambda c: f"{c.loss_type}-ld{c.ld_alpha}-wpo{int(c.use_weighting)}")
def test_ld_alpha_and_use_weighting_match_trl_on_a_model(cfg):
    """Same tiny model, same pairs (completions of different lengths, the longer one chosen in some and rejected
    in others, one empty), a reference model of other weights: TRL's padded batch through full logits against
    this trainer's packed and grouped rows through the lean chunks.  Step-1 loss and every parameter's gradient
    agree to 2e-6 relative (fp32)."""
    cfg.validate()
    pairs = grouped_pairs()
    index = list(range(len(pairs)))
    policy = build_model(None, "tiny", VOCAB, torch.float32, "sdpa_varlen", seed=0)
    reference = build_model(None, "tiny", VOCAB, torch.float32, "sdpa_varlen", seed=1)
    expected = trl_model_loss(cfg, policy, reference, pairs)
    expected.backward()
    want = torch.cat([p.grad.reshape(-1) for p in policy.parameters()])
    policy.zero_grad(set_to_none=True)
    for collate in (collate_packed, collate_grouped):
        loss = ours_on_rows(cfg, policy, reference, collate(pairs, index, 0))
        loss.backward()
        got = torch.cat([p.grad.reshape(-1) for p in policy.parameters()])
        policy.zero_grad(set_to_none=True)
        assert float(loss.detach()) == pytest.approx(float(expected.detach()), rel=2e-6), collate.__name__
        assert float((got - want).norm()) <= 2e-6 * float(want.norm()), (collate.__name__, float((got - want).norm()))
        MEASURED[f"{cfg.loss_type}-ld{cfg.ld_alpha}-wpo{cfg.use_weighting}-{collate.__name__}"] = max(
            abs(float(loss) / float(expected) - 1), float((got - want).norm() / want.norm()))
    plain = LossConfig(cfg.loss_type, beta=cfg.beta, label_smoothing=cfg.label_smoothing, loss_weights=cfg.loss_weights)
    assert float(trl_model_loss(plain, policy, reference, pairs)) != pytest.approx(float(expected), rel=1e-4)


def greedy(model, prompt: list[int], length: int) -> list[int]:
    """``length`` tokens of ``model``'s greedy continuation of ``prompt``: completions whose every target is the
    argmax."""
    model.config._attn_implementation = "sdpa"
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(length):
            ids.append(int(model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_entropy_and_token_accuracy_match_trl():
    """TRL's ``entropy`` (mean over every completion token) and ``mean_token_accuracy`` (share of chosen completion
    tokens whose target is the argmax), from the policy's lean chunks of packed and grouped rows and its plain
    logits, against TRL's _compute_loss on the padded batch with the full logits; with LD-DPO on, which must not
    touch them.  The reference's forward does not compute them."""
    cfg = LossConfig("sigmoid", ld_alpha=0.5)
    policy = build_model(None, "tiny", VOCAB, torch.float32, "sdpa_varlen", seed=0)
    reference = build_model(None, "tiny", VOCAB, torch.float32, "sdpa_varlen", seed=1)
    pairs = grouped_pairs()
    pairs.append({**pairs[2], "chosen_ids": greedy(policy, pairs[2]["prompt_ids"], 6)})  # argmax hits: accuracy > 0
    logged = defaultdict(lambda: defaultdict(list))
    with torch.no_grad():
        trl_model_loss(cfg, policy, reference, pairs, logged)
    want = {name: logged["train"][name][0] for name in ("entropy", "mean_token_accuracy")}
    assert 0 < want["mean_token_accuracy"] < 1 and want["entropy"] > 0, want
    print("TRL metrics", want)
    for collate in (collate_packed, collate_grouped):
        batch = collate(pairs, list(range(len(pairs))), 0)
        policy.config._attn_implementation = attn_implementation("sdpa_varlen")
        with torch.no_grad():
            for impl in ("lean", "plain"):
                pol = forward_logps(policy, batch, "sdpa_varlen", 4, impl, cfg.token_weighting(policy=True))
                _, per_pair = pair_losses(pol, pol, cfg)
                got = metric_means(metric_sums(per_pair, pol))
                for name, value in want.items():
                    assert got[name] == pytest.approx(value, rel=1e-6), (collate.__name__, impl, name)
            ref = forward_logps(reference, batch, "sdpa_varlen", 4, "lean", cfg.token_weighting(policy=False))
            assert ref.entropy_sum is None and ref.top1_sum is None


def test_hinge_with_use_weighting_matches_trl_forward():
    """TRL 1.16's backward fails on hinge with WPO (``per_sequence_loss *= weights`` writes into relu's saved output);
    its forward is well defined, and this trainer's loss equals it (and trains)."""
    cfg = LossConfig("hinge,sigmoid", beta=0.5, loss_weights=(1.0, 0.5), use_weighting=True)
    pairs = grouped_pairs()
    policy = build_model(None, "tiny", VOCAB, torch.float32, "sdpa_varlen", seed=0)
    reference = build_model(None, "tiny", VOCAB, torch.float32, "sdpa_varlen", seed=1)
    with torch.no_grad():
        expected = trl_model_loss(cfg, policy, reference, pairs)
    loss = ours_on_rows(cfg, policy, reference, collate_grouped(pairs, list(range(len(pairs))), 0))
    assert float(loss) == pytest.approx(float(expected), rel=2e-6)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in policy.parameters())


@pytest.mark.parametrize("kwargs, flag", [
    ({"loss_type": "aot", "use_weighting": True}, "--use-weighting with --loss aot"),
    ({"loss_type": "sigmoid,aot_unpaired", "use_weighting": True}, "--use-weighting with --loss aot_unpaired"),
    ({"loss_type": "sft", "use_weighting": True}, "--use-weighting with --loss sft"),
    ({"loss_type": "sigmoid", "ld_alpha": 1.01}, "--ld-alpha must be in [0, 1]"),
    ({"loss_type": "simpo", "ld_alpha": 0.5}, "--loss simpo: --ld-alpha and --use-weighting"),
])
def test_token_weighting_refused_where_trl_refuses_it(kwargs, flag):
    """The loss settings themselves refuse what TRL 1.16 refuses (or fails on): WPO with the batch's sort or token
    mean; the batch-coupled losses are refused in training for now anyway, so this is their only check."""
    with pytest.raises(InputError) as info:
        LossConfig(**kwargs).validate()
    assert str(info.value).startswith(flag) and "\n" not in str(info.value)
