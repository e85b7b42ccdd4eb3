"""The step planner: invariants as hypothesis properties, the error messages, and utilization on real data."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ds_packdpo.errors import InputError
from ds_packdpo.data.plan import (
    PlanConfig,
    RowLayout,
    iter_plan,
    plan_step,
    step_compositions,
    steps_per_epoch,
    validate_lengths,
)
from ds_packdpo.data.plan_report import pack_stats, write_plan_jsonl
from ds_packdpo.data.row_balance import polish, round_karmarkar_karp

DEMO = Path(__file__).resolve().parents[2] / "shared/data/dpo_en_demo.json"
PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def planning_problems(draw):
    """Random lengths and a packed config whose budget fits every pair."""
    n = draw(st.integers(1, 40))
    chosen = np.array(draw(st.lists(st.integers(1, 120), min_size=n, max_size=n)), dtype=np.int64)
    rejected = np.array(draw(st.lists(st.integers(1, 120), min_size=n, max_size=n)), dtype=np.int64)
    by_tokens = draw(st.booleans())
    cfg = PlanConfig(
        max_tokens_per_row=int((chosen + rejected).max()) + draw(st.integers(0, 250)),
        dp_size=draw(st.integers(1, 6)),
        seed=draw(st.integers(0, 3)),
        global_batch_pairs=None if by_tokens else draw(st.integers(1, 16)),
        tokens_per_step=draw(st.integers(1, 2000)) if by_tokens else None,
        drop_last=draw(st.booleans()),
        attention_weight=draw(st.sampled_from([0.0, 0.01])),
        micro_batch_pairs=draw(st.integers(1, 4)),
    )
    epochs = draw(st.integers(1, 2))
    try:
        validate_lengths(chosen, rejected, cfg)
    except InputError:  # --drop-last with a batch larger than the data: covered by its own test
        cfg = replace(cfg, drop_last=False)
    return chosen, rejected, cfg, epochs


def plan(chosen, rejected, cfg, epochs, **resume):
    return list(iter_plan(chosen, rejected, cfg, epochs, **resume))


def compositions(plans):
    return [(p.epoch, p.step, p.pairs) for p in plans]


@PROPERTY
@given(planning_problems())
def test_packed_plan_invariants(problem):
    chosen, rejected, cfg, epochs = problem
    tokens = chosen + rejected
    plans = plan(chosen, rejected, cfg, epochs)
    for epoch in range(epochs):
        steps = [p for p in plans if p.epoch == epoch]
        assert [p.step for p in steps] == list(range(len(steps)))
        seen = np.concatenate([p.pairs for p in steps])
        assert len(set(seen.tolist())) == seen.size  # never twice
        if not cfg.drop_last:
            assert sorted(seen.tolist()) == list(range(chosen.size))  # every pair once
        elif cfg.global_batch_pairs is not None:
            assert seen.size == chosen.size // cfg.global_batch_pairs * cfg.global_batch_pairs
        if cfg.tokens_per_step is not None:
            for p in steps:
                reached = np.cumsum(tokens[list(p.pairs)])
                assert p.num_pairs == 1 or reached[-2] < cfg.tokens_per_step  # closes at the first pair reaching it
                if p is not steps[-1] or cfg.drop_last:
                    assert reached[-1] >= cfg.tokens_per_step
    for p in plans:
        assert len(p.ranks) == cfg.dp_size
        assert len({len(rows) for rows in p.ranks}) == 1 and p.rows_per_rank >= 1
        laid_out = [i for rows in p.ranks for row in rows for i in row.pairs]
        assert sorted(laid_out) == sorted(p.pairs)
        for rows in p.ranks:
            assert [row.tokens for row in rows] == sorted((row.tokens for row in rows), reverse=True)
            for row in rows:
                if row.pairs:
                    assert row.tokens == row.computed_tokens == int(tokens[list(row.pairs)].sum())
                    assert row.tokens <= cfg.max_tokens_per_row
                else:
                    assert (row.tokens, row.computed_tokens) == (0, 1)
            if any(not row.pairs for row in rows):  # a dummy only when nothing is left to split
                assert all(len(row.pairs) == 1 for row in rows if row.pairs)


@PROPERTY
@given(planning_problems(), st.integers(1, 7), st.integers(0, 300))
def test_composition_depends_only_on_seed_epoch_and_batch(problem, other_world, extra_budget):
    chosen, rejected, cfg, epochs = problem
    reference = compositions(plan(chosen, rejected, cfg, epochs))
    for other in (replace(cfg, dp_size=other_world),
                  replace(cfg, max_tokens_per_row=cfg.max_tokens_per_row + extra_budget),
                  replace(cfg, layout=RowLayout.PADDED)):
        assert compositions(plan(chosen, rejected, other, epochs)) == reference
    assert plan(chosen, rejected, cfg, epochs) == plan(chosen, rejected, cfg, epochs)  # deterministic
    by_epoch = [(e, s, tuple(pairs.tolist())) for e in range(epochs)
                for s, pairs in enumerate(step_compositions(chosen, rejected, cfg, e))]
    assert by_epoch == reference
    assert [steps_per_epoch(chosen, rejected, cfg, e) for e in range(epochs)] == \
        [sum(1 for c in reference if c[0] == e) for e in range(epochs)]


@PROPERTY
@given(planning_problems(), st.data())
def test_resume_yields_the_rest_of_the_plan(problem, data):
    chosen, rejected, cfg, epochs = problem
    full = plan(chosen, rejected, cfg, epochs)
    cut = data.draw(st.integers(0, len(full) - 1))
    assert plan(chosen, rejected, cfg, epochs, start_epoch=full[cut].epoch, start_step=full[cut].step) == full[cut:]
    epoch0_steps = sum(1 for p in full if p.epoch == 0)
    assert plan(chosen, rejected, cfg, epochs, start_step=epoch0_steps) == full[epoch0_steps:]  # epoch 0 done
    for p in full[cut:cut + 2]:  # a step is a pure function of its pairs
        assert plan_step(p.pairs, chosen, rejected, cfg, p.epoch, p.step) == p


@PROPERTY
@given(planning_problems())
def test_padded_plan_invariants(problem):
    chosen, rejected, cfg, epochs = problem
    cfg = replace(cfg, layout=RowLayout.PADDED, max_tokens_per_row=1)  # no row budget applies in padded mode
    for p in plan(chosen, rejected, cfg, epochs):
        most_pairs = -(-p.num_pairs // cfg.dp_size)  # ranks 0.. get one more when it does not divide
        width = -(-most_pairs // cfg.micro_batch_pairs)
        for rank, rows in enumerate(p.ranks):
            mine = list(p.pairs[rank::cfg.dp_size])
            real = [row for row in rows if row.pairs]
            assert len(rows) == width
            assert all(row.pairs for row in rows[:len(real)])  # dummy rows only at the end
            assert [row.pairs for row in real] == [tuple(mine[i:i + cfg.micro_batch_pairs])
                                                   for i in range(0, len(mine), cfg.micro_batch_pairs)]
            for row in real:
                idx = list(row.pairs)
                longest = max(chosen[idx].max(), rejected[idx].max())
                assert row.tokens == int((chosen[idx] + rejected[idx]).sum())
                assert row.computed_tokens == 2 * len(idx) * longest


def test_pair_over_budget_names_the_fix():
    chosen, rejected = np.full(30, 100), np.full(30, 120)
    chosen[17], rejected[17] = 2600, 2610
    cfg = PlanConfig(max_tokens_per_row=4096)
    message = ("pair 17 needs 5210 tokens (prompt+chosen 2600 + prompt+rejected 2610) but --max-tokens-per-row "
               "is 4096; raise --max-tokens-per-row to >= 5210 or lower --max-length to <= 2048, or split rows over "
               "ranks with --sequence-parallel-size")
    with pytest.raises(InputError) as caught:
        list(iter_plan(chosen, rejected, cfg, 1))
    assert str(caught.value) == message
    chosen[3] = 4000  # the worst pair is named, the others counted
    with pytest.raises(InputError, match=r"^pair 17 needs 5210 .*; 1 more pair exceeds it; raise .* >= 5210 "):
        validate_lengths(chosen, rejected, cfg)
    with pytest.raises(InputError, match=r"^pair row-17 needs 5210"):
        validate_lengths(chosen, rejected, cfg, pair_ids=[f"row-{i}" for i in range(30)])
    validate_lengths(chosen, rejected, replace(cfg, layout=RowLayout.PADDED))  # padded mode has no row budget


@pytest.mark.parametrize("change, expected", [
    (dict(global_batch_pairs=None), "set exactly one of --global-batch-pairs and --tokens-per-step (got neither)"),
    (dict(tokens_per_step=500), "set exactly one of --global-batch-pairs and --tokens-per-step (got both)"),
    (dict(global_batch_pairs=0), "--global-batch-pairs is 0; it must be an integer >= 1"),
    (dict(global_batch_pairs=None, tokens_per_step=0), "--tokens-per-step is 0; it must be an integer >= 1"),
    (dict(max_tokens_per_row=1), "--max-tokens-per-row is 1; it must be an integer >= 2"),
    (dict(dp_size=0), "data-parallel size (number of rank shares) is 0; it must be an integer >= 1"),
    (dict(seed=-1), "--seed is -1; it must be an integer >= 0"),
    (dict(micro_batch_pairs=0), "--micro-batch-pairs is 0; it must be an integer >= 1"),
    (dict(attention_weight=float("nan")), "--attention-weight is nan; it must be a finite number >= 0"),
    (dict(global_batch_pairs=11, drop_last=True), "--global-batch-pairs 11 is more than the 10 pairs and --drop-last"),
    (dict(global_batch_pairs=None, tokens_per_step=10**6, drop_last=True),
     "--tokens-per-step 1000000 is more than all 200 tokens of the data and --drop-last"),
])
def test_impossible_settings_are_named(change, expected):
    with pytest.raises(InputError) as caught:
        iter_plan(np.full(10, 10), np.full(10, 10), replace(PlanConfig(max_tokens_per_row=64), **change), 1)
    assert str(caught.value).startswith(expected) and "\n" not in str(caught.value)


def test_bad_lengths_and_resume_positions():
    cfg = PlanConfig(max_tokens_per_row=64)
    with pytest.raises(InputError, match="^no preference pairs to plan"):
        validate_lengths([], [], cfg)
    with pytest.raises(InputError, match="^pair 2: prompt\\+rejected has 0 tokens"):
        validate_lengths([5, 5, 5], [5, 5, 0], cfg)
    with pytest.raises(InputError, match="^resume step 2 is past the 1 steps of epoch 0"):
        iter_plan([5, 5, 5], [5, 5, 5], cfg, 1, start_step=2)
    with pytest.raises(ValueError, match="equal size"):
        validate_lengths([5, 5], [5], cfg)


def test_dummy_rows_only_when_a_rank_runs_out_of_pairs():
    # 3 pairs that each fill a row, 2 ranks: one rank runs 2 rows, the other 1 row and 1 dummy.
    (p,) = plan(np.full(3, 50), np.full(3, 50), PlanConfig(max_tokens_per_row=100, dp_size=2), 1)
    assert p.rows_per_rank == 2 and sorted(len(row.pairs) for rows in p.ranks for row in rows) == [0, 1, 1, 1]
    # the last step has 1 pair for 4 ranks: 3 ranks run a dummy row.
    last = plan(np.full(5, 5), np.full(5, 5), PlanConfig(max_tokens_per_row=100, dp_size=4, global_batch_pairs=4), 1)[-1]
    assert last.num_pairs == 1 and last.rows_per_rank == 1
    assert sorted(len(rows[0].pairs) for rows in last.ranks) == [0, 0, 0, 1]
    assert last.rank_computed_tokens.count(1) == 3


def test_a_rank_with_fewer_rows_splits_instead_of_idling():
    # pair tokens 60, 60, 40, 30, 30 on 2 ranks, budget 100: one rank needs 2 rows for its 120 tokens,
    # so the other splits its single full row (60 + 40) rather than running a dummy.
    (p,) = plan(np.array([30, 30, 20, 15, 15]), np.array([30, 30, 20, 15, 15]),
                PlanConfig(max_tokens_per_row=100, dp_size=2), 1)
    assert p.rows_per_rank == 2
    assert all(row.pairs for rows in p.ranks for row in rows)
    assert sorted(p.rank_tokens) == [100, 120]


def test_attention_weight_balances_quadratic_cost():
    # one pair of 2 x 150 tokens and six of 2 x 50, on 2 ranks
    chosen = rejected = np.array([150] + [50] * 6)
    cfg = PlanConfig(max_tokens_per_row=1000, dp_size=2)

    def rank_of_long_pair(p):
        return next(rows for rows in p.ranks if any(0 in row.pairs for row in rows))

    by_tokens = plan(chosen, rejected, cfg, 1)[0]
    assert max(by_tokens.rank_tokens) == 500  # the best split of 300 + 6 x 100 tokens
    assert sum(len(row.pairs) for row in rank_of_long_pair(by_tokens)) > 1
    # squared: 2 x 150^2 = 45000 outweighs all six short pairs (6 x 2 x 50^2 = 30000): the long pair runs alone
    by_attention = plan(chosen, rejected, replace(cfg, attention_weight=1.0), 1)[0]
    assert [row.pairs for row in rank_of_long_pair(by_attention)] == [(0,)]


def test_write_plan_jsonl(tmp_path):
    chosen, rejected = np.arange(1, 8), np.arange(1, 8)
    plans = plan(chosen, rejected, PlanConfig(max_tokens_per_row=16, dp_size=2, global_batch_pairs=4), 1)
    ids = [f"id{i}" for i in range(7)]
    out = tmp_path / "plan" / "plan.jsonl"
    write_plan_jsonl(plans, out, pair_ids=ids)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    expected = [{"epoch": p.epoch, "step": p.step, "rank": r, "row": i, "pairs": [ids[j] for j in row.pairs],
                 "tokens": row.tokens} for p in plans for r, rows in enumerate(p.ranks) for i, row in enumerate(rows)]
    assert lines == expected
    assert sorted(x.name for x in out.parent.iterdir()) == ["plan.jsonl"]  # no temporary file left
    write_plan_jsonl(plans, out)
    assert json.loads(out.read_text().splitlines()[0])["pairs"] == list(plans[0].ranks[0][0].pairs)


def test_pack_stats_accounts_for_every_token():
    rng = np.random.default_rng(1)
    chosen, rejected = rng.integers(1, 300, 50), rng.integers(1, 300, 50)
    cfg = PlanConfig(max_tokens_per_row=1024, dp_size=3, global_batch_pairs=16, micro_batch_pairs=2)
    stats = pack_stats(chosen, rejected, cfg, epochs=2)
    packed, padded = plan(chosen, rejected, cfg, 2), plan(chosen, rejected, replace(cfg, layout=RowLayout.PADDED), 2)
    assert json.loads(json.dumps(stats)) == stats
    assert stats["real_tokens"] == 2 * int((chosen + rejected).sum())
    assert stats["steps"] == len(packed) == 8
    assert stats["rows"] == sum(p.rows_per_rank * 3 for p in packed)
    assert stats["rows_per_rank"] == {"min": min(p.rows_per_rank for p in packed),
                                      "max": max(p.rows_per_rank for p in packed)}
    utilization = np.mean([np.mean(p.rank_tokens) / max(p.rank_tokens) for p in packed])
    assert stats["rank_balance"] == pytest.approx(utilization, rel=1e-12)
    padded_computed = sum(sum(p.rank_computed_tokens) for p in padded)
    assert stats["padded_computed_tokens"] == padded_computed
    assert stats["padded_utilization"] == pytest.approx(stats["real_tokens"] / padded_computed, rel=1e-12)
    assert stats["row_fill"] == pytest.approx(stats["real_tokens"] / (stats["rows"] * 1024), rel=1e-12)


@pytest.fixture(scope="module")
def demo_lengths():
    """Token lengths of the real demo pairs from a byte-level BPE trained here on the file's own text
    (a local estimate: no tokenizer may be downloaded), sequences cut at 2048 tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    rows = json.loads(DEMO.read_text())
    prompts = ["\n".join(turn["value"] for turn in row["conversations"]) for row in rows]
    chosen = [row["chosen"]["value"] for row in rows]
    rejected = [row["rejected"]["value"] for row in rows]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=4096, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(prompts + chosen + rejected, trainer)

    def count(texts):
        return np.array([len(e.ids) for e in tokenizer.encode_batch(texts)], dtype=np.int64)

    prompt = count(prompts)
    return np.minimum(prompt + count(chosen), 2048), np.minimum(prompt + count(rejected), 2048)


