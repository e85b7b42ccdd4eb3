"""Prompt groups ``[prompt | r1 | ... | rk]``: every prompt and every distinct response computed once per row.

The layout (positions, labels, the prompt's last position scoring every response), the attention kernels (CPU and
torch_varlen's emulation) against a dense masked reference, sequence parallelism's slices, and the done-when:
per-pair log-probs and the gradient of a loss of them from grouped rows equal every pair's sequences run alone with
eager attention (fp32), for every architecture of the matrix, on sequences longer than the window.
"""

from __future__ import annotations

from pathlib import Path

import datasets
import numpy as np
import pytest
import torch

from ds_packdpo.data.plan import PlanConfig, RowLayout, iter_plan, pack_stats, step_compositions, steps_per_epoch
from ds_packdpo.data import pair_keys
from ds_packdpo.data.prompt_groups import PairGroups, pair_groups
from ds_packdpo.model import prefix_attention, torch_varlen
from ds_packdpo.model.build import ARCHITECTURES, build_model
from ds_packdpo.model.collate import (PrefixLayout, PromptGroup, collate_groups, collate_grouped, collate_shared,
                                      group_pairs)
from ds_packdpo.model.guard import synthetic_pairs
from ds_packdpo.model.logps import forward_logps
from ds_packdpo.model.matrix import matrix_outcome
from ds_packdpo.run.reference import PrecomputedReference
from ds_packdpo.run.sequence_parallel import slice_row

from launching import ranks_module, read_metrics, run
from varlen_emulation import use_torch_varlen_emulation

X = -100
LAYOUT = PrefixLayout(((5, 3, 4, 2), (1, 0, 6), (7, 4, 0, 3, 5), (1, 9), (6, 0, 0), (3, 5, 5, 5)))


def dense_group_reference(q, k, v, layout: PrefixLayout, window=None):
    """Masked dense attention: a response's token sees its group's prompt and its own response's earlier tokens."""
    total = q.shape[0]
    position, piece, block_of = torch.zeros(total), torch.zeros(total, dtype=torch.long), torch.zeros(total)
    start = 0
    for b, block in enumerate(layout.blocks):
        for j, size in enumerate(block):
            position[start:start + size] = torch.arange(size) + (block[0] if j else 0)
            piece[start:start + size] = j
            block_of[start:start + size] = b
            start += size
    same_block = block_of[:, None] == block_of[None, :]
    visible = same_block & (position[None, :] <= position[:, None]) & (
        (piece[None, :] == 0) | (piece[None, :] == piece[:, None]))
    if window is not None:
        visible &= position[:, None] - position[None, :] < window
    groups = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), v)


def test_group_layout_positions_labels_and_pair_lookup():
    """Two prompts, three pairs of the first sharing two responses: each prompt and response once; the prompt's
    last position scores the first token of every response; pairs are looked up from the responses."""
    pairs = [{"prompt_ids": [1, 2], "chosen_ids": [10, 11], "rejected_ids": [20]},
             {"prompt_ids": [5], "chosen_ids": [50], "rejected_ids": [60, 61]},
             {"prompt_ids": [1, 2], "chosen_ids": [10, 11], "rejected_ids": [30, 31, 32]},
             {"prompt_ids": [1, 2], "chosen_ids": [20], "rejected_ids": [30, 31, 32]}]
    groups = group_pairs(pairs, [7, 8, 9, 4])
    assert groups == [PromptGroup((1, 2), ((10, 11), (20,), (30, 31, 32)), ((0, 1), (0, 2), (1, 2)), (7, 9, 4)),
                      PromptGroup((5,), ((50,), (60, 61)), ((0, 1),), (8,))]
    row = collate_grouped(pairs, [7, 8, 9, 4], pad_token_id=0)
    assert row.input_ids.tolist() == [[1, 2, 10, 11, 20, 30, 31, 32, 5, 50, 60, 61]]
    assert row.position_ids.tolist() == [[0, 1, 2, 3, 2, 2, 3, 4, 0, 1, 1, 2]]
    assert row.seq_index.tolist() == [[0, 0, 0, 0, 1, 2, 2, 2, 3, 3, 4, 4]]
    assert row.labels.tolist() == [[X, 10, 11, X, X, 31, 32, X, 50, X, 61, X]]
    assert row.fork_labels.tolist() == [[X, 20, X, X, X, X, X, X, 60, X, X, X],
                                        [X, 30, X, X, X, X, X, X, X, X, X, X]]
    assert row.prefix_layout == PrefixLayout(((2, 2, 1, 3), (1, 1, 2)))
    assert row.pair_indices.tolist() == [7, 8, 9, 4] and row.num_sequences == 5
    assert row.pair_sequences.tolist() == [[0, 1], [3, 4], [0, 2], [1, 2]]
    # the pairs alone would run 2 x prompt + chosen + rejected each; the row runs 12 tokens
    assert row.real_tokens == 7 + 5 + 9 + 8 and row.computed_tokens == 12
    assert row.prompt_tokens_shared == row.real_tokens - 12


