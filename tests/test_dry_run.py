"""``ds-packdpo train --dry-run``: phase one, the plan line and a per-GPU memory estimate; nothing starts, nothing is
written (run/memory_estimate.py).  How the estimate compares with a measured peak: scripts/memory_estimate_check.py
(figures in the README)."""

from __future__ import annotations


import time

import pytest
import torch.distributed as dist
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

from ds_packdpo import cli
from ds_packdpo.config import parse_train_args
from ds_packdpo.data import run_plan
from ds_packdpo.model.build import build_model
from ds_packdpo.model.logps import auto_chunk_tokens
from ds_packdpo.model.lora import add_adapters
from ds_packdpo.run.assemble import lora_settings, prepare
from ds_packdpo.run.memory_estimate import (OPTIMIZER_BYTES_PER_PARAMETER, describe_estimate, estimate_memory,
                                            layer_activation_elements, parameter_counts)

from test_bad_input import assert_one_line_error


def test_dry_run_prints_the_plan_and_the_estimate_and_starts_nothing(tmp_path, no_launch, capsys):
    out = tmp_path / "run"
    flags = ["train", "--output-dir", str(out), "--cache-dir", str(tmp_path / "cache"), "--synthetic-pairs", "48",
             "--global-batch-pairs", "12", "--max-length", "96", "--num-procs", "2"]
    assert cli.main([*flags, "--dry-run"]) == 0  # the first call tokenizes (the cache a real run would fill)
    capsys.readouterr()
    began = time.perf_counter()
    assert cli.main([*flags, "--dry-run", "--gradient-checkpointing"]) == 0
    seconds = time.perf_counter() - began
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("plan: 48 pairs in 4 steps (48 training pairs), 1 row per rank on 2 ranks")
    assert lines[1].startswith("memory per GPU (estimate): ") and "with activation checkpointing)" in lines[1]
    assert "254,272 parameters over 2 ranks" in lines[1] and "; without activation checkpointing " in lines[1]
    assert seconds < 10, seconds
    assert not out.exists() and not dist.is_initialized()
    # bad input is still one line, before anything
    assert cli.main([*flags, "--dry-run", "--lr", "-1"]) == 2
    assert_one_line_error(2, capsys.readouterr().err, "--lr and --beta must be > 0")


def test_estimate_parts(tmp_path):
    """The parameter counts are the model's own (built on the meta device); the parts move with the settings they
    depend on."""
    def estimate(*flags):
        cfg = parse_train_args(["--output-dir", str(tmp_path / "o"), "--cache-dir", str(tmp_path / "cache"),
                                "--synthetic-pairs", "16", "--max-length", "64", *flags])
        return estimate_memory(prepare(cfg, "train", world_size=2))

    base = estimate()
    setup_vocab = prepare(parse_train_args(["--output-dir", str(tmp_path / "o"), "--cache-dir", str(tmp_path / "cache"),
                                            "--synthetic-pairs", "16", "--max-length", "64"]), world_size=1).vocab_size
    model = build_model(None, "tiny", setup_vocab, None, "sdpa", seed=0)
    assert base["parameters"] == sum(p.numel() for p in model.parameters())
    assert parameter_counts(model.config)[1] == max(sum(p.numel() for p in m.parameters(recurse=False))
                                                    for m in model.modules())
    acts = base["activations"]
    assert acts["checkpointed"] < acts["full"]
    assert acts["full"] == ((model.config.num_hidden_layers + 1) * base["row_tokens"]
                            * layer_activation_elements(model.config) * 4 + 2 * base["row_tokens"] * 64 * 4)
    auto = auto_chunk_tokens(base["row_tokens"], model.config.hidden_size, setup_vocab, 4)  # the default: auto, fp32
    assert base["logps_chunk"] == 3 * min(auto, base["row_tokens"]) * setup_vocab * 4
    assert estimate("--logps-chunk-tokens", "16")["logps_chunk"] == 3 * 16 * setup_vocab * 4
    checkpointed = estimate("--gradient-checkpointing")
    assert checkpointed["total"] == base["total_other_checkpointing"] < base["total"]
    assert estimate("--max-tokens-per-row", "512")["activations"]["full"] == pytest.approx(
        acts["full"] * 512 / base["row_tokens"])
    assert estimate("--dtype", "bf16")["activations"]["full"] == acts["full"] // 2
    assert estimate("--ref-offload")["reference_weights"] == 0 < base["reference_weights"]
    assert estimate("--ref-whole")["reference_weights"] == 2 * base["reference_weights"]  # on each of the 2 ranks
    assert estimate("--loss", "simpo")["reference_weights"] == 0


