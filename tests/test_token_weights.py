"""LD-DPO's weighted sums and WPO's statistic (model/token_weights.py) out of every kernel and row layout, against
each sequence run alone through a full fp64 log_softmax with TRL 1.16's masks: values, and gradients for LD."""

from __future__ import annotations

import pytest
import torch

from ds_packdpo.config import parse_train_args
from ds_packdpo.data.run_plan import run_plan
from ds_packdpo.model import fused_logps
from ds_packdpo.model.attention import attn_implementation
from ds_packdpo.model.build import build_model
from ds_packdpo.model.collate import collate_grouped, collate_packed, collate_padded, collate_shared
from ds_packdpo.model.logps import TokenWeighting, forward_logps
from ds_packdpo.model.losses import pair_losses
from ds_packdpo.run.assemble import Run, prepare

from zero3_lean_check import full_logits_cross_entropy

VOCAB, ALPHA = 256, 0.3


def grouped_pairs() -> list[dict]:
    """Pairs of different completion lengths, the longer one chosen in some and rejected in others, one empty
    completion; two prompts repeat, so a grouped row holds a response in two pairs with different partners (a
    different shared length L in each)."""
    g = torch.Generator().manual_seed(3)

    def ids(n: int) -> list[int]:
        return torch.randint(0, VOCAB, (n,), generator=g).tolist()

    a, b = ids(6), ids(4)
    long, short, mid = ids(9), ids(3), ids(6)
    return [{"prompt_ids": a, "chosen_ids": long, "rejected_ids": short},
            {"prompt_ids": a, "chosen_ids": mid, "rejected_ids": long},  # `long` again, L = 6 instead of 3
            {"prompt_ids": ids(5), "chosen_ids": ids(2), "rejected_ids": ids(7)},
            {"prompt_ids": b, "chosen_ids": ids(5), "rejected_ids": []},  # L = 0: every token is tail
            {"prompt_ids": b, "chosen_ids": short, "rejected_ids": ids(8)}]


def alone(model, pairs):
    """[2P] per sequence, each run alone (eager, no packing): TRL's LD sums (shared: 1 <= place <= L), the plain
    sums and WPO's sum of log p - log sum p^2 from a fp64 log_softmax of the fp32 logits."""
    weighted, plain, wpo = [], [], []
    for pair in pairs:
        shared = min(len(pair["chosen_ids"]), len(pair["rejected_ids"]))
        for key in ("chosen_ids", "rejected_ids"):
            ids = torch.tensor(pair["prompt_ids"] + pair[key])
            logits = model(input_ids=ids[None], use_cache=False).logits[0, :-1]
            logp = torch.log_softmax(logits.double(), -1)
            start = len(pair["prompt_ids"]) - 1
            tokens = logp[torch.arange(start, ids.numel() - 1), ids[start + 1:]]
            log_sum_sq = torch.logsumexp(2 * logp[start:], -1)
            weighted.append(tokens[:shared].sum() + ALPHA * tokens[shared:].sum())
            plain.append(tokens.sum())
            wpo.append((tokens - log_sum_sq).sum().detach())
    return torch.stack(weighted), torch.stack(plain), torch.stack(wpo)


def loss_of(weighted, plain):
    """Nonlinear in every sum, so a wrong token weight or slot shows in the gradient."""
    return (torch.nn.functional.logsigmoid(0.3 * (weighted[0::2] - weighted[1::2])).sum()
            + 0.01 * (plain * torch.arange(1, plain.numel() + 1)).sum())


def gradients(model) -> torch.Tensor:
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return grads


LAYOUTS = [(collate_packed, "sdpa_varlen"), (collate_shared, "sdpa_varlen"), (collate_grouped, "sdpa_varlen"),
           (collate_padded, "sdpa")]