def test_pair_layout_is_the_k2_case():
    """collate_shared is collate_groups with one pair per group: canonical sequences, no lookup."""
    pairs = synthetic_pairs(4, vocab_size=64, seed=3, max_tokens=12)
    shared = collate_shared(pairs, [0, 1, 2, 3], 0)
    assert shared.pair_sequences is None and shared.num_sequences == 8 and shared.fork_labels.shape[0] == 1
    assert all(len(block) == 3 for block in shared.prefix_layout.blocks)
    distinct = collate_grouped(pairs, [0, 1, 2, 3], 0)  # distinct prompts: the same row
    assert torch.equal(distinct.input_ids, shared.input_ids) and torch.equal(distinct.labels, shared.labels)


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("kernel", ["cpu", "torch_varlen"])
def test_group_attention_equals_dense_masked_reference(monkeypatch, kernel, window):
    """Values and gradients of both kernels on groups of 1-4 responses (empty ones too), grouped heads."""
    if kernel == "torch_varlen":
        use_torch_varlen_emulation(monkeypatch)
    attend = prefix_attention.shared_prefix_attention if kernel == "cpu" else torch_varlen.shared_prefix_attention
    torch.manual_seed(0)
    total = LAYOUT.tokens
    q = torch.randn(total, 4, 8, requires_grad=True)
    k, v = (torch.randn(total, 2, 8, requires_grad=True) for _ in range(2))
    out = attend(q, k, v, LAYOUT, sliding_window=window)
    want = dense_group_reference(q, k, v, LAYOUT, window)
    assert torch.allclose(out, want, atol=1e-5)
    weights = torch.randn_like(out)
    got = torch.autograd.grad((out * weights).sum(), (q, k, v))
    wanted = torch.autograd.grad((want * weights).sum(), (q, k, v))
    assert all(torch.allclose(g, w, atol=1e-5) for g, w in zip(got, wanted))


def test_sequence_parallel_slices_keep_every_fork_row():
    pairs = [{"prompt_ids": [1, 2, 3], "chosen_ids": [4, 5], "rejected_ids": [6]},
             {"prompt_ids": [1, 2, 3], "chosen_ids": [7], "rejected_ids": [6]},
             {"prompt_ids": [1, 2, 3], "chosen_ids": [4, 5], "rejected_ids": [8, 9]}]
    row = collate_grouped(pairs, [0, 1, 2], 0)
    assert row.fork_labels.shape == (3, row.input_ids.shape[1])
    slices = [slice_row(row, 3, r, 0) for r in range(3)]
    fork = torch.cat([s.fork_labels for s in slices], dim=1)
    assert torch.equal(fork[:, :row.input_ids.shape[1]], row.fork_labels) and (fork[:, row.input_ids.shape[1]:] == X).all()


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_matrix_grouped_rows_equal_each_pair_alone(monkeypatch, arch):
    """Done-when: per-pair log-probs and the gradient of a loss of them from prompt groups (three responses, one
    response in several pairs) equal every pair's sequences run alone with eager attention, fp32, on sequences longer
    than the window; with sdpa_varlen (the CPU kernel) and torch_varlen (emulated; Gemma 2 refused there)."""
    use_torch_varlen_emulation(monkeypatch)
    for attn in ("sdpa_varlen", "torch_varlen"):
        outcome = matrix_outcome(arch, attn, layout=RowLayout.PROMPT_GROUPS)
        if outcome["verdict"] == "refused":
            assert (arch, attn) == ("gemma2", "torch_varlen"), outcome
            continue
        window = outcome["sliding_window"]
        assert window is None or outcome["shortest_sequence"] > window
        assert outcome["logps_diff"] <= 1e-5 and outcome["grad_diff"] <= 1e-5 * outcome["grad_scale"], outcome