def test_utilization_on_real_chat_data(demo_lengths, record_property):
    chosen, rejected = demo_lengths
    cfg = PlanConfig(max_tokens_per_row=4096, dp_size=8, global_batch_pairs=64)
    figures = {}
    for micro_batch_pairs in (1, 4):
        stats = pack_stats(chosen, rejected, replace(cfg, micro_batch_pairs=micro_batch_pairs))
        figures[micro_batch_pairs] = stats["padded_utilization"]
        assert stats["lockstep_utilization"] >= 0.98  # rows aligned across ranks (ZeRO-3 runs slot i together)
        assert stats["rank_balance"] >= 0.99
        assert stats["pairs"] == 300 and stats["steps"] == 5 and stats["real_tokens"] == int((chosen + rejected).sum())
    record_property("lockstep_utilization", stats["lockstep_utilization"])
    record_property("rank_balance", stats["rank_balance"])
    record_property("padded_utilization_mb1", figures[1])
    record_property("padded_utilization_mb4", figures[4])
    assert figures[4] < figures[1] < 1.0  # padding a micro-batch to its longest sequence wastes more as it grows


@PROPERTY
@given(st.lists(st.integers(1, 60), min_size=1, max_size=60), st.integers(1, 12), st.integers(0, 40))
def test_round_karmarkar_karp_and_polish_partition_within_the_budget(tokens, k, slack):
    tokens = np.array(tokens, dtype=np.int64)
    cost = tokens.astype(np.float64)
    order = np.argsort(-cost, kind="stable")
    members = round_karmarkar_karp(order, cost, k)
    assert members.shape[1] == k and sorted(members[members >= 0].tolist()) == list(range(tokens.size))
    assert (members >= 0).any(axis=0).sum() == min(k, tokens.size)  # no empty row while pairs are left
    sums = np.array([tokens[m[m >= 0]].sum() for m in members.T])
    budget = int(sums.max()) + slack
    polished = polish(members, cost, tokens, budget)
    assert sorted(polished[polished >= 0].tolist()) == list(range(tokens.size))
    after = np.array([tokens[m[m >= 0]].sum() for m in polished.T])
    assert after.max() <= sums.max() and after.min() >= sums.min()  # exchanges only narrow the spread
    assert (polished >= 0).any(axis=0).sum() == min(k, tokens.size)


