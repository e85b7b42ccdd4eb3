"""Models a rank could not run, refused in phase one in one line: a folder without its weight files, a vocabulary
smaller than the tokenizer's (config or embedding), a config that builds but cannot run a forward."""

from __future__ import annotations

import json

import pytest
from test_bad_input import assert_one_line_error, tokenizer_dir  # noqa: F401  (a fixture)
from transformers import AutoModelForCausalLM

from ds_packdpo import cli
from ds_packdpo.model.build import tiny_config
from ds_packdpo.model.config_rules import forward_rule_broken


def save_model(folder, tokenizer, vocab_size: int):
    AutoModelForCausalLM.from_config(tiny_config(vocab_size=vocab_size)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def front(tmp_path, capsys, *flags: str) -> str:
    code = cli.main(["train", "--output-dir", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache"),
                     "--synthetic-pairs", "16", "--max-length", "64", *flags])
    return assert_one_line_error(code, capsys.readouterr().err)


def test_folder_without_its_weight_files_is_refused(tmp_path, demo_tokenizer, no_launch, capsys):
    folder = save_model(tmp_path / "model", demo_tokenizer, len(demo_tokenizer))
    (folder / "model.safetensors").unlink()
    assert front(tmp_path, capsys, "--model", str(folder)) == (
        f"error: --model {folder}: no weight files (model.safetensors, pytorch_model.bin, "
        f"model.safetensors.index.json, pytorch_model.bin.index.json)")


def test_sharded_folder_missing_a_shard_is_refused(tmp_path, demo_tokenizer, no_launch, capsys):
    folder = tmp_path / "model"
    AutoModelForCausalLM.from_config(tiny_config(vocab_size=len(demo_tokenizer))).save_pretrained(
        folder, max_shard_size="200KB")
    demo_tokenizer.save_pretrained(folder)
    shards = sorted(folder.glob("model-*.safetensors"))
    shards[-1].unlink()
    assert front(tmp_path, capsys, "--model", str(folder)).endswith(
        f"model.safetensors.index.json names 1 missing weight file(s): {shards[-1].name}")


def test_vocab_smaller_than_its_own_tokenizer_is_refused(tmp_path, demo_tokenizer, no_launch, capsys):
    folder = save_model(tmp_path / "model", demo_tokenizer, len(demo_tokenizer) - 8)
    message = front(tmp_path, capsys, "--model", str(folder))
    assert message == (f"error: --model {folder}: the config's vocab_size {len(demo_tokenizer) - 8} is smaller than "
                       f"the {len(demo_tokenizer)} tokens of its own tokenizer: token ids >= "
                       f"{len(demo_tokenizer) - 8} would index past the embedding (the folder's config/weights and "
                       f"tokenizer do not belong together)")
    assert "use the model's own tokenizer" not in message


def test_embedding_smaller_than_the_tokenizer_is_refused_when_the_config_says_otherwise(
        tmp_path, demo_tokenizer, tokenizer_dir, no_launch, capsys):  # noqa: F811
    folder = save_model(tmp_path / "model", demo_tokenizer, len(demo_tokenizer) - 8)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": len(demo_tokenizer)}))
    assert front(tmp_path, capsys, "--model", str(folder), "--tokenizer", str(tokenizer_dir)).endswith(
        f"the embedding's row count {len(demo_tokenizer) - 8} is smaller than the {len(demo_tokenizer)} tokens of "
        f"the tokenizer: token ids >= {len(demo_tokenizer) - 8} would index past the embedding (pass the model's "
        f"own tokenizer (drop --tokenizer))")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gemma3"])
def test_config_that_builds_but_cannot_run_a_forward_is_refused_with_its_rule(tmp_path, arch, no_launch, capsys):
    """4 query heads over 3 key/value heads builds (transformers checks neither) and dies in the first attention."""
    config = tiny_config(arch, vocab_size=4096, heads=4, kv_heads=3)
    AutoModelForCausalLM.from_config(config)  # it builds
    path = tmp_path / "config.json"
    config.save_pretrained(tmp_path)
    assert front(tmp_path, capsys, "--model-config", str(path)) == (
        f"error: --model-config {path}: the model config cannot run a forward: num_attention_heads 4 is not a "
        f"multiple of num_key_value_heads 3 (grouped-query attention shares each key/value head among a whole "
        f"number of query heads)")


def test_forward_rules():
    """Each rule on a config object (transformers' own validation refuses some of these as it builds the config)."""
    config = tiny_config("llama")
    assert forward_rule_broken(config) is None
    for change, rule in [({"num_hidden_layers": 0}, "num_hidden_layers must be a positive integer, got 0"),
                         ({"head_dim": None, "hidden_size": 66}, "hidden_size 66 is not a multiple of "
                                                                 "num_attention_heads 4 (and no head_dim is given)"),
                         ({"head_dim": 15}, "the rotary embedding's width 15 (head_dim 15) is odd; rotary embeddings "
                                            "need it even")]:
        changed = tiny_config("llama")
        for key, value in change.items():
            object.__setattr__(changed, key, value)
        assert forward_rule_broken(changed) == rule, change