def grouped_token_pairs(num_prompts: int, seed: int) -> list[dict]:
    """Every pair of 2-6 responses per prompt (random token ids, heavy-tailed lengths), shuffled."""
    rng = np.random.default_rng(seed)
    pairs = []
    for _ in range(num_prompts):
        prompt = rng.integers(3, 200, int(rng.lognormal(3, 0.6)) + 1).tolist()
        responses = [rng.integers(3, 200, int(rng.lognormal(3, 0.8)) + 1).tolist()
                     for _ in range(int(rng.integers(2, 7)))]
        pairs += [{"prompt_ids": prompt, "chosen_ids": a, "rejected_ids": b}
                  for i, a in enumerate(responses) for b in responses[i + 1:]]
    return [pairs[i] for i in rng.permutation(len(pairs))]


def plan_inputs(pairs):
    prompt = np.array([len(p["prompt_ids"]) for p in pairs])
    chosen = prompt + np.array([len(p["chosen_ids"]) for p in pairs])
    rejected = prompt + np.array([len(p["rejected_ids"]) for p in pairs])
    groups = pair_groups([p["prompt_ids"] for p in pairs], [p["chosen_ids"] for p in pairs],
                         [p["rejected_ids"] for p in pairs])
    return chosen, rejected, prompt, groups


def test_content_groups_from_the_arrow_table_equal_pair_groups(monkeypatch):
    """data/pair_keys.py (keys from the table, a block of rows at a time) numbers groups and responses exactly as
    pair_groups does on the token lists: shared responses, a response of another prompt, chosen equal to rejected,
    blocks of 7 rows, a selection (an indices mapping, as held-out splits and drops make)."""
    monkeypatch.setattr(pair_keys, "BLOCK_ROWS", 7)
    pairs = grouped_token_pairs(30, seed=2)
    same = pairs[0]["chosen_ids"]
    pairs += [{"prompt_ids": [7, 8], "chosen_ids": same, "rejected_ids": same}, {**pairs[1], "prompt_ids": [7, 8]}]
    table = datasets.Dataset.from_list(pairs)
    longest = max(len(p[k]) for p in pairs for k in ("prompt_ids", "chosen_ids", "rejected_ids"))
    for dataset in (table, table.select(list(range(len(pairs)))[::-3])):
        rows = dataset[:]
        want = pair_groups(rows["prompt_ids"], rows["chosen_ids"], rows["rejected_ids"])
        got = pair_keys.groups_of_keys(pair_keys.content_keys(dataset, longest))
        assert want.count < len(dataset)
        for field in ("group", "chosen", "rejected"):
            assert np.array_equal(getattr(got, field), getattr(want, field)), field


