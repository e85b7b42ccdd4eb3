"""Backend resolution, forward kwargs (flash varlen included), model building, and the exactness guard."""

from __future__ import annotations

import inspect
import json

import pytest
import torch

from ds_packdpo.model import attention
from ds_packdpo import check as check_command
from ds_packdpo import cli
from ds_packdpo.config import config_from_args
from ds_packdpo.model.attention import ATTN_CHOICES, model_forward_kwargs, resolve_attn
from ds_packdpo.model.collate import collate_packed, collate_padded
from ds_packdpo.errors import InputError
from ds_packdpo.check import run_check
from ds_packdpo.model.build import build_model, load_model_config, tiny_config
from ds_packdpo.model.guard import assert_packing_exact, packing_exactness, synthetic_pairs
from ds_packdpo.errors import PackingNotExactError

VOCAB = 256
PAIRS = [
    {"prompt_ids": [5, 6, 7], "chosen_ids": [8, 9], "rejected_ids": [10, 11, 12, 13]},
    {"prompt_ids": [14, 15], "chosen_ids": [16, 17, 18], "rejected_ids": [19]},
]


@pytest.fixture(scope="module")
def tiny_llama():
    return build_model(None, "tiny", VOCAB, torch.float32, "sdpa", seed=0)


class CrossAttending(torch.nn.Module):
    """A model call that breaks transformers' per-sequence mask: a cache, or an explicit all-ones mask.

    The HF model sits in ``.module``, as in a DeepSpeed engine (the guard reaches its config there)."""

    def __init__(self, model, how: str):
        super().__init__()
        self.module, self.how = model, how

    def forward(self, **kwargs):
        if self.how == "cache":
            kwargs["use_cache"] = True
        else:
            kwargs["attention_mask"] = torch.ones_like(kwargs["input_ids"])
        return self.module(**kwargs)


# ---- backend resolution -------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["sdpa", "eager"])
def test_cpu_backends_resolve_to_themselves(name):
    assert resolve_attn(name, "cpu") == name
    assert resolve_attn(name, "cuda") == name


def test_auto_is_flash_on_cuda_when_importable_else_sdpa_varlen(monkeypatch):
    assert resolve_attn("auto", "cpu") == "sdpa_varlen"
    monkeypatch.setattr(attention, "flash_attention_available", lambda name: False)
    assert resolve_attn("auto", "cuda") == "sdpa_varlen"
    monkeypatch.setattr(attention, "flash_attention_available", lambda name: name == "flash_attention_2")
    assert resolve_attn("auto", "cuda") == "flash_attention_2"
    assert resolve_attn("auto", "cpu") == "sdpa_varlen"
    assert resolve_attn("flash_attention_2", "cuda") == "flash_attention_2"


def test_flash_is_not_importable_here():
    # the real probe (no import of flash_attn): this machine has neither CUDA nor flash-attn
    assert not attention.flash_attention_available("flash_attention_2")
    assert not attention.flash_attention_available("flash_attention_3")


@pytest.mark.parametrize("name, device, needle", [
    ("flash", "cpu", "unknown backend 'flash'"),
    ("flash_attention_2", "cpu", "needs a CUDA device"),
    ("flash_attention_3", "cpu", "needs a CUDA device"),
    ("flash_attention_2", "cuda", "not installed"),
    ("flex_attention", "cpu", "no FlexAttention backward on CPU"),
])
def test_bad_backend_is_one_line_input_error_naming_attn(name, device, needle, monkeypatch):
    monkeypatch.setattr(attention, "flash_attention_available", lambda _: False)
    with pytest.raises(InputError) as info:
        resolve_attn(name, device)
    message = str(info.value)
    assert message.startswith("--attn") and needle in message and "\n" not in message
    if needle.startswith("unknown"):
        assert all(choice in message for choice in ATTN_CHOICES)


def test_dtype_auto_and_flash_needs_half_precision(monkeypatch):
    """--dtype auto is bf16 on CUDA and fp32 on CPU; auto attention never picks flash for fp32, and an explicit
    flash backend with fp32 is refused at once, in one line naming both flags."""
    from ds_packdpo.config import resolve_dtype

    assert [resolve_dtype("auto", d) for d in ("cuda", "cpu")] == ["bf16", "fp32"]
    assert resolve_dtype("fp32", "cuda") == "fp32" and resolve_dtype("bf16", "cpu") == "bf16"
    monkeypatch.setattr(attention, "flash_attention_available", lambda name: True)
    assert resolve_attn("auto", "cuda", dtype="bf16") == "flash_attention_2"
    assert resolve_attn("auto", "cuda", dtype="fp32") == "sdpa_varlen"
    with pytest.raises(InputError) as info:
        resolve_attn("flash_attention_2", "cuda", dtype="fp32")
    message = str(info.value)
    assert message.startswith("--attn flash_attention_2 with --dtype fp32") and "--dtype bf16" in message
    assert "\n" not in message


