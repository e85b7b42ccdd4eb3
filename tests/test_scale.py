"""Training at scale: activation checkpointing, the LR schedules, parameter groups, the held-out split, ``eval``.

Launch budget: one 2-rank launch (checkpointing and weight decay under ZeRO-3 at S=2) and one 1-rank
``eval`` process.  The schedules are checked against DeepSpeed's own scheduler classes built from the
section the run's DeepSpeed config holds, with no engine; the logged LRs of a real run and their exact
continuation across a resume ride on tests/test_checkpoint.py, the layout-independence of the eval
figures on tests/test_trainer_multirank.py.
"""

from __future__ import annotations

import json
import math
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from deepspeed.runtime import lr_schedules
from launching import ranks_script, run
import specs
from transformers import AutoModelForCausalLM

from ds_packdpo import cli
from ds_packdpo.config import parse_train_args
from ds_packdpo.data.run_plan import run_plan
from ds_packdpo.data.synthetic import synthetic_preference_rows
from ds_packdpo.model.attention import SDPA_VARLEN, attn_implementation
from ds_packdpo.model.build import tiny_config
from ds_packdpo.model.collate import collate_packed
from ds_packdpo.model.guard import synthetic_pairs
from ds_packdpo.model.logps import forward_logps
from ds_packdpo.model.param_groups import no_decay_names, weight_decay_groups
from ds_packdpo.run.assemble import prepare
from ds_packdpo.run.engines import enable_gradient_checkpointing, load_ds_config
from ds_packdpo.run.schedule import start_schedule


# ----------------------------------------------------------------------------- LR schedules
def closed_form(kind: str, s: int, peak: float, warmup: int, total: int, floor_ratio: float) -> float:
    """The LR of optimizer step s (1-based) as the README states it."""
    w2 = max(2, warmup)
    if s < w2:
        g = s / warmup if warmup >= 2 else 1.0
    elif kind == "constant":
        g = 1.0
    elif kind == "linear":
        g = (total + 1 - s) / (total + 1 - w2)
    else:
        g = (1 + math.cos(math.pi * (s - w2 + 1) / (total + 2 - w2))) / 2
    return peak * (floor_ratio + (1 - floor_ratio) * g)


def deepspeed_lrs(flags: list[str], total: int) -> list[list[float]]:
    """The LR of every parameter group at each step of a run of ``total`` steps, from the DeepSpeed scheduler that
    the run's filled DeepSpeed config describes (built as the engine builds it), on a 2-group optimizer."""
    cfg = parse_train_args(flags)
    raw, source = load_ds_config(cfg.ds_config)
    ds = specs.ds_config(cfg, raw, source, 1, total)
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "weight_decay": 0.1},
              {"params": [torch.nn.Parameter(torch.zeros(2))], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr)
    section = ds.get("scheduler")
    scheduler = getattr(lr_schedules, section["type"])(optimizer, **section["params"]) if section else None
    start_schedule(SimpleNamespace(lr_scheduler=scheduler))
    lrs = []
    for _ in range(total):
        lrs.append([group["lr"] for group in optimizer.param_groups])
        if scheduler is not None:
            scheduler.step()  # what the engine does after each optimizer step
    return lrs


# every scheduler x warm-up 0, 1, 2, 5 x floor 0, 0.1 (a floor is refused with a constant LR: test_bad_input.py)
SCHEDULES = [(kind, warmup, floor) for kind in ("constant", "linear", "cosine") for warmup in (0, 1, 2, 5)
             for floor in (0.0, 0.1) if not (kind == "constant" and floor)]


