"""Local BPE tokenizer and the embedded synthetic preference data."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ds_packdpo.data.prepare import DataConfig, prepare_pairs, tokenizer_fingerprint
from ds_packdpo.errors import InputError
from ds_packdpo.data import synthetic
from ds_packdpo.data.synthetic import (
    BAD_WORDS,
    GOOD_WORDS,
    NEUTRAL,
    default_tokenizer,
    synthetic_corpus,
    synthetic_preference_rows,
)
from ds_packdpo.data.tokenizer import load_tokenizer, train_bpe_tokenizer

TEXTS = ["the quick brown fox jumps over the lazy dog", "a stitch in time saves nine", "hello world, hello tokenizer"] * 20


def test_bpe_training_is_deterministic():
    first, second = train_bpe_tokenizer(TEXTS, vocab_size=300), train_bpe_tokenizer(TEXTS, vocab_size=300)
    assert first.backend_tokenizer.to_str() == second.backend_tokenizer.to_str()
    assert tokenizer_fingerprint(first) == tokenizer_fingerprint(second)


def test_bpe_special_tokens_and_chat_template():
    tok = train_bpe_tokenizer(TEXTS, vocab_size=300)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")
    assert len({tok.bos_token_id, tok.eos_token_id, tok.pad_token_id}) == 3
    ids = tok("hello world")["input_ids"]
    assert ids[0] == tok.bos_token_id and tok.decode(ids[1:]) == "hello world"
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    assert tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == (
        "<|bos|><|system|>be brief<|eos|><|user|>hello<|eos|><|assistant|>"
    )
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    full = tok.apply_chat_template(messages + [{"role": "assistant", "content": "hi"}], return_dict=False)
    assert full[: len(prompt)] == prompt and full[-1] == tok.eos_token_id
    assert tok.decode(full[len(prompt):]) == "hi<|eos|>"
    with pytest.raises(Exception, match="unknown role: tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_load_tokenizer_round_trip_and_errors(tmp_path):
    tok = train_bpe_tokenizer(TEXTS, vocab_size=300)
    tok.save_pretrained(str(tmp_path / "tok"))
    loaded = load_tokenizer(str(tmp_path / "tok"))
    assert loaded("hello world")["input_ids"] == tok("hello world")["input_ids"]
    messages = [{"role": "user", "content": "hello"}]
    assert loaded.apply_chat_template(messages, return_dict=False) == tok.apply_chat_template(messages, return_dict=False)
    assert tokenizer_fingerprint(loaded) == tokenizer_fingerprint(tok)

    with pytest.raises(InputError, match="no such folder"):
        load_tokenizer(str(tmp_path / "missing"))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{not json")
    (broken / "tokenizer_config.json").write_text("{}")
    with pytest.raises(InputError, match=f"tokenizer {broken}: cannot load it"):
        load_tokenizer(str(broken))


def _topic_of(words, table):
    """Index of the one row of ``table`` holding every word (or None)."""
    hits = [t for t in range(table.shape[0]) if set(words) <= set(table[t])]
    return hits[0] if len(hits) == 1 else None


def test_synthetic_rows_are_deterministic_per_seed():
    assert synthetic_preference_rows(64, seed=3) == synthetic_preference_rows(64, seed=3)
    assert synthetic_preference_rows(64, seed=3) != synthetic_preference_rows(64, seed=4)
    assert len(synthetic_preference_rows(10)) == 10


def test_synthetic_lengths_are_heavy_tailed():
    rows = synthetic_preference_rows(2048, seed=0)
    for key in ("prompt", "chosen", "rejected"):
        words = np.array([len(row[key][0]["content"].split()) for row in rows])
        assert np.percentile(words, 90) / np.median(words) > 2, key
        assert words.max() > 4 * np.median(words), key
    prompt_words = np.array([len(row["prompt"][0]["content"].split()) for row in rows])
    assert 30 <= np.median(prompt_words) <= 50


def test_synthetic_chosen_and_rejected_differ_by_the_rule():
    rows = synthetic_preference_rows(256, seed=1)
    vocab = np.concatenate([GOOD_WORDS.ravel(), BAD_WORDS.ravel(), NEUTRAL])
    assert len(set(vocab)) == vocab.size  # the word sets are disjoint
    for row in rows:
        prompt = row["prompt"][0]["content"].rstrip("?").split()
        chosen = row["chosen"][0]["content"].rstrip(".").split()
        rejected = row["rejected"][0]["content"].rstrip(".").split()
        assert [m["role"] for m in row["prompt"] + row["chosen"] + row["rejected"]] == ["user", "assistant", "assistant"]
        topic = _topic_of([w for w in prompt if w not in set(NEUTRAL)], GOOD_WORDS)
        assert topic is not None
        assert set(chosen) <= set(GOOD_WORDS[topic])
        assert set(rejected) <= set(BAD_WORDS[topic])


def test_default_tokenizer_prepares_the_synthetic_rows(tmp_path):
    rows = synthetic_preference_rows(128, seed=0)
    tok = default_tokenizer(rows)
    assert len(tok) == 1024
    assert sum(1 for _ in synthetic_corpus(rows)) == 3 * len(rows)
    prepared = prepare_pairs(DataConfig("synthetic", max_length=4096, cache_dir=str(tmp_path)), tok, rows=rows)
    summary = prepared.summary
    assert (summary["format"], summary["kept"], summary["template_prefix_mismatch"]) == ("conversational", 128, 0)
    first = prepared.dataset[0]
    assert tok.decode(first["chosen_ids"]) == rows[0]["chosen"][0]["content"] + "<|eos|>"
    # pseudo-words are (almost all) single tokens, so a reply is about one token per word
    words = sum(len(r["chosen"][0]["content"].split()) for r in rows)
    tokens = sum(len(ids) for ids in prepared.dataset["chosen_ids"])
    assert tokens < 1.3 * words


def test_written_synthetic_pairs_are_streamed_blocks_deterministic_by_seed(tmp_path, monkeypatch):
    """scripts/synthetic_pairs.py's generator: N rows of the embedded kind, the same bytes for the same (N, seed),
    other rows for another seed, written block by block (blocks of 4 here: 10 pairs are 3 blocks)."""
    monkeypatch.setattr(synthetic, "_WRITE_BLOCK", 4)
    paths = [tmp_path / name for name in ("a.jsonl", "b.jsonl", "c.jsonl")]
    for path, seed in zip(paths, (0, 0, 1)):
        synthetic.write_synthetic_pairs(path, 10, seed=seed)
    rows = [json.loads(line) for line in paths[0].read_text().splitlines()]
    assert len(rows) == 10 and all(set(row) == {"prompt", "chosen", "rejected"} for row in rows)
    assert rows[:4] == synthetic.synthetic_preference_rows(4, seed=[0, 0])
    assert rows[8:] == synthetic.synthetic_preference_rows(2, seed=[0, 2])
    assert paths[0].read_bytes() == paths[1].read_bytes() != paths[2].read_bytes()


def test_a_tokenizer_saved_into_a_model_folder_may_grow_a_token_as_the_docs_warn(tmp_path):
    """docs/tokenizers.md warns: a tokenizer saved beside a Qwen2 config.json loads as Qwen2Tokenizer, which adds
    <|endoftext|>, one token beyond the vocab_size written from the saved tokenizer.  Checked here, so that the page
    changes when transformers does."""
    from pathlib import Path

    from transformers import Qwen2Config

    tokenizer = train_bpe_tokenizer(["hello world, a small text to learn a few merges"] * 4, vocab_size=300)
    Qwen2Config(vocab_size=len(tokenizer)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded = load_tokenizer(str(tmp_path))
    assert len(loaded) == len(tokenizer) + 1 and loaded.unk_token == "<|endoftext|>"
    page = (Path(__file__).resolve().parents[1] / "docs" / "tokenizers.md").read_text()
    assert "**Saving a tokenizer into a model folder may add a token.**" in page
    assert f"{len(tokenizer)} tokens in the check below" in page and f"{len(loaded)} tokens" in page
