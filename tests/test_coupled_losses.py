"""The batch-coupled losses (aot, aot_unpaired, sft) as per-pair terms of the whole step (model/coupled_losses.py,
run/step_statistics.py): a step cut into rows on several ranks gives TRL 1.16's loss and gradient of the whole step
in one batch (``DPOTrainer._compute_loss`` itself, with a stable sort so ties have one answer)."""

from __future__ import annotations

import functools

import pytest
import torch
from launching import SMALL_RUN, ranks_module, read_metrics, run
from test_exact_sums import fp64_sums, save_long_model
from test_loss_family import PAIRS, canonical, example, trl_loss

from ds_packdpo.config import parse_train_args
from ds_packdpo.data.run_plan import run_plan
from ds_packdpo.model.collate import collate_grouped, collate_packed, collate_padded, collate_shared
from ds_packdpo.model.coupled_losses import StepStatistic
from ds_packdpo.model.guard import synthetic_pairs
from ds_packdpo.model.logps import SequenceLogps
from ds_packdpo.model.losses import LossConfig, global_normalized_loss, pair_losses
from ds_packdpo.run.assemble import prepare
from ds_packdpo.run.step_statistics import chosen_token_counts, local_values

# Two data-parallel ranks of an S = 2 group each (the second of each group adds zeros), rows of 1-2 pairs, in an
# order unlike the step's: (rank, rows of slots).
LAYOUT = [[(4, 1), (5,)], [(0, 3), (2,)]]


def with_ties(completion, shifted, per_token, ref):
    """Pair 3's policy a copy of pair 0's (equal policy margins, other reference margins) and pair 5's rejected a
    copy of pair 2's with its reference (equal rejected log-ratios)."""
    completion, shifted, ref = completion.clone(), shifted.clone(), ref.clone()
    per_token = per_token.detach().clone()
    for dst, src in ((3, 0), (PAIRS + 3, PAIRS), (PAIRS + 5, PAIRS + 2)):
        completion[dst], shifted[dst], per_token[dst] = completion[src], shifted[src], per_token[src]
    ref[PAIRS + 5] = ref[PAIRS + 2]
    return completion, shifted, per_token.requires_grad_(), ref


def split_step_loss(cfg: LossConfig, shifted, per_token, ref) -> torch.Tensor:
    """The step's loss summed over the rows of LAYOUT, each row's terms matched against the gathered statistic."""
    tokens = canonical(shifted.sum(1))
    policy = SequenceLogps(canonical((per_token.double() * shifted).sum(1)), tokens, torch.zeros_like(tokens))
    reference = SequenceLogps(canonical(ref.double()), tokens, torch.zeros_like(tokens))

    def row_of(values: SequenceLogps, slots) -> SequenceLogps:
        index = torch.tensor([[2 * s, 2 * s + 1] for s in slots]).reshape(-1)
        return SequenceLogps(*(v.index_select(0, index) for v in (values.logps, values.tokens, values.logits_sum)))

    shares = []
    for rank_rows in LAYOUT:
        rows = [(torch.tensor(slots), float(row_of(policy, slots).chosen_tokens.sum()), row_of(policy, slots),
                 row_of(reference, slots)) for slots in rank_rows]
        shares += [local_values(PAIRS, rows, True, "cpu"), local_values(PAIRS, [], True, "cpu")]  # sp-ranks 0, 1
    gathered = torch.stack(shares).sum(0)  # the all-reduce
    statistic = StepStatistic.from_values(gathered[:-1].reshape(4, PAIRS), PAIRS, float(gathered[-1]))
    total = 0.0
    for rank_rows in LAYOUT:
        for slots in rank_rows:
            losses, _ = pair_losses(row_of(policy, slots), row_of(reference, slots), cfg,
                                    statistic.partners(torch.tensor(slots)))
            total = total + global_normalized_loss(losses, PAIRS, gradient_divisor=1)
    return total


COUPLED_CONFIGS = [
    LossConfig("aot", label_smoothing=0.1),
    LossConfig("aot_unpaired", label_smoothing=0.1, beta=0.5),
    LossConfig("sft"),
    LossConfig("sigmoid,aot", loss_weights=(1.0, 0.5), beta=0.3),
    LossConfig("sigmoid,aot,aot_unpaired,sft,bco_pair", loss_weights=(1.0, 0.5, 0.7, 0.3, 0.25), beta=0.3,
               label_smoothing=0.05),
]


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("cfg", COUPLED_CONFIGS, ids=lambda c: c.loss_type.replace(",", "+"))
def test_step_split_over_rows_and_ranks_equals_trl_on_the_whole_step(cfg, ties, monkeypatch):
    cfg.validate()
    completion, shifted, per_token, ref = example(seed=3)
    if ties:
        completion, shifted, per_token, ref = with_ties(completion, shifted, per_token, ref)
    # TRL's own code on the whole step, its torch.sort made stable: tied values keep batch order, as slots do here
    monkeypatch.setattr(torch, "sort", functools.partial(torch.sort, stable=True))
    expected, _ = trl_loss(cfg, completion, per_token.double(), ref.double())
    monkeypatch.undo()
    (expected_grad,) = torch.autograd.grad(expected, per_token)
    loss = split_step_loss(cfg, shifted, per_token, ref)
    (grad,) = torch.autograd.grad(loss, per_token)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-12)
    assert grad.abs().max() > 1e-3  # the loss really depends on every log-prob it names