def test_prepare_resolves_dtype_auto_on_cpu(tmp_path):
    from ds_packdpo.config import parse_train_args
    from ds_packdpo.run.assemble import prepare

    cfg = parse_train_args(["--synthetic-pairs", "16", "--max-length", "48", "--cache-dir", str(tmp_path / "c"),
                            "--output-dir", str(tmp_path / "out")])
    setup = prepare(cfg, "train", world_size=1)
    assert cfg.dtype == "auto" and setup.spec.model.dtype == "fp32" and setup.ds_config["bf16"]["enabled"] is False


def test_flex_forward_only_is_allowed_on_cpu():
    assert resolve_attn("flex_attention", "cpu", needs_backward=False) == "flex_attention"


# ---- forward kwargs -----------------------------------------------------------------------------

def test_packed_forward_kwargs_have_no_mask_and_no_cache():
    batch = collate_packed(PAIRS, [0, 1], pad_token_id=0)
    for attn in ("sdpa", "eager", "flex_attention"):
        kwargs = model_forward_kwargs(batch, attn)
        assert set(kwargs) == {"input_ids", "position_ids", "use_cache"} and kwargs["use_cache"] is False
        assert kwargs["input_ids"] is batch.input_ids and kwargs["position_ids"] is batch.position_ids


def test_packed_flash_kwargs_carry_the_varlen_boundaries():
    batch = collate_packed(PAIRS, [0, 1], pad_token_id=0)
    kwargs = model_forward_kwargs(batch, "flash_attention_2")
    lengths = [5, 7, 5, 3]  # prompt + completion of c0, r0, c1, r1
    expected = torch.tensor([0, 5, 12, 17, 20], dtype=torch.int32)
    for name in ("cu_seq_lens_q", "cu_seq_lens_k"):
        assert kwargs[name].dtype == torch.int32 and torch.equal(kwargs[name], expected)
    assert kwargs["max_length_q"] == kwargs["max_length_k"] == max(lengths)
    assert type(kwargs["max_length_q"]) is int  # a python int: no device->host sync in the kernel call
    assert "attention_mask" not in kwargs and kwargs["use_cache"] is False
    # the names are the ones transformers' flash path reads
    from transformers.modeling_flash_attention_utils import _flash_attention_forward

    assert set(kwargs) - {"input_ids", "position_ids", "use_cache"} <= set(
        inspect.signature(_flash_attention_forward).parameters)


def test_padded_forward_kwargs_keep_the_mask_even_for_flash():
    batch = collate_padded(PAIRS, [0, 1], pad_token_id=0)
    for attn in ("sdpa", "flash_attention_2"):
        kwargs = model_forward_kwargs(batch, attn)
        assert kwargs["attention_mask"] is batch.attention_mask and kwargs["use_cache"] is False
        assert "cu_seq_lens_q" not in kwargs


# ---- building models ----------------------------------------------------------------------------

@pytest.mark.parametrize("name, model_type", [("tiny", "llama"), ("tiny-qwen2", "qwen2")])
def test_tiny_configs(name, model_type):
    config = load_model_config(name, 300)
    assert config.model_type == model_type and config.vocab_size == 300
    assert config.num_key_value_heads < config.num_attention_heads  # grouped-query attention exercised
    assert tiny_config("qwen2", layers=3, rope_theta=1234.0).num_hidden_layers == 3


def test_build_from_config_is_seeded_and_leaves_global_rng_alone():
    state = torch.random.get_rng_state()
    a = build_model(None, None, 64, torch.float32, "eager", seed=3)
    b = build_model(None, "tiny", 64, torch.float32, "eager", seed=3)
    c = build_model(None, "tiny", 64, torch.float32, "eager", seed=4)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    assert a.config._attn_implementation == "eager" and a.dtype == torch.float32


def test_build_from_folder_and_config_path(tmp_path, tiny_llama):
    tiny_llama.save_pretrained(tmp_path / "m")
    loaded = build_model(str(tmp_path / "m"), None, VOCAB, torch.float32, "eager")
    assert torch.equal(loaded.lm_head.weight, tiny_llama.lm_head.weight)
    assert load_model_config(str(tmp_path / "m"), VOCAB).hidden_size == 64
    assert load_model_config(str(tmp_path / "m" / "config.json"), 10).vocab_size == VOCAB


