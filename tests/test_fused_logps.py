"""--logps-impl fused (cut-cross-entropy, CUDA): its selection and refusal, and its wiring (ZeRO-3 head call, the
sign, fp64 sums, the mean-logit metric) checked on CPU with an independent stand-in for the kernel: full logits
and F.cross_entropy.  The kernel itself is compared with lean chunks on a GPU (scripts/gpu_check.py --logps)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from ds_packdpo.config import parse_train_args
from ds_packdpo.errors import InputError
from ds_packdpo.model import fused_logps
from ds_packdpo.model.build import tiny_config
from ds_packdpo.model.collate import collate_packed, collate_shared
from ds_packdpo.model.guard import synthetic_pairs
from ds_packdpo.model.logps import forward_logps, resolve_logps_impl
from ds_packdpo.run.assemble import prepare

from test_bad_input import assert_one_line_error
from zero3_lean_check import full_logits_cross_entropy


@pytest.fixture
def kernel_installed(monkeypatch):
    monkeypatch.setattr(fused_logps, "linear_cross_entropy", full_logits_cross_entropy)


@pytest.mark.parametrize("tied", [False, True])
def test_fused_forward_equals_lean(tied, kernel_installed):
    """Packed and prefix-shared rows: per-sequence log-probs (fp64), the logits metric and every parameter's
    gradient equal the lean path's."""
    vocab = 300
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(vocab_size=vocab, tie_word_embeddings=tied),
                                             attn_implementation="sdpa")
    pairs = synthetic_pairs(3, vocab, seed=1)
    weights = torch.randn(6, generator=torch.Generator().manual_seed(2))
    for collate, attn in ((collate_packed, "sdpa"), (collate_shared, "sdpa_varlen")):
        batch = collate(pairs, [0, 1, 2], 0)
        results = {}
        for impl in ("lean", "fused"):
            model.zero_grad()
            out = forward_logps(model, batch, attn, chunk_tokens=7, impl=impl)
            (out.logps * weights).sum().backward()
            results[impl] = out, [p.grad.clone() for p in model.parameters()]
        (lean, lean_grads), (fused, fused_grads) = results["lean"], results["fused"]
        assert fused.logps.dtype == torch.float64
        torch.testing.assert_close(fused.logps, lean.logps, rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(fused.logits_sum, lean.logits_sum, rtol=1e-5, atol=1e-5)
        assert torch.equal(fused.tokens, lean.tokens)
        for got, want in zip(fused_grads, lean_grads, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_fused_gives_way_to_lean_for_a_head_with_a_bias_or_a_cap(kernel_installed, monkeypatch, capsys):
    """The fused kernel holds neither a head's bias nor a final soft-cap: lean's values instead, said in one
    ``warning:`` line the first time (console.say_warning_once)."""
    from ds_packdpo import console

    monkeypatch.setattr(console, "_SAID_IN_THIS_PROCESS", set())
    monkeypatch.setenv("RANK", "0")
    model = AutoModelForCausalLM.from_config(tiny_config(vocab_size=64), attn_implementation="sdpa")
    model.lm_head.bias = torch.nn.Parameter(torch.zeros(64))
    batch = collate_packed(synthetic_pairs(2, 64, seed=0), [0, 1], 0)
    for cause in ("a bias, an adapter or a final soft-cap", "final soft-cap"):
        fused = forward_logps(model, batch, "sdpa", impl="fused")
        torch.testing.assert_close(fused.logps, forward_logps(model, batch, "sdpa", impl="lean").logps)
        said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: fused log-probs")]
        assert len(said) == 1 and cause in said[0], said
        model.lm_head.bias = None
        model.config.final_logit_softcapping = 0.5  # Gemma's cap after the head: lean applies it, the kernel would not


def test_resolution(monkeypatch):
    """auto takes fused only where it runs; a written fused that cannot is one line naming why."""
    monkeypatch.setattr(fused_logps, "linear_cross_entropy", None)
    assert resolve_logps_impl("auto", "cuda", None, False) == "lean"
    with pytest.raises(InputError, match="cut-cross-entropy is not installed"):
        resolve_logps_impl("fused", "cuda", None, False)
    monkeypatch.setattr(fused_logps, "linear_cross_entropy", full_logits_cross_entropy)
    assert resolve_logps_impl("auto", "cuda", None, False) == "fused"
    assert resolve_logps_impl("fused", "cuda", None, False) == "fused"
    for device, cap, lora_head, why in (("cpu", None, False, "CUDA only"), ("cuda", 30.0, False, "soft-caps"),
                                        ("cuda", None, True, "LoRA adapter on the lm_head")):
        assert resolve_logps_impl("auto", device, cap, lora_head) == "lean"
        with pytest.raises(InputError, match=why):
            resolve_logps_impl("fused", device, cap, lora_head)
    assert resolve_logps_impl("lean", "cuda", None, False) == "lean"
    assert resolve_logps_impl("plain", "cuda", None, False) == "plain"


def test_phase_one_resolves_auto_and_refuses_fused_on_cpu(tmp_path, no_launch, capsys):
    from ds_packdpo import cli

    flags = ["--output-dir", str(tmp_path / "run"), "--cache-dir", str(tmp_path / "cache"), "--synthetic-pairs", "16",
             "--max-length", "64"]
    assert prepare(parse_train_args(flags), "train", world_size=1).spec.logps.impl == "lean"
    code = cli.main(["train", *flags, "--logps-impl", "fused"])
    assert_one_line_error(code, capsys.readouterr().err, "--logps-impl fused:", "CUDA", "--logps-impl lean")
    assert not (tmp_path / "run").exists()