def test_steps_take_whole_groups_whatever_the_layout():
    """A step's pairs depend on seed, epoch, global batch and the data's groups only: the same under every layout
    (world, budget, packing, prefix sharing, grouping); every group in one step; singleton groups give today's
    composition."""
    pairs = grouped_token_pairs(40, seed=1)
    chosen, rejected, prompt, groups = plan_inputs(pairs)
    assert groups.count == 40 and len(pairs) > 150
    compositions = set()
    for world, budget, packing, sharing, grouping in ((1, 4000, True, True, True), (2, 700, True, True, False),
                                                      (2, 700, True, False, False), (3, 900, False, False, False)):
        cfg = PlanConfig(max_tokens_per_row=budget, dp_size=world, seed=5, global_batch_pairs=16,
                         layout=RowLayout.of(packing, sharing, grouping))
        steps = [plan.pairs for plan in iter_plan(chosen, rejected, cfg, 2, prompt_lengths=prompt, groups=groups)]
        compositions.add(tuple(steps))
        assert steps_per_epoch(chosen, rejected, cfg, 0, groups) + steps_per_epoch(chosen, rejected, cfg, 1, groups) \
            == len(steps)
    assert len(compositions) == 1
    steps = compositions.pop()
    for step in steps:
        touched = set(groups.group[list(step)].tolist())
        assert len(step) == int(np.isin(groups.group, list(touched)).sum())  # every pair of its groups
    assert sum(len(step) < 16 for step in steps) <= 2  # only an epoch's last step may fall short
    by_tokens = step_compositions(chosen, rejected, PlanConfig(max_tokens_per_row=4000, tokens_per_step=3000), 0, groups)
    assert sorted(np.concatenate(by_tokens).tolist()) == list(range(len(pairs)))  # every pair once
    for step in by_tokens:  # whole groups, each step past the target unless it is the last
        assert set(groups.group[step].tolist()).isdisjoint(set(groups.group[np.setdiff1d(np.arange(len(pairs)),
                                                                                         step)].tolist()))
        assert (chosen + rejected)[step].sum() >= 3000 or step is by_tokens[-1]
    singletons = PairGroups(np.arange(len(pairs)), np.arange(len(pairs)), np.arange(len(pairs)) + len(pairs))
    cfg = PlanConfig(max_tokens_per_row=4000, seed=5, global_batch_pairs=16)
    assert [s.tolist() for s in step_compositions(chosen, rejected, cfg, 0, singletons)] == \
        [s.tolist() for s in step_compositions(chosen, rejected, cfg, 0)]


@pytest.mark.parametrize("tight", [True, False])
def test_rows_hold_whole_groups_split_under_the_budget(tight):
    """With prompt groups a group's pairs share one row unless they exceed the budget; then sub-groups of whole
    pairs, each within it; the row's planned tokens bound what the grouped row computes (equal when no group is
    split)."""
    pairs = grouped_token_pairs(30, seed=2)
    chosen, rejected, prompt, groups = plan_inputs(pairs)
    budget = int((chosen + rejected - prompt).max()) if tight else 4000  # tight: the largest pair just fits
    cfg = PlanConfig(max_tokens_per_row=budget, dp_size=2, seed=0, global_batch_pairs=24,
                     layout=RowLayout.PROMPT_GROUPS)
    split = planned = 0
    for plan in iter_plan(chosen, rejected, cfg, 1, prompt_lengths=prompt, groups=groups):
        rows_of_group: dict[int, set] = {}
        for rank, rows in enumerate(plan.ranks):
            for index, row in enumerate(rows):
                assert row.tokens <= budget
                if not row.pairs:
                    continue
                planned += len(row.pairs)
                batch = collate_grouped([pairs[i] for i in row.pairs], list(row.pairs), 0)
                assert batch.computed_tokens <= row.tokens
                for g in groups.group[list(row.pairs)].tolist():
                    rows_of_group.setdefault(g, set()).add((rank, index))
        split += sum(len(rows) > 1 for rows in rows_of_group.values())
    assert planned == len(pairs)
    assert (split > 0) == tight


def test_pack_stats_reports_tokens_saved_by_groups():
    pairs = grouped_token_pairs(30, seed=3)
    chosen, rejected, prompt, groups = plan_inputs(pairs)
    figures = {}
    for grouping in (True, False):
        cfg = PlanConfig(max_tokens_per_row=4000, dp_size=2, global_batch_pairs=32,
                         layout=RowLayout.of(True, True, grouping))
        figures[grouping] = pack_stats(chosen, rejected, cfg, prompt_lengths=prompt, groups=groups)
    shared = int((chosen + rejected - prompt).sum())
    assert figures[False]["real_tokens"] == shared == figures[True]["prefix_shared_tokens"]
    assert figures[False]["prompt_groups_ideal_speedup"] == 1.0
    assert figures[True]["prompt_groups_ideal_speedup"] > 1.5  # 2-6 responses, every pair of them
    assert figures[True]["sequence_tokens"] == int((chosen + rejected).sum())