@pytest.mark.parametrize("kind, warmup, floor", SCHEDULES)
def test_schedule_follows_its_closed_form(kind, warmup, floor):
    total, peak = 12, 3e-4
    flags = ["--lr", str(peak), "--lr-scheduler", kind, "--warmup-steps", str(warmup), "--min-lr-ratio", str(floor)]
    lrs = deepspeed_lrs(flags, total)
    for s, step_lrs in enumerate(lrs, start=1):
        want = closed_form(kind, s, peak, warmup, total, floor)
        assert step_lrs == pytest.approx([want, want], rel=1e-12, abs=1e-18), (s, step_lrs, want)
    assert all(lr[0] > 0 for lr in lrs)  # no step runs at LR 0, first or last
    if warmup >= 2:
        assert lrs[0][0] == pytest.approx(peak * (floor + (1 - floor) / warmup))  # step 1 already trains
        assert [lr[0] for lr in lrs[:warmup]] == sorted(lr[0] for lr in lrs[:warmup])
    if kind != "constant":
        assert lrs[-1][0] > peak * floor and lrs[-1][0] < lrs[len(lrs) // 2][0]  # decays, above the floor at the end
    if kind == "linear" and warmup >= 2:
        assert lrs[warmup - 1][0] == pytest.approx(peak)  # the peak at step W


def test_warmup_ratio_rounds_up_over_the_plan_total():
    assert specs.schedule(parse_train_args(["--warmup-ratio", "0.1"]), 25).warmup_steps == 3
    lrs = deepspeed_lrs(["--lr", "1e-3", "--warmup-ratio", "0.1", "--lr-scheduler", "cosine"], 25)
    assert [round(lr[0], 12) for lr in lrs[:3]] == [round(1e-3 / 3, 12), round(2e-3 / 3, 12),
                                                    round(closed_form("cosine", 3, 1e-3, 3, 25, 0.0), 12)]


def test_total_steps_come_from_the_plan(tmp_path):
    """--epochs, --max-steps and --tokens-per-step decide the steps the schedule spans."""
    base = ["--synthetic-pairs", "40", "--max-length", "96", "--cache-dir", str(tmp_path / "cache"),
            "--output-dir", str(tmp_path / "out")]

    def steps(*flags: str) -> int:
        setup = prepare(parse_train_args([*base, *flags]), "train", world_size=2)
        assert setup.ds_config["scheduler"]["params"]["total_num_steps"] == setup.schedule.total_steps + 1
        return setup.schedule.total_steps

    assert steps("--global-batch-pairs", "8") == 5
    assert steps("--global-batch-pairs", "8", "--epochs", "3") == 15
    assert steps("--global-batch-pairs", "8", "--epochs", "3", "--max-steps", "7") == 7
    assert steps("--global-batch-pairs", "8", "--max-steps", "7") == 7  # without --epochs: a second pass planned
    assert steps("--global-batch-pairs", "8", "--epochs", "1", "--max-steps", "7") == 5  # given, the epoch caps it
    setup = prepare(parse_train_args([*base, "--tokens-per-step", "2000", "--epochs", "2"]), "train", world_size=2)
    assert setup.schedule.total_steps == sum(1 for _ in run_plan(setup.prepared, setup.spec.plan.config, 2)) > 2


# ----------------------------------------------------------------------------- parameter groups
def test_no_weight_decay_on_biases_norms_and_embeddings():
    for arch, tied in (("llama", False), ("llama", True), ("qwen2", False)):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config(arch, tie_word_embeddings=tied))
        exempt = no_decay_names(model)
        for name, param in model.named_parameters():
            no_decay = name.endswith(".bias") or "norm" in name or name == "model.embed_tokens.weight"
            assert (name in exempt) == no_decay, (arch, tied, name)
            assert param.ndim == 2 or name in exempt, name  # every vector parameter is a bias or a norm weight
        assert ("lm_head.weight" in dict(model.named_parameters())) != tied  # tied: one parameter, not decayed
        if arch == "qwen2":
            assert any(name.endswith("q_proj.bias") for name in exempt)
    model.model.embed_tokens.weight.requires_grad_(False)  # frozen parts (adapters train alone) are left out
    decayed, free = weight_decay_groups(model, 0.05)
    assert (decayed["weight_decay"], free["weight_decay"]) == (0.05, 0.0)
    grouped = {id(p) for group in (decayed, free) for p in group["params"]}
    assert grouped == {id(p) for p in model.parameters() if p.requires_grad}
    assert id(model.model.embed_tokens.weight) not in grouped


