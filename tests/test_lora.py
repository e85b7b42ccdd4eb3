"""LoRA-DPO: adapters on the frozen base, the reference being the policy with its adapters off.

Unit tests (one process, no DeepSpeed): lean log-probs with adapters (also on the lm_head) against plain ones,
the adapters-off forward against the base model, each --lora-* flag against what it names, the refusals of phase
one.  Multi-rank (ZeRO-3, fp32): one 2-rank LoRA run of 6 steps with checkpoints is the reference of every
comparison: the same run with an explicit --ref-model copy of the base, with one rank (and plain log-probs),
padded, and a kill after the step-3 checkpoint resumed; the step-3 checkpoint exported as an adapter and as a
merged model gives the engine's log-probs.  Sequence parallelism and the bench with LoRA: test_bench.py.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM
from launching import cpu_env, rank_module, ranks_module, read_metrics, run
from test_checkpoint import assert_same_steps

from ds_packdpo import cli
from ds_packdpo.config import parse_train_args
from ds_packdpo.data.run_plan import run_plan
from ds_packdpo.data.synthetic import default_tokenizer, synthetic_preference_rows
from ds_packdpo.errors import InputError
from ds_packdpo.model import lora as lora_module
from ds_packdpo.model.build import build_model, tiny_config
from ds_packdpo.model.collate import collate_packed, collate_row
from ds_packdpo.model.guard import synthetic_pairs
from ds_packdpo.model.logps import forward_logps
from ds_packdpo.model.lora import LoraSettings, add_adapters, as_reference
from ds_packdpo.report import loss_max_rel_diff
from ds_packdpo.run.assemble import lora_settings, prepare, trainable_line
from ds_packdpo.run.checkpoint import LATEST
from ds_packdpo.run.manifest import write_manifest

TARGETS = "q_proj,v_proj,down_proj,lm_head"  # the lm_head too: the lean log-probs' low-rank head term
# A constant LR: the 3-step runs below are compared with the first 3 steps of a 6-step one.
RUN = ["--synthetic-pairs", "48", "--global-batch-pairs", "8", "--max-length", "96", "--lr", "1e-2", "--dtype", "fp32",
       "--lr-scheduler", "constant", "--no-progress", "--overwrite", "--max-tokens-per-row", "400", "--lora-r", "8",
       "--lora-target-modules", TARGETS]


def tiny_lora_model(targets: str, vocab: int = 300, **lora_flags: str):
    """A tiny Llama with adapters whose B is not zero (a fresh adapter changes nothing)."""
    torch.manual_seed(0)
    flags = ["--lora-r", "4", "--lora-target-modules", targets]
    for key, value in lora_flags.items():
        flags += [f"--{key.replace('_', '-')}", value]
    base = build_model(None, "tiny", vocab, torch.float32, "sdpa")
    model = add_adapters(base, lora_settings(parse_train_args(flags)), seed=1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.05)
    return model


@pytest.mark.parametrize("targets", ["all-linear", TARGETS])
def test_lean_logps_with_adapters_equal_plain_and_adapters_off_equal_the_base(targets):
    model = tiny_lora_model(targets)
    pairs = synthetic_pairs(3, 300, seed=1)
    weights = torch.randn(6, generator=torch.Generator().manual_seed(2))
    for batch in (collate_packed(pairs, [0, 1, 2], 0),):  # padded rows: the multi-rank padded run
        results = {}
        for impl in ("plain", "lean"):
            model.zero_grad()
            out = forward_logps(model, batch, "sdpa", chunk_tokens=7, impl=impl)
            (out.logps * weights).sum().backward()
            grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
            with torch.no_grad(), as_reference(model):
                off = forward_logps(model, batch, "sdpa", chunk_tokens=7, impl=impl).logps
            results[impl] = out, grads, off
        (plain, plain_grads, plain_off), (lean, lean_grads, lean_off) = results["plain"], results["lean"]
        torch.testing.assert_close(lean.logps, plain.logps, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lean.logits_sum, plain.logits_sum, rtol=1e-5, atol=1e-5)
        # only adapters get gradients, the same ones both ways (the lm_head's adapter included)
        assert plain_grads.keys() == lean_grads.keys() and all("lora_" in name for name in plain_grads)
        assert any("lm_head.lora_B" in name for name in plain_grads) == ("lm_head" in targets)
        for name, want in plain_grads.items():
            torch.testing.assert_close(lean_grads[name], want, rtol=1e-5, atol=1e-6)
        # adapters off: the base model's log-probs, with either implementation; adapters on differ
        with torch.no_grad():
            base = forward_logps(model.get_base_model(), batch, "sdpa", impl="plain")  # adapters enabled again
            torch.testing.assert_close(base.logps, plain.logps.detach(), rtol=1e-5, atol=1e-5)
        for off in (plain_off, lean_off):
            assert (off - plain.logps.detach()).abs().max() > 1e-2
        torch.testing.assert_close(lean_off, plain_off, rtol=1e-5, atol=1e-5)
    assert model.training  # as_reference put the training mode back


def test_each_lora_flag_changes_what_it_names():
    def wrapped(**flags):
        return tiny_lora_model(flags.pop("targets", "all-linear"), **flags)

    default = wrapped()
    trainable = {name for name, p in default.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)  # the base is frozen
    # --lora-r: the adapters' rank; all-linear: the seven projections of both decoder layers, not the lm_head
    ranks = {p.shape[0] for n, p in default.named_parameters() if ".lora_A." in n}
    assert ranks == {4} and len(trainable) == 2 * 7 * 2
    assert not any("lm_head" in n for n in trainable)
    # --lora-alpha: the scale alpha / r (default 2 x r / r = 2)
    q_proj = default.get_base_model().model.layers[0].self_attn.q_proj
    assert q_proj.scaling["default"] == 2.0
    assert wrapped(lora_alpha="2").get_base_model().model.layers[0].self_attn.q_proj.scaling["default"] == 0.5
    # --lora-dropout: the adapters' input dropout
    assert isinstance(q_proj.lora_dropout["default"], torch.nn.Identity)
    assert wrapped(lora_dropout="0.25").get_base_model().model.layers[0].self_attn.q_proj.lora_dropout["default"].p == 0.25
    # --lora-target-modules: which modules carry adapters
    some = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n, p in wrapped(targets="v_proj,lm_head").named_parameters()
            if p.requires_grad}
    assert some == {"v_proj", "lm_head"}
    # the start-up line counts the trainable parameters: r x (in + out) per wrapped module
    line = trainable_line(default, LoraSettings(4, 8.0, 0.0, "all-linear"))
    expected = sum(4 * (m.in_features + m.out_features) for m in default.modules() if hasattr(m, "base_layer"))
    assert f"trainable parameters: {expected:,} of " in line and "LoRA r=4 alpha=8 on all-linear" in line


@pytest.mark.parametrize("flags, message", [
    (["--lora-r", "8", "--lora-target-modules", "q_proj,qproj"],
     "--lora-target-modules q_proj,qproj: 'qproj' matches no module of --model-config tiny (its linear and embedding "
     "modules: down_proj, embed_tokens, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj; or 'all-linear')"),
    (["--lora-r", "8", "--lora-target-modules", "input_layernorm"],
     "--lora-target-modules input_layernorm: LoRA cannot wrap it in --model-config tiny (Target module LlamaRMSNorm"),
    (["--lora-alpha", "16"], "--lora-alpha without --lora-r: LoRA is off"),
    (["--lora-r", "8", "--ref-offload"], "--ref-offload with --lora-r: the reference is the policy with its adapters off"),
    (["--lora-r", "-1"], "--lora-r must be >= 0"),
])
def test_what_lora_cannot_do_is_refused_before_any_rank_starts(flags, message, tmp_path, no_launch, capsys):
    code = cli.main(["train", "--synthetic-pairs", "16", "--max-length", "64", "--output-dir", str(tmp_path / "out"),
                     "--cache-dir", str(tmp_path / "cache"), *flags])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and last.startswith(f"error: {message}"), last
    assert not (tmp_path / "out").exists()


def test_the_bench_trajectory_check_leaves_out_configurations_that_train_other_parameters():
    def measured(loss: float, **overrides) -> dict:
        return {"overrides": {"packing": True, **overrides}, "steps": [{"step": 2, "loss": loss}]}

    assert loss_max_rel_diff({"packed": measured(1.0), "padded": measured(1.5)}) == 0.5
    assert loss_max_rel_diff({"packed": measured(1.0), "packed-lora": measured(2.0, lora_r=8)}) is None
    assert loss_max_rel_diff({"packed": measured(1.0), "padded": measured(1.25),
                              "packed-lora": measured(2.0, lora_r=8)}) == 0.25


def test_lora_without_peft_is_refused(monkeypatch):
    monkeypatch.setattr(lora_module, "LoraConfig", None)
    with pytest.raises(InputError, match=r"--lora-r needs peft, which is not installed \(pip install -e '\.\[lora\]'\)"):
        lora_module.check_adapters(LoraSettings(8, 16.0, 0.0, "all-linear"), tiny_config(), "--model-config tiny")


# ----------------------------------------------------------------------------- multi-rank


def save_base(folder: Path):
    """A tiny random Llama and the embedded data's tokenizer as an HF folder (the base model of every run)."""
    tokenizer = default_tokenizer(synthetic_preference_rows(48, seed=0))
    model = build_model(None, "tiny", len(tokenizer), torch.float32, "sdpa", seed=0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


def train_flags(root: Path, name: str, *extra: str) -> list[str]:
    return ["--output-dir", str(root / name), "--cache-dir", str(root / "cache"), "--model", str(root / "base"),
            *RUN, *extra]


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """The 2-rank LoRA run, reference with adapters off: 6 steps (one epoch), checkpoints at steps 3 and 6."""
    root = tmp_path_factory.mktemp("lora")
    base = sum(p.numel() for p in save_base(root / "base").parameters())
    proc = run(ranks_module(2, "ds_packdpo.train", *train_flags(root, "straight", "--save-steps", "3",
                                                                    "--max-steps", "6")))
    # the start-up line: r x (in + out) per wrapped module, of the base's parameters plus those
    adapters = sum(8 * (m.in_features + m.out_features) for name, m in AutoModelForCausalLM.from_pretrained(
        root / "base").named_modules() if name.rsplit(".", 1)[-1] in TARGETS.split(","))
    assert (f"trainable parameters: {adapters:,} of {base + adapters:,} ({100 * adapters / (base + adapters):.2f}%; "
            f"LoRA r=8 alpha=16 on {TARGETS}, base weights frozen)") in proc.stdout
    return root


def assert_same_trajectory(got: list[dict], want: list[dict], rel: float) -> None:
    for ref, new in zip(want, got, strict=True):
        assert new["pairs"] == ref["pairs"] == 8 and new["tokens"] == ref["tokens"]
        for key in ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen"):
            assert new[key] == pytest.approx(ref[key], rel=rel, abs=1e-6), (ref["step"], key, new[key], ref[key])


@pytest.mark.multirank
def test_adapters_off_reference_equals_a_reference_model_and_the_trajectory_ignores_the_layout(straight, capsys):
    lora = read_metrics(straight / "straight" / "metrics.jsonl")[:3]
    assert lora[0]["loss"] == pytest.approx(0.693147, abs=1e-6)  # B = 0: the policy is its reference at step 1
    assert lora[0]["rewards/margins"] == 0.0 and lora[-1]["loss"] < lora[0]["loss"] - 0.01  # and it learns

    def launch(name: str, procs: int, *flags: str) -> list[dict]:
        argv = train_flags(straight, name, "--max-steps", "3", *flags)
        run(ranks_module(2, "ds_packdpo.train", *argv) if procs == 2 else rank_module("ds_packdpo.train", *argv))
        return read_metrics(straight / name / "metrics.jsonl")

    # an explicit reference engine loaded from a copy of the base: the same numbers (measured: bitwise)
    shutil.copytree(straight / "base", straight / "base_copy")
    assert_same_trajectory(launch("ref_model", 2, "--ref-model", str(straight / "base_copy")), lora, rel=1e-5)
    # one rank with the full-logits log-probs, and padded micro-batches: the same trajectory (invariant 2)
    one_rank = launch("one_rank_plain", 1, "--logps-impl", "plain")
    padded = launch("padded", 2, "--no-packing", "--micro-batch-pairs", "2")
    assert any(r["computed_tokens"] > r["tokens"] for r in padded)
    for records in (one_rank, padded):
        assert_same_trajectory(records, lora, rel=1e-4)
    with capsys.disabled():
        worst = max(abs(r[k] - w[k]) / abs(w[k]) for rs in (one_rank, padded) for r, w in zip(rs, lora)
                    for k in ("loss", "grad_norm") if w[k])
        print(f"LoRA trajectory, 1 rank plain and 2 ranks padded vs 2 ranks packed: largest relative difference {worst:.2g}")


def step_sequence_logps(model, root: Path, step: int) -> torch.Tensor:
    """Per-sequence log-probs of ``model`` (no DeepSpeed) over the pairs of optimizer ``step``, in one packed row."""
    setup = prepare(parse_train_args(train_flags(root, "plan_only")))
    plan = next(iter(run_plan(setup.prepared, setup.spec.plan.config, 1, start_step=step - 1)))
    batch = collate_row(setup.prepared.dataset, plan.pairs, setup.pad_token_id)
    with torch.no_grad():
        return forward_logps(model.eval(), batch, "sdpa", impl="plain").logps


@pytest.mark.multirank
def test_lora_resumes_exactly_after_a_kill_and_exports_the_engines_log_probs(straight, capsys):
    reference = read_metrics(straight / "straight" / "metrics.jsonl")
    # 1. rank 1 SIGKILLs itself as step 5 begins (the launcher stops rank 0); the step-3 checkpoint stays latest
    killed = straight / "killed"
    argv = train_flags(straight, "killed", "--save-steps", "3", "--max-steps", "6")
    proc = run(ranks_module(2, "ds_packdpo.train", *argv), check=False, env=cpu_env(DS_PACKDPO_FAULT_KILL="1:5"))
    assert proc.returncode != 0
    assert (killed / "checkpoints" / LATEST).read_text() == "global_step3"
    state = json.loads((killed / "checkpoints" / "global_step3" / "ds_packdpo_state.json").read_text())
    assert state["lora"] == {"r": 8, "alpha": 16.0, "dropout": 0.0, "target_modules": TARGETS}
    # another LoRA setting is refused in phase one, naming both
    with pytest.raises(InputError, match=r"written with LoRA r=8 alpha=16 dropout=0 on .*, this run trains LoRA r=4"):
        prepare(parse_train_args([*argv, "--resume", "auto", "--lora-r", "4"]), "train", world_size=2)
    # 2. resumed: steps 4-6 equal the uninterrupted run's
    run(ranks_module(2, "ds_packdpo.train", *argv, "--resume", "auto"))
    resumed = read_metrics(killed / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    largest = assert_same_steps(resumed, reference, range(1, 7))

    # 3. the step-3 checkpoint as a peft adapter and as a merged model: both give the log-probs the engine logged
    #    at step 4 (logps/* of a step are the policy's before that step's update)
    checkpoint = straight / "straight" / "checkpoints" / "global_step3"
    adapter, merged = straight / "adapter", straight / "merged"
    capsys.readouterr()
    with warnings.catch_warnings(record=True) as caught:  # transformers' is_gradient_checkpointing FutureWarning
        warnings.simplefilter("always")                    # (a LoRA export) was shown: none now
        assert cli.main(["export", "--checkpoint", str(checkpoint), "--out", str(adapter), "--adapter-only"]) == 0
        assert cli.main(["export", "--checkpoint", str(checkpoint), "--out", str(merged)]) == 0
    assert not [w for w in caught if issubclass(w.category, FutureWarning)], [str(w.message) for w in caught]
    assert "FutureWarning" not in capsys.readouterr().err
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in adapter.iterdir()}
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == str(
        (straight / "base").resolve())
    merged_model = AutoModelForCausalLM.from_pretrained(merged)
    assert not any("lora" in name for name in merged_model.state_dict())  # a plain HF model
    adapter_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(straight / "base"), adapter)
    via_adapter = step_sequence_logps(adapter_model, straight, 4)
    via_merged = step_sequence_logps(merged_model, straight, 4)
    torch.testing.assert_close(via_merged, via_adapter, rtol=1e-5, atol=1e-4)
    engine = reference[3]
    for logps in (via_adapter, via_merged):
        assert float(logps[0::2].mean()) == pytest.approx(engine["logps/chosen"], rel=1e-5)
        assert float(logps[1::2].mean()) == pytest.approx(engine["logps/rejected"], rel=1e-5)
    base = step_sequence_logps(AutoModelForCausalLM.from_pretrained(straight / "base"), straight, 4)
    assert (base - via_adapter).abs().max() > 1e-2  # the adapters trained something the export kept
    with capsys.disabled():
        print(f"LoRA, 2 ranks, resumed vs uninterrupted: largest metric difference {largest}; exported adapter and "
              f"merged model vs engine at step 4, logps/chosen: {float(via_adapter[0::2].mean()) - engine['logps/chosen']:.3g}"
              f", {float(via_merged[0::2].mean()) - engine['logps/chosen']:.3g}")
    # 4. --adapter-only of a full fine-tuning checkpoint is refused in one line
    full = straight / "full_checkpoint"
    shutil.copytree(checkpoint, full)
    (full / "hf" / "adapter_config.json").unlink()
    write_manifest(full)  # a whole checkpoint, as a full fine-tuning run writes it
    assert cli.main(["export", "--checkpoint", str(full), "--out", str(straight / "refused"), "--adapter-only"]) == 2
    assert "was trained without LoRA" in capsys.readouterr().err and not (straight / "refused").exists()