@pytest.mark.parametrize("impl", ["lean", "plain", "fused"])
def test_every_layout_and_kernel_gives_trl_ld_sums_and_wpo_statistic(impl, monkeypatch):
    """fp32 model: the LD-weighted and plain sums within 2e-6 relative (a few fp32 roundings of each token's
    log-prob), WPO's statistic within 1e-5 nats a sequence, gradients within 1e-5 relative; the fused kernel
    through its CPU stand-in (full logits and F.cross_entropy, the kernel's contract)."""
    monkeypatch.setattr(fused_logps, "linear_cross_entropy", full_logits_cross_entropy)
    pairs = grouped_pairs()
    index = list(range(len(pairs)))
    model = build_model(None, "tiny", VOCAB, torch.float32, "sdpa_varlen", seed=0)  # registers sdpa_varlen
    model.config._attn_implementation = "eager"
    want_weighted, want_plain, want_wpo = alone(model, pairs)
    loss_of(want_weighted, want_plain).backward()
    want_grads = gradients(model)
    assert (want_weighted - want_plain).abs().max() > 1.0  # the weighting changes the sums
    for collate, attn in LAYOUTS:
        batch = collate(pairs, index, 0)
        if collate is collate_grouped:
            assert batch.pair_sequences is not None  # a response really is in two pairs
        model.config._attn_implementation = attn_implementation(attn)
        got = forward_logps(model, batch, attn, chunk_tokens=5, impl=impl, weighting=TokenWeighting(ALPHA, True))
        loss_of(got.logps, got.plain_logps).backward()
        grads = gradients(model)
        name = f"{collate.__name__}/{impl}"
        assert {got.logps.dtype, got.plain_logps.dtype, got.wpo_sum.dtype} == {torch.float64}, name
        assert not got.wpo_sum.requires_grad, name
        for value, want in ((got.logps, want_weighted), (got.plain_logps, want_plain)):
            assert ((value - want).abs() <= 2e-6 * want.abs().clamp_min(1)).all(), (name, value - want)
        assert (got.wpo_sum - want_wpo).abs().max() <= 1e-5, (name, got.wpo_sum - want_wpo)
        assert (grads - want_grads).norm() <= 1e-5 * want_grads.norm(), name


def test_without_weighting_the_forward_computes_neither():
    """Off by default: no second sum, no WPO reduction, the plain sums as before."""
    pairs = grouped_pairs()
    model = build_model(None, "tiny", VOCAB, torch.float32, "sdpa_varlen", seed=0)
    batch = collate_packed(pairs, list(range(len(pairs))), 0)
    plain = forward_logps(model, batch, "sdpa_varlen")
    assert plain.plain_logps is None and plain.wpo_sum is None
    assert torch.equal(plain.unweighted_logps, plain.logps)
    full = forward_logps(model, batch, "sdpa_varlen", weighting=TokenWeighting(1.0, False))
    torch.testing.assert_close(full.logps, plain.logps, rtol=0, atol=1e-12)  # alpha 1: every token weighs 1


def test_the_flags_reach_the_run_forwards_and_the_loss(tmp_path):
    """--ld-alpha weighs the policy's and the reference's sums alike (one model as both: equal), --use-weighting
    computes WPO's statistic in the policy's forward only and changes the loss; neither flag: neither computed."""
    flags = ["--output-dir", str(tmp_path / "run"), "--cache-dir", str(tmp_path / "cache"), "--synthetic-pairs", "16",
             "--max-length", "64"]
    results = {}
    for name, extra in (("plain", []), ("ld", ["--ld-alpha", "0.25"]), ("wpo", ["--use-weighting"])):
        setup = prepare(parse_train_args([*flags, *extra]), "train", world_size=1)
        model = build_model(None, "tiny", setup.vocab_size, torch.float32, setup.spec.attention.model_attn, seed=0)
        run = Run(setup, policy=model, reference=model, sequence_parallel=None)
        plan = next(iter(run_plan(setup.prepared, setup.spec.plan.config, epochs=1)))
        batch = run.row_batch(plan.ranks[0][0], plan)
        policy, reference = run.forward_logps(model, batch), run.reference_logps(batch)
        results[name] = policy, reference, pair_losses(policy, reference, setup.spec.loss)[0]
    plain, ld, wpo = results["plain"], results["ld"], results["wpo"]
    assert plain[0].plain_logps is None and plain[0].wpo_sum is None
    assert ld[0].plain_logps is not None and (ld[0].logps - ld[0].plain_logps).abs().max() > 0.1
    torch.testing.assert_close(ld[0].plain_logps, plain[0].logps.detach(), rtol=0, atol=1e-9)
    torch.testing.assert_close(ld[1].logps, ld[0].logps.detach(), rtol=0, atol=1e-9)  # the reference weighed alike
    assert wpo[0].wpo_sum is not None and wpo[1].wpo_sum is None
    assert (wpo[2] - plain[2]).abs().max() > 1e-3  # log 2 times w(y_w) w(y_l) at policy = reference
