"""The shard-at-a-time Hugging Face writer against save_pretrained (the multi-rank export test reads a ZeRO-3
checkpoint through it: tests/test_checkpoint.py)."""

from __future__ import annotations

import json
import weakref

import pytest
import torch
from transformers import AutoModelForCausalLM

from ds_packdpo.data.tokenizer import train_bpe_tokenizer
from ds_packdpo.errors import InputError
from ds_packdpo.model.build import tiny_config
from ds_packdpo.model.hf_folder import INDEX_FILE, WeightsSource, in_memory_weights, write_hf_folder

SHARD = "60KB"  # the tied tiny model below is ~200 KB in fp32: several shards


@pytest.fixture(scope="module")
def tied_model():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(vocab_size=300, tie_word_embeddings=True)).eval()


@pytest.fixture(scope="module")
def tokenizer():
    return train_bpe_tokenizer(["hello world, a small text to learn a few merges"] * 4, vocab_size=300)


def test_writer_equals_save_pretrained_shard_for_shard(tmp_path, tied_model, tokenizer):
    """Same shards byte for byte, same index and config as save_pretrained at the same --max-shard-size; tied weights
    written once; every tensor loads back; the folder is complete."""
    tied_model.save_pretrained(tmp_path / "reference", max_shard_size=SHARD)
    written = write_hf_folder(tmp_path / "ours", in_memory_weights(tied_model.state_dict()), tied_model.config,
                              tokenizer, torch.float32, SHARD)
    ours, reference = tmp_path / "ours", tmp_path / "reference"
    shards = sorted(p.name for p in reference.glob("*.safetensors"))
    assert len(shards) >= 3 and written["files"] == shards == sorted(p.name for p in ours.glob("*.safetensors"))
    for name in shards:
        assert (ours / name).read_bytes() == (reference / name).read_bytes(), name
    for name in (INDEX_FILE, "config.json", "generation_config.json"):
        assert json.loads((ours / name).read_text()) == json.loads((reference / name).read_text()), name
    index = json.loads((ours / INDEX_FILE).read_text())
    assert "lm_head.weight" not in index["weight_map"]  # tied to the embedding: written once
    loaded = AutoModelForCausalLM.from_pretrained(ours)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    want = tied_model.state_dict()
    assert all(torch.equal(tensor, want[name]) for name, tensor in loaded.state_dict().items())
    assert (ours / "tokenizer.json").is_file() and not list(tmp_path.glob(".ours.*"))


def test_writer_casts_one_tensor_at_a_time(tmp_path, tied_model, tokenizer):
    """bf16: the exact cast of every weight; the source is asked for one shard's names at a time, and the fp32
    tensor it made is gone (cast) before it makes the next one."""
    state = tied_model.state_dict()
    asked, made = [], []

    def load(names):
        asked.append(list(names))
        for name in names:
            assert all(made_tensor() is None for made_tensor in made)  # every earlier fp32 tensor was freed
            tensor = state[name].clone()
            made.append(weakref.ref(tensor))
            yield name, tensor
            del tensor

    write_hf_folder(tmp_path / "bf16", WeightsSource(in_memory_weights(state).specs, load), tied_model.config,
                    tokenizer, torch.bfloat16, SHARD)
    assert len(asked) >= 3 and sorted(sum(asked, [])) == sorted(n for n in state if n != "lm_head.weight")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    assert loaded.dtype == torch.bfloat16
    assert all(torch.equal(tensor, state[name].to(torch.bfloat16)) for name, tensor in loaded.state_dict().items())


def test_writer_refuses_weights_of_another_model(tmp_path, tied_model, tokenizer):
    state = dict(tied_model.state_dict())
    state.pop("model.norm.weight")
    with pytest.raises(InputError, match=r"^--checkpoint X: do not fit the model of the config \(LlamaForCausalLM\): "
                                         r"missing \['model.norm.weight'\]"):
        write_hf_folder(tmp_path / "out", in_memory_weights(state), tied_model.config, tokenizer, torch.float32,
                        where="--checkpoint X")
    with pytest.raises(InputError, match="--max-shard-size 12: not a size such as 5GB"):
        write_hf_folder(tmp_path / "out", in_memory_weights(state), tied_model.config, tokenizer, torch.float32, "12")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_every_file_written_follows_the_umask(tmp_path, tied_model, tokenizer, umask):
    """safetensors wrote model*.safetensors (and peft's adapter_model.safetensors, through the same atomic_folder)
    0600 while the rest of the folder was 0644: on a shared cluster folder others could not read the weights.  Every
    file of a written folder, and a file written whole (atomic_write: mkstemp's 0600), now follows the umask."""
    import os

    from ds_packdpo.files import atomic_write

    previous = os.umask(umask)
    try:
        write_hf_folder(tmp_path / "out", in_memory_weights(tied_model.state_dict()), tied_model.config, tokenizer,
                        torch.float32, SHARD)
        atomic_write(tmp_path / "one.json", lambda temporary: open(temporary, "w").write("{}"))
    finally:
        os.umask(previous)
    files = [*(tmp_path / "out").iterdir(), tmp_path / "one.json"]
    assert any(f.name.endswith(".safetensors") for f in files)
    assert {f.name: oct(f.stat().st_mode & 0o777) for f in files} == {f.name: oct(0o666 & ~umask) for f in files}
    assert oct((tmp_path / "out").stat().st_mode & 0o777) == oct(0o777 & ~umask)