@pytest.mark.parametrize("ds_config", ["zero3", "zero2"])
def test_a_lora_estimate_counts_optimizer_states_of_the_adapters_alone(tmp_path, ds_config):
    """--lora-r trains the adapters alone, but the estimate counted gradients, fp32 master weights and Adam moments
    for every parameter (a full fine-tuning's states).  Now the frozen base counts as weights alone (--dtype,
    partitioned as ZeRO partitions them), the optimizer's 12 bytes per parameter only for the trainable ones, counted
    here on the real peft model built on the tiny config; the states of full fine-tuning are still DeepSpeed's own
    ZeRO-3 estimator's figure."""
    def estimate(*flags):
        cfg = parse_train_args(["--output-dir", str(tmp_path / "o"), "--cache-dir", str(tmp_path / "cache"),
                                "--synthetic-pairs", "16", "--max-length", "64", "--ds-config", ds_config, *flags])
        return cfg, estimate_memory(prepare(cfg, "train", world_size=2))

    _, full = estimate()
    cfg, lora = estimate("--lora-r", "4", "--lora-target-modules", "q_proj,v_proj")
    model = add_adapters(build_model(None, "tiny", prepare(cfg, world_size=1).vocab_size, None, "sdpa", seed=0),
                         lora_settings(cfg))
    parameters = {id(p): p for p in model.parameters()}.values()
    trainable = sum(p.numel() for p in parameters if p.requires_grad)
    total = sum(p.numel() for p in parameters)
    assert 0 < trainable < total / 20
    assert (lora["trainable_parameters"], lora["parameters"]) == (trainable, total)
    assert lora["optimizer_states"] == OPTIMIZER_BYTES_PER_PARAMETER * trainable // 2
    assert full["optimizer_states"] == OPTIMIZER_BYTES_PER_PARAMETER * full["parameters"] // 2
    zero3 = ds_config == "zero3"
    assert lora["frozen_weights"] == (total - trainable) * 4 // (2 if zero3 else 1)  # fp32, partitioned by ZeRO-3
    largest = full["largest_layer_parameters"]
    trained_states = estimate_zero3_model_states_mem_needs(trainable, largest, 2, cpu_offload=False)[1]
    full_states = estimate_zero3_model_states_mem_needs(full["parameters"], largest, 2, cpu_offload=False)[1]
    extra = 0 if zero3 else 2  # ZeRO 0-2 keep every 16-bit weight trained on every rank
    assert lora["model_states"] == trained_states + extra * trainable + lora["frozen_weights"]
    assert full["model_states"] == full_states + extra * full["parameters"]
    assert lora["model_states"] < full["model_states"] / 2 and lora["total"] < full["total"]
    assert lora["reference_weights"] == 0  # the reference is the policy with its adapters off
    line = describe_estimate(lora)
    assert f"{trainable:,} trainable of {total:,} parameters over 2 ranks, their optimizer states " in line


def test_max_steps_extends_the_default_epochs_and_given_epochs_cap_it_said(tmp_path, no_launch, capsys,
                                                                          monkeypatch):
    """48 pairs of 12 per step: 4 steps an epoch.  --max-steps 6 alone runs 6 (a second pass over the data planned);
    with --epochs 1 the epoch caps it at 4, and the plan line says so (it ran 4 of 6 without a word); with many
    epochs given only those the 6 steps reach are planned."""
    flags = ["train", "--output-dir", str(tmp_path / "run"), "--cache-dir", str(tmp_path / "cache"),
             "--synthetic-pairs", "48", "--global-batch-pairs", "12", "--max-length", "96", "--num-procs", "2",
             "--dry-run", "--max-steps", "6"]
    assert cli.main(flags) == 0
    assert capsys.readouterr().out.startswith("plan: 72 pairs in 6 steps (48 training pairs), ")
    assert cli.main([*flags, "--epochs", "1"]) == 0
    assert capsys.readouterr().out.startswith(
        "plan: 48 pairs in 4 steps (--epochs 1 holds only these of --max-steps 6; leave --epochs out to run them all) "
        "(48 training pairs), ")
    assert cli.main([*flags, "--epochs", "2"]) == 0  # the epochs hold more: --max-steps cuts, nothing to say
    assert capsys.readouterr().out.startswith("plan: 72 pairs in 6 steps (48 training pairs), ")
    counted = []  # the epochs whose steps phase one counts: two, not the 100,000 given
    with monkeypatch.context() as patched:
        patched.setattr(run_plan, "steps_per_epoch", lambda *a, **k: counted.append(k["epoch"]) or 4)
        assert cli.main([*flags, "--epochs", "100000"]) == 0
    assert capsys.readouterr().out.startswith("plan: 72 pairs in 6 steps (48 training pairs), ")
    assert counted and set(counted) == {0, 1}
    # --max-steps far beyond the data: one line at once, not hours of planning epoch after epoch in phase one
    assert cli.main([*flags[:-1], str(2**31 - 1)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: --max-steps {2**31 - 1}: these pairs hold 4 steps an epoch, so it needs about {2**29:,} epochs; "
        "--max-steps alone extends the epochs to at most 1,000 (give --epochs N as well to run longer)")
    assert cli.main([*flags[:-1], "4000"]) == 0  # 1,000 epochs: planned