def test_model_input_errors(tmp_path):
    def message(call):
        with pytest.raises(InputError) as info:
            call()
        assert "\n" not in str(info.value)
        return str(info.value)

    assert "no such folder" in message(lambda: build_model(str(tmp_path / "nope"), None, 10, torch.float32, "sdpa"))
    assert "no config.json" in message(lambda: build_model(str(tmp_path), None, 10, torch.float32, "sdpa"))
    assert message(lambda: load_model_config(str(tmp_path / "x.json"), 10)).startswith("--model-config")
    (tmp_path / "bad.json").write_text('{"hidden_size": 3}')
    assert "unreadable" in message(lambda: load_model_config(str(tmp_path / "bad.json"), 10))
    (tmp_path / "cut.json").write_text('{"model_type": "lla')
    assert "unreadable" in message(lambda: load_model_config(str(tmp_path / "cut.json"), 10))
    tiny_config("llama", vocab_size=100).save_pretrained(tmp_path / "small")
    assert "vocab_size 100" in message(lambda: load_model_config(str(tmp_path / "small"), 500))


# ---- the guard ----------------------------------------------------------------------------------

@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_guard_passes_for_exact_backends(attn):
    model = build_model(None, "tiny-qwen2", VOCAB, torch.float32, attn, seed=1)
    result = packing_exactness(model, synthetic_pairs(3, VOCAB, seed=2), attn, pad_token_id=0)
    assert result["ok"] and result["max_abs_diff_logps"] < 1e-5 and result["pairs"] == 3
    assert result["attn"] == attn and result["dtype"] == "float32" and result["tolerance_per_token"] == 1e-5
    assert result["reference"] == "eager, one sequence at a time"
    assert assert_packing_exact(model, attn, VOCAB, 0)["ok"]


@pytest.mark.parametrize("how", ["cache", "ones_mask"])
def test_guard_catches_cross_contamination(tiny_llama, how):
    broken = CrossAttending(tiny_llama, how)
    result = packing_exactness(broken, synthetic_pairs(2, VOCAB, seed=2), "sdpa", pad_token_id=0)
    assert not result["ok"] and result["max_abs_diff_logps"] > 1e-3
    with pytest.raises(PackingNotExactError) as info:
        assert_packing_exact(broken, "sdpa", VOCAB, 0)
    assert "--attn sdpa" in str(info.value) and "\n" not in str(info.value)


def test_guard_restores_training_mode_and_is_deterministic(tiny_llama):
    tiny_llama.train()
    first = assert_packing_exact(tiny_llama, "sdpa", VOCAB, 0)
    assert tiny_llama.training
    assert assert_packing_exact(tiny_llama, "sdpa", VOCAB, 0) == first
    assert synthetic_pairs(2, VOCAB, seed=5) == synthetic_pairs(2, VOCAB, seed=5)


@pytest.fixture(scope="module")
def model_and_tokenizer_folders(tmp_path_factory):
    from ds_packdpo.data.tokenizer import train_bpe_tokenizer

    root = tmp_path_factory.mktemp("check")
    tokenizer = train_bpe_tokenizer(["the quick brown fox jumps over the lazy dog"] * 20, vocab_size=300)
    tokenizer.save_pretrained(root / "tok")
    build_model(None, "tiny", len(tokenizer), torch.float32, "sdpa").save_pretrained(root / "model")
    return str(root / "model"), str(root / "tok")


def check(*argv: str) -> dict:
    """``ds-packdpo check ARGV`` as its command runs it (train's flags + --pairs)."""
    args = cli.check_parser().parse_args(list(argv))
    return run_check(config_from_args(args), pairs=args.pairs)


def test_run_check_reports_json_and_ok(model_and_tokenizer_folders):
    model_dir, tok_dir = model_and_tokenizer_folders
    result = check("--model", model_dir, "--tokenizer", tok_dir, "--pairs", "3")
    assert result["ok"] and result["attn"] == "sdpa_varlen" and result["requested_attn"] == "auto"
    assert result["dataset"] == "synthetic" and result["pairs"] == 3 and result["dtype"] == "float32"  # auto on CPU
    assert json.loads(json.dumps(result)) == result
    # sdpa_varlen runs prefix-shared rows: check compares those with each sequence alone too
    shared = result["prefix_sharing"]
    assert shared["ok"] and shared["layout"] == "shared-prefix" and shared["max_abs_diff_logps"] <= 1e-5
    eager = check("--model", model_dir, "--tokenizer", tok_dir, "--attn", "eager", "--pairs", "1", "--dtype", "bf16")
    assert eager["ok"] and eager["prefix_sharing"] is None  # eager's masks cannot share prefixes: packing alone


