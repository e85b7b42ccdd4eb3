"""--compile-layers and --liger-kernels (model/kernels.py): the same log-probs and gradients as eager, rows of new
lengths without recompiling, and liger's fallback off a GPU.

The compiled layers run here with the ``aot_eager`` backend (dynamo's graphs and AOT autograd's joint graph, run by
torch's eager kernels): the run's inductor works on this CPU too, but its first compile of even a tiny model takes
~90 s on the shared test machine (2026-12-07: 5 graphs, no recompile over 5 row lengths, log-prob sums within 5e-7
nats and gradients within 6.5e-7 of their scale, fp32), too long for the suite."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from transformers import AutoModelForCausalLM

from ds_packdpo.config import parse_train_args
from ds_packdpo.errors import InputError
from ds_packdpo.model import kernels
from ds_packdpo.model.attention import attn_implementation
from ds_packdpo.model.build import ModelSpec, tiny_config
from ds_packdpo.model.collate import collate_packed
from ds_packdpo.model.guard import synthetic_pairs
from ds_packdpo.model.logps import forward_logps
from ds_packdpo.run import assemble
from ds_packdpo.run.engines import load_model

VOCAB = 300


def _model():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=VOCAB),
                                            attn_implementation=attn_implementation("sdpa_varlen"))


def test_compiled_layers_are_exact_and_rows_of_new_lengths_do_not_recompile():
    graphs = []

    def counting(gm, example_inputs):  # aot_eager, counting each graph it is handed (a recompile is a new one)
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    torch._dynamo.reset()
    eager, compiled = _model(), _model()
    assert kernels.compile_decoder_layers(compiled, backend=counting) == 2
    pairs = synthetic_pairs(8, VOCAB, seed=1)
    counts, lengths = [], []
    for rows in ([0, 1], [2, 3, 4], [5], [6, 7]):  # packed rows of 4 different lengths
        batch = collate_packed([pairs[i] for i in rows], rows, 0)
        results = []
        for model in (eager, compiled):
            model.zero_grad()
            out = forward_logps(model, batch, "sdpa_varlen", chunk_tokens=16)
            out.logps.sum().backward()
            results.append((out.logps.detach(), [p.grad.clone() for p in model.parameters()]))
        (want, want_grads), (got, got_grads) = results
        tokens = batch.input_ids.shape[1]
        assert (got - want).abs().max().item() <= 1e-6 * tokens, rows  # per-sequence sums, fp32
        for g, w in zip(got_grads, want_grads, strict=True):
            assert (g - w).abs().max().item() <= 1e-5 * max(w.abs().max().item(), 1e-12)
        counts.append(len(graphs))
        lengths.append(tokens)
    assert len(set(lengths)) == 4
    assert counts[0] > 0 and counts == [counts[0]] * 4, counts  # compiled once, reused at every new length


def test_liger_falls_back_off_a_gpu_in_one_line_and_is_refused_on_one_without_the_package(monkeypatch, capsys):
    flags = parse_train_args(["--liger-kernels"])
    assert assemble.liger_kernels(parse_train_args(["--no-liger-kernels"]), "cpu") is False
    assert assemble.liger_kernels(flags, "cpu") is False
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--liger-kernels: liger-kernel's Triton kernels run on CUDA only" in err
    monkeypatch.setattr(kernels.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(assemble, "liger_obstacle", kernels.liger_obstacle)
    with pytest.raises(InputError, match="--liger-kernels: the liger-kernel package is not installed"):
        assemble.liger_kernels(flags, "cuda")


def test_liger_patches_norm_swiglu_rotary_and_leaves_the_log_prob_stage(monkeypatch):
    """On a GPU with the package: the model's architecture function of liger-kernel, its cross-entropy off."""
    calls = []
    fake = types.ModuleType("liger_kernel.transformers")
    fake._apply_liger_kernel_to_instance = lambda **kwargs: calls.append(kwargs)
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", fake)
    monkeypatch.setattr(kernels.importlib.util, "find_spec", lambda name: object())
    assert assemble.liger_kernels(parse_train_args(["--liger-kernels"]), "cuda") is True
    model = _model()
    kernels.apply_liger_kernels(model)
    assert calls == [{"model": model, "rope": True, "rms_norm": True, "swiglu": True, "cross_entropy": False,
                      "fused_linear_cross_entropy": False}]


@pytest.mark.parametrize("compile_layers", [True, False])
def test_the_flag_compiles_the_built_model_s_layers(compile_layers):
    """--compile-layers / --no-compile-layers: the model a run builds (engines.load_model) has compiled layers or not."""
    spec = ModelSpec(path=None, config="tiny", reference=None, revision=None, trust_remote_code=False, dtype="fp32",
                     seed=0, lora=None, gradient_checkpointing=False, compile_layers=compile_layers)
    model = load_model(spec, None, VOCAB, "sdpa_varlen")
    compiled = [hasattr(layer.forward, "_torchdynamo_orig_callable") for layer in kernels.decoder_layers(model)]
    assert compiled == [compile_layers] * 2