# ----------------------------------------------------------------------------- held-out split
def test_eval_fraction_never_trains_on_a_held_out_pair(tmp_path, demo_tokenizer, capsys, no_launch):
    """The split is by content: no training step holds a held-out pair (nor an exact copy of one), the same pairs
    are held out whatever the seed and the row order, and the plan's fingerprint records the fraction."""
    rows = synthetic_preference_rows(200, seed=3)
    rows += [dict(row) for row in rows[:20]]  # exact duplicates: each must land on its original's side
    data = tmp_path / "pairs.json"
    data.write_text(json.dumps(rows))
    shuffled = tmp_path / "shuffled.json"
    shuffled.write_text(json.dumps([rows[i] for i in np.random.default_rng(0).permutation(len(rows))]))
    demo_tokenizer.save_pretrained(tmp_path / "tok")
    base = ["--max-length", "96", "--global-batch-pairs", "16", "--cache-dir", str(tmp_path / "cache"),
            "--output-dir", str(tmp_path / "out"), "--tokenizer", str(tmp_path / "tok"), "--eval-fraction", "0.2"]

    def content(prepared, index) -> tuple:
        row = prepared.dataset[int(index)]
        return tuple(tuple(row[k]) for k in ("prompt_ids", "chosen_ids", "rejected_ids"))

    def split(*flags: str):
        setup = prepare(parse_train_args([*base, *flags]), "train", world_size=2)
        trained = {content(setup.prepared, i) for plan in run_plan(setup.prepared, setup.spec.plan.config, 2)
                   for i in plan.pairs}
        held = setup.held_out.pairs
        held_out = {content(held, i) for i in range(len(held.chosen_lengths))}
        assert sorted(setup.held_out.plan.pairs) == list(range(len(held.chosen_lengths)))  # every held-out pair
        assert (setup.held_out.plan.side_rows() >= 0).all()  # ... and both its sides computed by the rows
        assert len({len(rows) for rows in setup.held_out.plan.ranks}) == 1  # equal forwards per rank
        return trained, held_out, setup

    without = prepare(parse_train_args([*base[:-2], "--dataset", str(data)]), "train", world_size=2)
    assert without.held_out is None and len(without.prepared.chosen_lengths) == len(rows)
    every = {content(without.prepared, i) for i in range(len(rows))}
    trained, held_out, setup = split("--dataset", str(data))
    assert trained and held_out and not trained & held_out
    assert trained | held_out == every  # every distinct pair on one side
    assert 20 <= len(held_out) <= 60  # ~0.2 x 200
    assert split("--dataset", str(shuffled), "--seed", "7")[1] == held_out
    _, capped, _ = split("--dataset", str(data), "--eval-max-pairs", "5")
    assert len(capped) == 5 and capped <= held_out
    assert setup.plan_fingerprint != without.plan_fingerprint
    # pack-stats plans what trains; bench refuses what it would not measure
    assert cli.main(["pack-stats", *base[:-2], "--dataset", str(data), "--world-size", "2", "--eval-fraction",
                     "0.2"]) == 0
    assert json.loads(capsys.readouterr().out)["pairs"] == len(setup.prepared.chosen_lengths)
    assert cli.main(["bench", *base, "--dataset", str(data), "--num-procs", "2"]) == 2
    assert capsys.readouterr().err.strip().endswith("error: --eval-fraction: bench measures training steps only "
                                                    "(evaluate a model with 'ds-packdpo eval'); drop them")


# ----------------------------------------------------------------------------- activation checkpointing
def _packed_gradients(model, batch) -> tuple[list[torch.Tensor], int]:
    calls = [0]
    hook = model.model.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    seqs = forward_logps(model, batch, "sdpa_varlen", chunk_tokens=7, impl="lean")
    weights = torch.linspace(-1.0, 1.0, seqs.logps.numel())
    (seqs.logps * weights).sum().backward()
    hook.remove()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads, calls[0]


def test_gradient_checkpointing_keeps_gradients_one_rank():
    """One process, packed rows of several sequences, lean log-probs: the same gradients with and without, and the
    layers really run again in backward."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(vocab_size=300), attn_implementation=attn_implementation(SDPA_VARLEN))
    batch = collate_packed(synthetic_pairs(4, 300, seed=1, max_tokens=30), list(range(4)), 0)
    plain, plain_calls = _packed_gradients(model, batch)
    enable_gradient_checkpointing(model)
    assert model.is_activation_checkpointing and model.training
    recomputed, calls = _packed_gradients(model, batch)
    assert (plain_calls, calls) == (1, 2)
    scale = max(float(g.abs().max()) for g in plain)
    worst = max(float((a - b).abs().max()) for a, b in zip(plain, recomputed, strict=True))
    assert worst <= 1e-6 * scale, (worst, scale)


@pytest.mark.multirank
def test_gradient_checkpointing_and_weight_decay_under_zero3_sequence_parallel(tmp_path):
    """2 ranks sharing every row (S=2, ZeRO-3, lean log-probs): --gradient-checkpointing recomputes the layers and
    gives the gradients of the run without it; DeepSpeed's optimizer decays the weight matrices only."""
    out = tmp_path / "report.json"
    run(ranks_script(2, "tests/checkpointing_check.py", str(out), "--output-dir", str(tmp_path / "run"),
                         "--cache-dir", str(tmp_path / "cache"), "--synthetic-pairs", "48", "--global-batch-pairs",
                         "12", "--max-length", "96", "--dtype", "fp32", "--no-progress", "--overwrite",
                         "--sequence-parallel-size", "2", "--max-tokens-per-row", "100", "--gradient-checkpointing",
                         "--weight-decay", "0.1", "--lr", "1e-3", "--lr-scheduler", "constant"))
    report = json.loads(out.read_text())
    print("checkpointing on vs off, S=2:", report)
    assert report["checkpointing_enabled"]
    assert report["mlp_calls_on"] == 2 * report["mlp_calls_off"] == 2 * report["rows"]
    assert report["grad_scale"] > 0 and report["grad_max_rel_diff"] <= 1e-6
    assert report["group_weight_decay"] == [0.1, 0.0]
    assert report["decayed_max_rel_error"] <= 1e-6 and report["exempt_max_change"] == 0.0
    assert "model.embed_tokens.weight" in report["exempt"] and "model.norm.weight" in report["exempt"]