def test_run_check_not_ok_for_a_cross_attending_model(model_and_tokenizer_folders, monkeypatch):
    model_dir, tok_dir = model_and_tokenizer_folders
    real_model = check_command.model_alone
    monkeypatch.setattr(check_command, "model_alone", lambda setup: CrossAttending(real_model(setup), "cache"))
    assert not check("--model", model_dir, "--tokenizer", tok_dir, "--attn", "sdpa", "--pairs", "2")["ok"]


def test_check_takes_train_data_flags_and_scales_with_length(model_and_tokenizer_folders, dpo_demo_path,
                                                           monkeypatch):
    """check sees the sequences a run with these flags sees (--max-length cuts them), and its per-token tolerance
    passes an exact kernel on a long real pair (two ~1,000-token sequences) while a cross-attending model fails on
    the same pair."""
    model_dir, tok_dir = model_and_tokenizer_folders
    data = ["--model", model_dir, "--tokenizer", tok_dir, "--dataset", str(dpo_demo_path), "--pairs", "1"]
    short = check(*data, "--max-length", "64", "--attn", "sdpa")
    long = check(*data, "--max-length", "1024", "--attn", "sdpa")
    assert short["ok"] and short["longest_sequence"] <= 64 and short["data_pairs"] == 1
    assert long["ok"] and long["longest_sequence"] > 500, long
    real_model = check_command.model_alone
    monkeypatch.setattr(check_command, "model_alone", lambda setup: CrossAttending(real_model(setup), "cache"))
    leaking = check(*data, "--max-length", "1024", "--attn", "sdpa")
    assert not leaking["ok"] and leaking["max_diff_per_token"] > 10 * leaking["tolerance_per_token"], leaking


def test_check_adds_a_pair_beyond_the_sliding_window():
    result = check("--model-config", "tiny-mistral", "--pairs", "1", "--max-length", "32")
    assert result["ok"] and result["beyond_window_pairs"] == 1 and result["sliding_window"] == 8
    assert result["longest_sequence"] > 8 and result["pairs"] == 2


@pytest.mark.parametrize("argv, needle", [(["--pairs", "0"], "--pairs"), (["--attn", "flash_attention_2"], "--attn")])
def test_run_check_input_errors(model_and_tokenizer_folders, argv, needle):
    model_dir, tok_dir = model_and_tokenizer_folders
    with pytest.raises(InputError, match=needle):
        check("--model", model_dir, "--tokenizer", tok_dir, *argv)


def varlen_reference_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """What a flash varlen kernel computes, from the kwargs alone: causal attention inside each cu_seqlens segment."""
    assert attention_mask is None
    cu = kwargs["cu_seq_lens_q"]
    assert torch.equal(cu, kwargs["cu_seq_lens_k"]) and isinstance(kwargs["max_length_q"], int)
    assert int((cu[1:] - cu[:-1]).max()) == kwargs["max_length_q"]
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    segments = [torch.nn.functional.scaled_dot_product_attention(
        query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], is_causal=True, scale=scaling)
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
    return torch.cat(segments, dim=2).transpose(1, 2).contiguous(), None


def test_flash_kwargs_reach_the_attention_layers_and_give_exact_logps():
    """The varlen kwargs built for flash flow through the HF forward to every attention call.

    flash-attn cannot run here, so a registered reference attention consumes the very
    kwargs a flash kernel would get (and nothing else: no mask, no position-derived boundaries).
    """
    from transformers import AttentionInterface

    from ds_packdpo.model.logps import sequence_logps

    AttentionInterface.register("varlen_reference", varlen_reference_attention)
    model = build_model(None, "tiny-qwen2", VOCAB, torch.float32, "varlen_reference", seed=2)
    sdpa_model = build_model(None, "tiny-qwen2", VOCAB, torch.float32, "sdpa", seed=2)
    pairs = synthetic_pairs(3, VOCAB, seed=4)
    packed = collate_packed(pairs, [0, 1, 2], 0)
    padded = collate_padded(pairs, [0, 1, 2], 0)
    with torch.no_grad():
        logits = model(**model_forward_kwargs(packed, "flash_attention_2")).logits
        varlen = sequence_logps(logits, packed.labels, packed.seq_index, packed.num_sequences)
        reference = sequence_logps(sdpa_model(**model_forward_kwargs(padded, "sdpa")).logits, padded.labels,
                                   padded.seq_index, padded.num_sequences)
    assert (varlen.logps - reference.logps).abs().max() <= 1e-4