def test_fewer_pairs_per_step_than_ranks_warns_by_how_much(capsys):
    from ds_packdpo.data.plan import warn_if_ranks_idle

    assert warn_if_ranks_idle(100, PlanConfig(max_tokens_per_row=64, dp_size=8, global_batch_pairs=2)) == 0.25
    assert warn_if_ranks_idle(3, PlanConfig(max_tokens_per_row=64, dp_size=4, global_batch_pairs=64)) == 0.75
    assert warn_if_ranks_idle(100, PlanConfig(max_tokens_per_row=64, dp_size=8, global_batch_pairs=8)) is None
    assert warn_if_ranks_idle(100, PlanConfig(max_tokens_per_row=64, dp_size=8, global_batch_pairs=None,
                                              tokens_per_step=64)) is None
    said = capsys.readouterr().err.splitlines()
    assert len(said) == 2
    assert said[0] == ("warning: 2 pairs per step for 8 data-parallel ranks: 6 ranks get no pair and run a dummy row, "
                       "so at most 25% of the ranks' compute is real work (raise --global-batch-pairs to at least 8, "
                       "or use fewer ranks)")
    assert said[1].startswith("warning: 3 pairs per step for 4")  # the whole data set is one short step


def test_pack_stats_warns_when_ranks_idle(tmp_path, capsys):
    from ds_packdpo import cli

    assert cli.main(["pack-stats", "--world-size", "4", "--global-batch-pairs", "2", "--synthetic-pairs", "16",
                     "--max-length", "128", "--cache-dir", str(tmp_path / "cache")]) == 0
    captured = capsys.readouterr()
    assert "warning: 2 pairs per step for 4 data-parallel ranks: 2 ranks get no pair" in captured.err
    stats = json.loads(captured.out)
    assert stats["dp_size"] == 4 and stats["dummy_rows"] > 0  # the idle ranks' dummy rows