# ----------------------------------------------------------------------------- ds-packdpo eval
def dpo_figures(policy, reference, pairs: list[dict], beta: float) -> dict:
    """TRL's eval figures of ``pairs`` from two plain models, one sequence at a time, full softmax (independent of
    the packed path)."""

    def logps(model, prompt, completion) -> float:
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1:-1].double()
        return float(torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None]).sum())

    rows = []
    for pair in pairs:
        values = [logps(m, pair["prompt_ids"], pair[k]) for m in (policy, reference)
                  for k in ("chosen_ids", "rejected_ids")]
        chosen, rejected = beta * (values[0] - values[2]), beta * (values[1] - values[3])
        rows.append({"eval_loss": -math.log(1 / (1 + math.exp(-(chosen - rejected)))),
                     "eval_rewards/chosen": chosen, "eval_rewards/rejected": rejected,
                     "eval_rewards/margins": chosen - rejected, "eval_rewards/accuracies": float(chosen > rejected),
                     "eval_logps/chosen": values[0], "eval_logps/rejected": values[1]})
    return {key: sum(r[key] for r in rows) / len(rows) for key in rows[0]}


def test_eval_command_on_an_exported_model(tmp_path, demo_tokenizer):
    """``python -m ds_packdpo.evaluate`` (one rank of ds-packdpo eval) on two model folders: the figures equal an
    independent unpacked computation."""
    vocab = len(demo_tokenizer)
    folders = {}
    for name, seed in (("policy", 1), ("reference", 2)):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(tiny_config(vocab_size=vocab))
        folders[name] = tmp_path / name
        model.save_pretrained(folders[name])
        demo_tokenizer.save_pretrained(folders[name])
    data = tmp_path / "pairs.json"
    data.write_text(json.dumps(synthetic_preference_rows(20, seed=5)))
    flags = ["--model", str(folders["policy"]), "--ref-model", str(folders["reference"]), "--dataset", str(data),
             "--max-length", "96", "--max-pairs", "12", "--dtype", "fp32", "--beta", "0.2",
             "--cache-dir", str(tmp_path / "cache"), "--max-tokens-per-row", "256"]
    proc = run([sys.executable, "-m", "ds_packdpo.evaluate", *flags], timeout=600)
    figures = json.loads(proc.stdout[proc.stdout.index("{"):])
    setup = prepare(parse_train_args(flags), "eval", world_size=1)
    pairs = [setup.held_out.pairs.dataset[i] for i in range(12)]
    assert max(len(rows) for rows in setup.held_out.plan.ranks) > 1  # several packed rows
    want = dpo_figures(*(AutoModelForCausalLM.from_pretrained(folders[n]) for n in ("policy", "reference")), pairs,
                       beta=0.2)
    assert figures["eval_pairs"] == 12
    # Rewards and margins are beta x differences of log-prob sums of hundreds of nats: fp32 rounds those sums to
    # ~1e-7 of their size, which the difference keeps in absolute terms (measured: 3e-8 of beta x |logps|).
    reward_tolerance = 2e-7 * 0.2 * max(abs(want["eval_logps/chosen"]), abs(want["eval_logps/rejected"]))
    for key, value in want.items():
        tolerance = reward_tolerance if key.startswith("eval_rewards/") else 1e-6
        assert figures[key] == pytest.approx(value, rel=1e-5, abs=tolerance), key