def test_a_micro_batch_alone_is_not_the_step():
    """What the step statistic buys: TRL's per-batch aot/sft on one row of the step differ from the step's terms."""
    completion, shifted, per_token, ref = example(seed=3)
    tokens = canonical(shifted.sum(1))
    policy = SequenceLogps(canonical((per_token * shifted).sum(1)).detach(), tokens, torch.zeros_like(tokens))
    reference = SequenceLogps(canonical(ref), tokens, torch.zeros_like(tokens))
    values = torch.stack([policy.chosen_logps, policy.rejected_logps, reference.chosen_logps, reference.rejected_logps])
    statistic = StepStatistic.from_values(values, PAIRS, float(tokens[0::2].sum()))
    first = SequenceLogps(policy.logps[:4], tokens[:4], tokens[:4] * 0)
    first_ref = SequenceLogps(reference.logps[:4], tokens[:4], tokens[:4] * 0)
    for name in ("aot", "aot_unpaired", "sft"):
        cfg = LossConfig(name)
        alone, _ = pair_losses(first, first_ref, cfg)
        in_step, _ = pair_losses(first, first_ref, cfg, statistic.partners(torch.tensor([0, 1])))
        assert not torch.allclose(alone, in_step, rtol=1e-6), name


@pytest.mark.parametrize("collate", [collate_packed, collate_shared, collate_grouped, collate_padded])
def test_chosen_token_counts_from_the_collated_row(collate):
    """The sft denominator needs no forward: every chosen completion token is scored once (prompts are not empty)."""
    pairs = synthetic_pairs(5, 50, seed=2)
    pairs[3] = {**pairs[3], "prompt_ids": pairs[1]["prompt_ids"], "chosen_ids": pairs[1]["chosen_ids"]}  # a group
    batch = collate(pairs, [9, 4, 7, 1, 0], 0)
    expected = torch.tensor([len(p["chosen_ids"]) for p in pairs], dtype=torch.float64)
    assert torch.equal(chosen_token_counts(batch), expected)


def trl_layout(sums: list[tuple[float, float, int, int]]):
    """TRL's padded layout [chosen; rejected] holding each sequence's log-prob sum in its first completion position
    and zeros over the rest of its completion tokens: TRL's sums and its sft token mean see the real counts."""
    length = max(max(n_c, n_r) for *_, n_c, n_r in sums) + 1
    completion = torch.zeros(2 * PAIRS, length, dtype=torch.long)
    per_token = torch.zeros(2 * PAIRS, length - 1, dtype=torch.float64)
    for p, (chosen, rejected, n_chosen, n_rejected) in enumerate(sums):
        for row, value, count in ((p, chosen, n_chosen), (PAIRS + p, rejected, n_rejected)):
            completion[row, 1:1 + count] = 1
            per_token[row, 0] = value
    return completion, per_token


@pytest.mark.multirank
def test_step_one_of_a_run_equals_trl_on_its_pairs(tmp_path):
    """A real 1-rank run (one row: TRL's batch is the step) with a reference model other than the policy: its step-1
    loss of aot + aot_unpaired + sft equals TRL 1.16's ``_compute_loss`` on the step's pairs, whose log-prob sums an
    fp64 plain-HF oracle computes one sequence at a time."""
    policy, reference = save_long_model(tmp_path / "policy", 0), save_long_model(tmp_path / "reference", 1)
    cfg = LossConfig("aot,aot_unpaired,sft", loss_weights=(1.0, 0.5, 0.3), label_smoothing=0.1)
    flags = ["--model", str(policy), "--ref-model", str(reference), "--cache-dir", str(tmp_path / "cache"),
             *SMALL_RUN, "--global-batch-pairs", str(PAIRS), "--max-steps", "1", "--max-tokens-per-row", "4096",
             "--no-prefix-sharing", "--loss", cfg.loss_type, "--loss-weights", "1,0.5,0.3",
             "--label-smoothing", "0.1"]
    run(ranks_module(1, "ds_packdpo.train", "--output-dir", str(tmp_path / "run"), *flags))
    (record,) = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert record["rows_per_rank"] == 1 and record["pairs"] == PAIRS
    setup = prepare(parse_train_args(flags), "train", world_size=1)
    step = next(run_plan(setup.prepared, setup.spec.plan.config, 1))
    ids = [int(setup.prepared.dataset[p]["pair_id"]) for p in step.pairs]
    policy_sums, reference_sums = fp64_sums(flags, policy), fp64_sums(flags, reference)
    completion, per_token = trl_layout([policy_sums[i] for i in ids])
    ref = torch.tensor([reference_sums[i][0] for i in ids] + [reference_sums[i][1] for i in ids], dtype=torch.float64)
    expected, trl_metrics = trl_loss(cfg, completion, per_token, ref)
    print("step 1 vs TRL 1.16 on its pairs:", record["loss"], float(expected))
    assert record["loss"] == pytest.approx(float(expected), rel=1e-5)
    assert record["logps/chosen"] == pytest.approx(trl_metrics["logps/chosen"][0], rel=1e-5)
    assert record["rewards/margins"] != pytest.approx(0.0, abs=1e-3)  # the reference really differs from the policy