@PROPERTY
@given(planning_problems(), st.data())
def test_prefix_sharing_counts_each_prompt_once_and_keeps_the_steps(problem, data):
    """Rows hold P + C + R tokens per pair; the steps' pairs, and so the trajectory, are those without sharing."""
    chosen, rejected, cfg, epochs = problem
    prompt = np.array([data.draw(st.integers(1, int(min(c, r)))) for c, r in zip(chosen, rejected)], dtype=np.int64)
    shared_cfg = replace(cfg, layout=RowLayout.PREFIX_SHARED)
    shared = plan(chosen, rejected, shared_cfg, epochs, prompt_lengths=prompt)
    assert compositions(shared) == compositions(plan(chosen, rejected, cfg, epochs))
    tokens = chosen + rejected - prompt
    for p in shared:
        for rows in p.ranks:
            for row in rows:
                if row.pairs:
                    assert row.tokens == row.computed_tokens == int(tokens[list(row.pairs)].sum())
                    assert row.tokens <= cfg.max_tokens_per_row
    p = shared[0]
    assert plan_step(p.pairs, chosen, rejected, shared_cfg, p.epoch, p.step, prompt_lengths=prompt) == p
    # a padded plan ignores the setting (padded rows hold whole sequences)
    padded = replace(shared_cfg, layout=RowLayout.PADDED)
    assert plan(chosen, rejected, padded, epochs) == plan(chosen, rejected, replace(cfg, layout=RowLayout.PADDED), epochs)
    with pytest.raises(ValueError, match="prompt lengths"):
        plan(chosen, rejected, shared_cfg, epochs)