MULTI_DEMO_PATH = Path(__file__).resolve().parents[2] / "shared/data/multi_response_demo.jsonl"


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory, demo_tokenizer) -> Path:
    folder = tmp_path_factory.mktemp("tokenizer")
    demo_tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.multirank
@pytest.mark.skipif(not MULTI_DEMO_PATH.exists(), reason="needs ../shared/data/multi_response_demo.jsonl")
def test_grouped_trajectory_equals_ungrouped(tmp_path, tokenizer_folder):
    """Done-when: 3 steps on the demo's 693 pairs (all pairs of 4 scored answers per prompt) with prompt groups
    give the trajectory of the same steps without them (each pair's prompt shared alone), at world size 1 and 2,
    two row budgets (the small one splits groups) and S = 2; the steps hold whole groups and the grouped rows compute
    fewer tokens."""
    data = ("--dataset", str(MULTI_DEMO_PATH), "--pairs-from", "all", "--tokenizer", str(tokenizer_folder),
            "--global-batch-pairs", "12", "--max-length", "160", "--max-steps", "3", "--lr", "1e-3", "--dtype", "fp32",
            "--no-progress", "--overwrite")

    def launch(name: str, procs: int, *flags: str) -> list[dict]:
        out = tmp_path / name
        run(ranks_module(procs, "ds_packdpo.train", "--output-dir", str(out), "--cache-dir", str(tmp_path / "cache"),
                         *data, *flags))
        return read_metrics(out / "metrics.jsonl")

    reference = launch("w1_pairs", 1, "--max-tokens-per-row", "4096", "--no-prompt-groups")
    layouts = {"w1_groups": launch("w1_groups", 1, "--max-tokens-per-row", "4096"),
               "w2_groups": launch("w2_groups", 2, "--max-tokens-per-row", "4096"),
               "w2_groups_small_rows": launch("w2_small", 2, "--max-tokens-per-row", "320"),
               "w2_sp2_groups": launch("w2_sp2", 2, "--max-tokens-per-row", "160", "--sequence-parallel-size", "2")}
    assert [r["step"] for r in reference] == [1, 2, 3] and reference[-1]["loss"] < reference[0]["loss"]
    assert all(r["pairs"] >= 12 for r in reference)  # whole groups: 12 pairs or more
    for name, records in layouts.items():
        for ref, got in zip(reference, records, strict=True):
            assert got["pairs"] == ref["pairs"] and got["tokens"] == ref["tokens"], name
            for key in ("loss", "grad_norm", "rewards/margins", "logps/chosen", "logps/rejected"):
                assert got[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), (name, key, got[key], ref[key])
            assert got["computed_tokens"] < ref["computed_tokens"], name  # each response once, not once per pair
    print("computed tokens per step, pairs alone vs groups:", [r["computed_tokens"] for r in reference],
          [r["computed_tokens"] for r in layouts["w2_groups"]])


def test_precomputed_reference_rows_meet_grouped_pairs():
    """A --ref-logps table (pairs computed alone, by positional index) lines up with a grouped row's pairs: the
    policy's grouped log-probs and the table's are the same pair by pair (the loss pairs them by position)."""
    pairs = grouped_token_pairs(3, seed=4)
    model = build_model(None, "tiny", 256, torch.float32, "sdpa_varlen", seed=0)
    alone = forward_logps(model, collate_shared(pairs, list(range(len(pairs))), 0), "sdpa_varlen")
    table = torch.stack([alone.chosen_logps, alone.rejected_logps, alone.chosen_tokens, alone.rejected_tokens], 1)
    order = list(np.random.default_rng(0).permutation(len(pairs)))
    row = collate_grouped([pairs[i] for i in order], order, 0)
    assert row.pair_sequences is not None and row.num_sequences < 2 * len(pairs)
    grouped = forward_logps(model, row, "sdpa_varlen")
    looked_up = PrecomputedReference(table.detach()).sequence_logps(row)
    assert torch.allclose(grouped.logps.detach(), looked_up.logps, rtol=1e-5, atol=1e-5)
    assert torch.equal(grouped.tokens, looked_up.tokens)