def test_prefix_sharing_budget_message_and_pack_stats():
    chosen, rejected, prompt = np.array([90, 30, 50]), np.array([70, 40, 60]), np.array([60, 10, 45])
    cfg = PlanConfig(max_tokens_per_row=100, global_batch_pairs=3, layout=RowLayout.PREFIX_SHARED)
    with pytest.raises(InputError, match=r"^pair 0 needs 100 tokens \(prompt 60 \+ chosen 30 \+ rejected 10, the "
                                         r"prompt shared\) but --max-tokens-per-row is 99; raise"):
        validate_lengths(chosen, rejected, replace(cfg, max_tokens_per_row=99), prompt_lengths=prompt)
    stats = pack_stats(chosen, rejected, cfg, prompt_lengths=prompt)
    assert stats["prefix_sharing"] and stats["sequence_tokens"] == 340 and stats["real_tokens"] == 340 - 115
    assert stats["prompt_tokens_shared"] == 115 and stats["prefix_sharing_ideal_speedup"] == pytest.approx(340 / 225)
    assert stats["padded_utilization"] == pytest.approx(340 / stats["padded_computed_tokens"])
    unshared = pack_stats(chosen, rejected, replace(cfg, layout=RowLayout.PACKED, max_tokens_per_row=160))
    assert unshared["prompt_tokens_shared"] == 0 and unshared["prefix_sharing_ideal_speedup"] == 1.0
