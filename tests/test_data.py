"""The data stage: loading every format from every file kind, validation, truncation, caching, output."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from pathlib import Path

import datasets
import numpy as np
import pytest
from conftest import DATASET_KINDS
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_packdpo.data import pair_keys
from ds_packdpo.data import prepare as data
from ds_packdpo.data.prepare import DataConfig, prepare_pairs, run_prepare, tokenizer_fingerprint, truncation_lengths, write_pairs_jsonl
from ds_packdpo.config import parse_train_args
from ds_packdpo.errors import InputError

# One canonical set of pairs, written below in each of the four formats.
SAMPLES = [
    {
        "prompt": [{"role": "user", "content": "What is the capital of France?"}],
        "chosen": "Paris is the capital of France.",
        "rejected": "I do not know.",
    },
    {
        "prompt": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name a prime number."},
        ],
        "chosen": "Seven.",
        "rejected": "Nine is a prime number, since it has no divisors.",
    },
    {
        "prompt": [
            {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "Tell me a joke."},
        ],
        "chosen": "Why did the chicken cross the road? To get to the other side.",
        "rejected": "No.",
    },
]
SHAREGPT_FROM = {"system": "system", "user": "human", "assistant": "gpt"}


def assistant(text):
    return [{"role": "assistant", "content": text}]


def rows_in(fmt: str, samples=SAMPLES) -> list[dict]:
    if fmt == "standard":
        return [{"prompt": s["prompt"][-1]["content"], "chosen": s["chosen"], "rejected": s["rejected"]} for s in samples]
    if fmt == "conversational":
        return [{"prompt": s["prompt"], "chosen": assistant(s["chosen"]), "rejected": assistant(s["rejected"])} for s in samples]
    if fmt == "implicit":
        return [{k: s["prompt"] + assistant(s[k]) for k in ("chosen", "rejected")} for s in samples]
    return [
        {
            "conversations": [{"from": SHAREGPT_FROM[m["role"]], "value": m["content"]} for m in s["prompt"]],
            "chosen": {"from": "gpt", "value": s["chosen"]},
            "rejected": {"from": "gpt", "value": s["rejected"]},
        }
        for s in samples
    ]


def expected_ids(tokenizer, fmt: str, samples=SAMPLES) -> list[dict]:
    """Reference ids computed straight from the tokenizer, the way each format is defined."""
    out = []
    for s in samples:
        if fmt == "standard":
            prompt = [tokenizer.bos_token_id] + text_ids(tokenizer, s["prompt"][-1]["content"])
            completions = [text_ids(tokenizer, s[k]) + [tokenizer.eos_token_id] for k in ("chosen", "rejected")]
        else:
            prompt = tokenizer.apply_chat_template(s["prompt"], add_generation_prompt=True, return_dict=False)
            completions = [
                tokenizer.apply_chat_template(s["prompt"] + assistant(s[k]), return_dict=False)[len(prompt):]
                for k in ("chosen", "rejected")
            ]
        out.append({"prompt_ids": prompt, "chosen_ids": completions[0], "rejected_ids": completions[1]})
    return out


def text_ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def pair_ids(prepared):
    return [{k: row[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")} for row in prepared.dataset]


def assert_input_error(cfg, tokenizer, *parts, rows=None):
    with pytest.raises(InputError) as info:
        prepare_pairs(cfg, tokenizer, rows)
    message = str(info.value)
    assert "\n" not in message
    for part in parts:
        assert part in message, f"{part!r} not in {message!r}"
    return message


# ----------------------------------------------------------------------------- loading
@pytest.mark.parametrize("kind", DATASET_KINDS)
@pytest.mark.parametrize("fmt", ["standard", "conversational", "implicit", "sharegpt"])
def test_every_format_loads_from_every_file_kind(fmt, kind, dataset_writer, demo_tokenizer, cache_dir):
    path = dataset_writer(rows_in(fmt), kind)
    prepared = prepare_pairs(DataConfig(str(path), cache_dir=cache_dir), demo_tokenizer)
    assert prepared.summary["format"] == fmt
    assert prepared.summary["rows"] == prepared.summary["kept"] == len(SAMPLES)
    assert prepared.dataset["pair_id"] == list(range(len(SAMPLES)))
    expected = expected_ids(demo_tokenizer, fmt)
    assert pair_ids(prepared) == expected
    np.testing.assert_array_equal(prepared.chosen_lengths, [len(e["prompt_ids"]) + len(e["chosen_ids"]) for e in expected])
    np.testing.assert_array_equal(prepared.rejected_lengths, [len(e["prompt_ids"]) + len(e["rejected_ids"]) for e in expected])
    assert prepared.chosen_lengths.dtype == np.int64
    json.dumps(prepared.summary)


def test_conversational_formats_give_the_same_ids(dataset_writer, demo_tokenizer, cache_dir):
    results = [
        pair_ids(prepare_pairs(DataConfig(str(dataset_writer(rows_in(fmt), "json", fmt)), cache_dir=cache_dir), demo_tokenizer))
        for fmt in ("conversational", "implicit", "sharegpt")
    ]
    assert results[0] == results[1] == results[2]


def test_in_memory_rows_are_labelled_with_the_dataset_name(demo_tokenizer, cache_dir):
    prepared = prepare_pairs(DataConfig("synthetic", cache_dir=cache_dir), demo_tokenizer, rows=rows_in("conversational"))
    assert prepared.summary["dataset"] == "synthetic"
    assert pair_ids(prepared) == expected_ids(demo_tokenizer, "conversational")
    rows = rows_in("conversational")
    rows[1]["chosen"] = None
    cfg = DataConfig("synthetic", cache_dir=cache_dir)
    assert_input_error(cfg, demo_tokenizer, "synthetic row 1: field 'chosen' is null", rows=rows)


def test_forced_format_overrides_detection(dataset_writer, demo_tokenizer, cache_dir):
    # Full conversations in chosen/rejected plus a prompt column: auto-detection reads it as
    # conversational (and the completions then hold user turns); forcing "implicit" is right.
    rows = [dict(r, prompt=[{"role": "user", "content": "ignored"}]) for r in rows_in("implicit")]
    path = dataset_writer(rows, "jsonl")
    assert_input_error(DataConfig(str(path), cache_dir=cache_dir), demo_tokenizer, "row 0 (line 1): chosen[0] has role 'user'")
    prepared = prepare_pairs(DataConfig(str(path), format="implicit", cache_dir=cache_dir), demo_tokenizer)
    assert prepared.summary["format"] == "implicit"
    assert pair_ids(prepared) == expected_ids(demo_tokenizer, "implicit")


def test_forced_format_names_the_missing_columns(dataset_writer, demo_tokenizer, cache_dir):
    path = dataset_writer(rows_in("standard"), "json")
    assert_input_error(
        DataConfig(str(path), format="sharegpt", cache_dir=cache_dir), demo_tokenizer,
        str(path), "format 'sharegpt' needs columns ['conversations', 'chosen', 'rejected']", "missing ['conversations']",
    )


def test_custom_column_names(dataset_writer, demo_tokenizer, cache_dir):
    standard = [{"question": r["prompt"], "good": r["chosen"], "bad": r["rejected"]} for r in rows_in("standard")]
    path = dataset_writer(standard, "parquet", "custom_standard")
    cfg = DataConfig(str(path), prompt_column="question", chosen_column="good", rejected_column="bad", cache_dir=cache_dir)
    assert pair_ids(prepare_pairs(cfg, demo_tokenizer)) == expected_ids(demo_tokenizer, "standard")

    sharegpt = [{"messages": r["conversations"], "win": r["chosen"], "lose": r["rejected"]} for r in rows_in("sharegpt")]
    path = dataset_writer(sharegpt, "json", "custom_sharegpt")
    cfg = DataConfig(str(path), conversations_column="messages", chosen_column="win", rejected_column="lose", cache_dir=cache_dir)
    prepared = prepare_pairs(cfg, demo_tokenizer)
    assert prepared.summary["format"] == "sharegpt"
    assert pair_ids(prepared) == expected_ids(demo_tokenizer, "sharegpt")


def test_save_to_disk_dataset_dict_uses_the_split(tmp_path, demo_tokenizer, cache_dir):
    folder = tmp_path / "dd"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows_in("standard")), "test": datasets.Dataset.from_list(rows_in("standard")[:1])}
    ).save_to_disk(str(folder))
    assert prepare_pairs(DataConfig(str(folder), split="test", cache_dir=cache_dir), demo_tokenizer).summary["kept"] == 1
    assert_input_error(DataConfig(str(folder), split="validation", cache_dir=cache_dir), demo_tokenizer,
                       str(folder), "no split 'validation'", "train", "test")


def test_missing_path_and_unsupported_file(tmp_path, demo_tokenizer, cache_dir):
    missing = tmp_path / "nope.jsonl"
    assert_input_error(DataConfig(str(missing), cache_dir=cache_dir), demo_tokenizer, str(missing), "no such file")
    csv = tmp_path / "data.csv"
    csv.write_text("prompt,chosen,rejected\n")
    assert_input_error(DataConfig(str(csv), cache_dir=cache_dir), demo_tokenizer, str(csv), "unsupported file type '.csv'")
    not_saved = tmp_path / "folder"
    not_saved.mkdir()
    assert_input_error(DataConfig(str(not_saved), cache_dir=cache_dir), demo_tokenizer, str(not_saved), "save_to_disk")


def test_validation_streams_a_json_lines_file(tmp_path):
    """prepare holds one row of a JSON-lines file at a time while it validates and writes the normalized pairs: its
    Python heap peak at 20,000 pairs is within 2 MB of its peak at 2,000 (the rows as one list: ~2 KB a pair more,
    8.4 GiB a third into a million), and the pairs written are the file's, in order, with their row as pair id."""
    import tracemalloc

    from ds_packdpo.data.normalized import NormalizedPairs
    from ds_packdpo.data.raw_rows import open_rows
    from ds_packdpo.data.synthetic import write_synthetic_pairs

    peaks = {}
    for count in (2_000, 20_000):
        path = tmp_path / f"pairs-{count}.jsonl"
        write_synthetic_pairs(path, count)
        out = NormalizedPairs(tmp_path / f"normalized-{count}.arrow", max_pairs=None)
        tracemalloc.start()
        fmt, rows, bad, groups = data.validate_rows(open_rows(str(path), "train"), DataConfig(str(path)), out)
        peaks[count] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        written = out.close()
        assert (fmt, rows, bad, groups, out.kept) == ("conversational", count, {}, None, count)
    assert peaks[20_000] - peaks[2_000] < 2 * 2**20, peaks
    with open(path) as handle:
        first = [json.loads(next(handle)) for _ in range(3)]
    assert written[:3] == {"pair_id": [0, 1, 2], **{key: [row[key] for row in first] for key in first[0]}}
    assert written[-1]["pair_id"] == 19_999


def test_content_positions_are_the_hash_of_each_pairs_ids(dpo_demo_path, demo_tokenizer, cache_dir, monkeypatch):
    """--eval-fraction's positions, computed with numpy over Arrow blocks, are the SHA-256 of each pair's int64
    lengths and ids as the per-pair Python code hashed them (so a split does not move): over several blocks, on a
    selection (the indices mapping a held-out split makes), and of the prompt alone for pairs made from groups."""
    import hashlib

    from ds_packdpo.data import heldout

    def oracle(prepared, columns):
        rows = prepared.dataset[:]
        values = [np.asarray([len(part) for part in ids] + [i for part in ids for i in part], dtype=np.int64)
                  for ids in zip(*(rows[name] for name in columns))]
        return np.asarray([int.from_bytes(hashlib.sha256(v.tobytes()).digest()[:8], "little") / 2**64 for v in values])

    monkeypatch.setattr(heldout, "BLOCK_ROWS", 7)
    prepared = prepare_pairs(DataConfig(str(dpo_demo_path), max_length=128, cache_dir=cache_dir), demo_tokenizer)
    for pairs in (prepared, heldout.select_pairs(prepared, np.arange(len(prepared.chosen_lengths))[::-3])):
        want = oracle(pairs, ["prompt_ids", "chosen_ids", "rejected_ids"])
        assert np.array_equal(heldout.content_positions(pairs), want)
    grouped = dataclasses.replace(prepared, summary={**prepared.summary, "multi_response": {}})
    assert np.array_equal(heldout.content_positions(grouped), oracle(grouped, ["prompt_ids"]))


def test_a_killed_prepares_temporary_file_is_removed_by_the_next(tmp_path, demo_tokenizer):
    """prepare writes its normalized pairs to a temporary file named with host and process id: one left by a process
    of this host that is gone (SIGKILL) is removed by the next prepare; a live process's, or another host's (a shared
    cache folder), is kept."""
    import socket
    import subprocess

    cache = tmp_path / "cache"
    cache.mkdir()
    gone = subprocess.Popen(["true"])
    gone.wait()
    host = socket.gethostname()
    abandoned = cache / f"normalizing-{host}-{gone.pid}-x1.arrow"
    alive = cache / f"normalizing-{host}-{os.getpid()}-x2.arrow"
    elsewhere = cache / f"normalizing-{host}z-{gone.pid}-x3.arrow"
    for path in (abandoned, alive, elsewhere):
        path.write_bytes(b"")
    rows = [{"prompt": "Hi", "chosen": "Hello.", "rejected": "No."}]
    prepare_pairs(DataConfig("mem", cache_dir=str(cache)), demo_tokenizer, rows=rows)
    assert not abandoned.exists() and alive.exists() and elsewhere.exists()
    assert sorted(cache.glob(f"normalizing-{host}-{os.getpid()}-*")) == [alive]  # its own removed as it finished


def test_a_cache_hit_reads_no_rows(tmp_path, dpo_demo_rows, demo_tokenizer, cache_dir, monkeypatch):
    """The second preparation of an unchanged file (another rank of the node) hashes its bytes and opens the
    tokenized cache: no row is parsed or validated, and the result is the first one's, summary included."""
    rows = copy.deepcopy(dpo_demo_rows[:40])
    rows[3]["chosen"] = None  # a bad row, skipped and counted
    path = tmp_path / "demo.json"
    path.write_text(json.dumps(rows))
    cfg = DataConfig(str(path), on_bad_row="skip", max_pairs=30, cache_dir=cache_dir)
    first = prepare_pairs(cfg, demo_tokenizer)

    def no_rows(*_):
        raise AssertionError("rows were loaded on a cache hit")

    with monkeypatch.context() as patched:
        patched.setattr(data, "open_rows", no_rows)
        patched.setattr(data, "validate_rows", no_rows)
        patched.setattr(pair_keys, "content_keys", no_rows)  # the prompt groups: memory-mapped from beside the cache
        again = prepare_pairs(cfg, demo_tokenizer)
    assert again.summary == first.summary and again.summary["dropped"] == {"null_field": 1}
    assert isinstance(again.groups.group.base, np.memmap) and again.groups.count == first.groups.count
    for field in ("group", "chosen", "rejected"):
        np.testing.assert_array_equal(getattr(again.groups, field), getattr(first.groups, field))
    assert again.fingerprint == first.fingerprint
    assert pair_ids(again) == pair_ids(first)
    np.testing.assert_array_equal(again.chosen_lengths, first.chosen_lengths)
    np.testing.assert_array_equal(again.rejected_lengths, first.rejected_lengths)
    # another setting, or the file changed: rows are read again
    assert prepare_pairs(dataclasses.replace(cfg, max_pairs=20), demo_tokenizer).summary["kept"] == 20
    rows[3]["chosen"] = rows[4]["chosen"]
    path.write_text(json.dumps(rows))
    assert prepare_pairs(cfg, demo_tokenizer).summary["dropped"] == {}


def test_dpo_en_demo_loads_as_sharegpt_with_300_rows(dpo_demo_path, demo_tokenizer, cache_dir):
    prepared = prepare_pairs(DataConfig(str(dpo_demo_path), cache_dir=cache_dir), demo_tokenizer)
    s = prepared.summary
    assert (s["format"], s["rows"], s["kept"], s["dropped"]) == ("sharegpt", 300, 300, {})
    assert len(prepared.dataset) == prepared.chosen_lengths.size == prepared.rejected_lengths.size == 300
    assert prepared.chosen_lengths.max() <= 1024 and prepared.rejected_lengths.max() <= 1024
    assert s["tokens"]["total"] == int(prepared.chosen_lengths.sum() + prepared.rejected_lengths.sum())


def test_chat_template_prompt_is_a_prefix_on_dpo_en_demo(dpo_demo_path, dpo_demo_rows, demo_tokenizer, cache_dir):
    prepared = prepare_pairs(DataConfig(str(dpo_demo_path), max_length=100_000, cache_dir=cache_dir), demo_tokenizer)
    assert prepared.summary["template_prefix_mismatch"] == 0
    assert prepared.summary["prompt_truncated"] == prepared.summary["completion_truncated"] == 0
    roles = {"system": "system", "human": "user", "gpt": "assistant"}
    prompts = [[{"role": roles[m["from"]], "content": m["value"]} for m in raw["conversations"]] for raw in dpo_demo_rows]
    render = demo_tokenizer.apply_chat_template
    assert prepared.dataset["prompt_ids"] == render(prompts, add_generation_prompt=True, return_dict=False)
    for key in ("chosen", "rejected"):
        full = render([p + assistant(raw[key]["value"]) for p, raw in zip(prompts, dpo_demo_rows)], return_dict=False)
        assert [p + c for p, c in zip(prepared.dataset["prompt_ids"], prepared.dataset[f"{key}_ids"])] == full


def test_template_prefix_mismatch_falls_back_to_the_text_suffix(demo_tokenizer, cache_dir):
    # "assistant: " ends the rendered prompt with a lone space token; with the reply after
    # it the space merges into the reply's first word, so the prompt ids are no prefix.
    tokenizer = copy.deepcopy(demo_tokenizer)
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    )
    prepared = prepare_pairs(DataConfig("mem", cache_dir=cache_dir), tokenizer, rows=rows_in("conversational"))
    assert prepared.summary["template_prefix_mismatch"] == 2 * len(SAMPLES)
    for sample, pair in zip(SAMPLES, prepared.dataset):
        prompt = tokenizer.apply_chat_template(sample["prompt"], add_generation_prompt=True, return_dict=False)
        assert pair["prompt_ids"] == prompt
        assert pair["chosen_ids"] == text_ids(tokenizer, sample["chosen"] + "\n")
        assert pair["rejected_ids"] == text_ids(tokenizer, sample["rejected"] + "\n")

    tokenizer.chat_template = tokenizer.chat_template.replace("'assistant: '", "'assistant (thinking): '")
    assert_input_error(DataConfig("mem", cache_dir=cache_dir), tokenizer, "mem row 0:", "not render the prompt",
                       rows=rows_in("conversational"))


def test_template_that_renders_no_completion_drops_the_pair(demo_tokenizer, cache_dir):
    tokenizer = copy.deepcopy(demo_tokenizer)
    tokenizer.chat_template = "{% for m in messages %}{% if m['role'] != 'assistant' %}{{ m['content'] }}{% endif %}{% endfor %}"
    assert_input_error(DataConfig("mem", cache_dir=cache_dir), tokenizer, "no pair left", "'empty_completion': 3",
                       rows=rows_in("conversational"))


# ----------------------------------------------------------------------------- validation
def standard_rows(n=4):
    return [{"prompt": f"question {i}", "chosen": f"good answer {i}", "rejected": f"bad answer {i}"} for i in range(n)]


def with_row(rows, index, row):
    rows = copy.deepcopy(rows)
    rows[index] = row
    return rows


def conv(prompt, chosen=None, rejected=None):
    return {"prompt": prompt, "chosen": chosen or assistant("c"), "rejected": rejected or assistant("r")}


def share(conversations, chosen=None):
    gpt = {"from": "gpt", "value": "r"}
    return {"conversations": conversations, "chosen": chosen or gpt, "rejected": gpt}


BAD_ROWS = {
    "missing field": (standard_rows(), 1, {"prompt": "q", "chosen": "c"}, "row 1: field 'rejected' is missing"),
    "null": (standard_rows(), 2, {"prompt": "q", "chosen": None, "rejected": "r"}, "row 2: field 'chosen' is null"),
    "non-string": (
        standard_rows(), 3, {"prompt": "q", "chosen": 5, "rejected": "r"}, "row 3: field 'chosen' must be a string, got a number"
    ),
    "empty completion": (
        standard_rows(), 1, {"prompt": "q", "chosen": "c", "rejected": "  "}, "row 1: field 'rejected' is an empty completion"
    ),
    "unknown role": (
        rows_in("sharegpt"), 2, share([{"from": "bot", "value": "x"}]),
        "row 2: conversations[0] has unknown role 'bot'; expected one of system, human, gpt",
    ),
    "prompt not a list": (
        rows_in("conversational"), 1, conv("hi"),
        "row 1: field 'prompt' must be a non-empty list of messages, got a string",
    ),
    "message without content": (
        rows_in("conversational"), 2, conv([{"role": "user"}]),
        "row 2: prompt[0] must be an object with 'role' and 'content'",
    ),
    "non-string content": (
        rows_in("conversational"), 1, conv([{"role": "user", "content": 3}]),
        "row 1: prompt[0].content must be a string, got a number",
    ),
    "completion from the user": (
        rows_in("conversational"), 0, conv([{"role": "user", "content": "q"}], chosen=[{"role": "user", "content": "c"}]),
        "row 0: chosen[0] has role 'user'",
    ),
    "sharegpt completion from the human": (  # the role as the file spells it, not the chat role it maps to
        rows_in("sharegpt"), 1, share([{"from": "human", "value": "q"}], chosen={"from": "human", "value": "c"}),
        "row 1: chosen[0] has role 'human'; a completion is assistant messages",
    ),
    "sharegpt completion not one message": (
        rows_in("sharegpt"), 1, share([{"from": "human", "value": "q"}], chosen=[{"from": "gpt", "value": "c"}]),
        "row 1: field 'chosen' must be one {from, value} message, got a list",
    ),
    "implicit without common prompt": (
        rows_in("implicit"), 1, {"chosen": assistant("a"), "rejected": [{"role": "user", "content": "b"}] + assistant("c")},
        "row 1: chosen and rejected share no leading non-assistant message",
    ),
    "row not an object": (standard_rows(), 2, ["q", "c", "r"], "row 2: a row must be an object, got a list"),
}


@pytest.mark.parametrize("case", list(BAD_ROWS), ids=list(BAD_ROWS))
def test_bad_row_is_named_with_file_row_and_reason(case, dataset_writer, demo_tokenizer, cache_dir):
    rows, index, bad, expected = BAD_ROWS[case]
    path = dataset_writer(with_row(rows, index, bad), "json")
    assert_input_error(DataConfig(str(path), cache_dir=cache_dir), demo_tokenizer, f"{path} {expected}")


def test_validation_happens_before_any_tokenization(dataset_writer, demo_tokenizer, cache_dir, monkeypatch):
    def must_not_run(batch, **kwargs):
        raise AssertionError("tokenization started before validation finished")

    monkeypatch.setattr(data, "_encode_batch", must_not_run)
    rows = standard_rows(50)
    rows[-1]["chosen"] = None
    path = dataset_writer(rows, "jsonl")
    cfg = DataConfig(str(path), cache_dir=cache_dir)
    assert_input_error(cfg, demo_tokenizer, f"{path} row 49 (line 50): field 'chosen' is null")


def test_unreadable_json_line(tmp_path, demo_tokenizer, cache_dir):
    path = tmp_path / "data.jsonl"
    lines = [json.dumps(r) for r in standard_rows(3)]
    path.write_text(f"{lines[0]}\n\n{lines[1]}\n{{\"prompt\": \"q\",\n{lines[2]}\n")
    assert_input_error(DataConfig(str(path), cache_dir=cache_dir), demo_tokenizer, f"{path} row 2 (line 4): not valid JSON")
    prepared = prepare_pairs(DataConfig(str(path), on_bad_row="skip", cache_dir=cache_dir), demo_tokenizer)
    assert prepared.summary["dropped"] == {"unreadable_json_line": 1}
    assert prepared.dataset["pair_id"] == [0, 1, 3]


@pytest.mark.parametrize(
    "name, content, expected",
    [
        ("data.json", "", "the file is empty"),
        ("data.jsonl", "\n  \n", "the file is empty"),
        ("data.json", "[]", "the dataset has no rows"),
        ("data.json", '{"prompt": "q", "chosen": "c", "rejected": "r"}\n[', "row 1 (line 2): not valid JSON"),  # JSON lines
        ("data.json", '[{"prompt": "q", "chosen": "c", "rejected": "r"}] trailing', "unexpected data after the JSON list"),
        ("data.json", '[{"prompt": "q", "chosen": "c", "rejected": "r"} {"prompt": "x"}]', "row 0: expected ',' or ']'"),
        ("data.json", '[{"question": "q", "answer": "a"}]',
         "columns found ['answer', 'question']; expected ['prompt', 'chosen', 'rejected']"),
    ],
)
def test_bad_file(name, content, expected, tmp_path, demo_tokenizer, cache_dir):
    path = tmp_path / name
    path.write_text(content)
    assert_input_error(DataConfig(str(path), cache_dir=cache_dir), demo_tokenizer, f"{path}", expected)


def test_truncated_json_names_the_row(tmp_path, demo_tokenizer, cache_dir):
    text = json.dumps(standard_rows(5), indent=2)
    cut = text.index('"bad answer 3"') + 5  # inside row 3
    path = tmp_path / "data.json"
    path.write_text(text[:cut])
    cfg = DataConfig(str(path), cache_dir=cache_dir)
    assert_input_error(cfg, demo_tokenizer, f"{path} row 3: not valid JSON, truncated or malformed")
    path.write_text(text[: text.rindex("}") + 1])  # every row complete, the list never closed
    assert_input_error(cfg, demo_tokenizer, f"{path} row 4: the JSON list is not closed")


@pytest.mark.parametrize("suffix, expected", [
    (".json", "binary content"), (".jsonl", "binary content"),
    (".parquet", "not a readable Parquet file"), (".arrow", "not a readable Arrow file"),
])
def test_binary_garbage(suffix, expected, tmp_path, demo_tokenizer, cache_dir):
    path = tmp_path / f"garbage{suffix}"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    assert_input_error(DataConfig(str(path), cache_dir=cache_dir), demo_tokenizer, str(path), expected)
    path.write_bytes(b"\xff\xfe\xfa" * 100)  # no NUL byte, still not text
    if suffix in (".json", ".jsonl"):
        assert_input_error(DataConfig(str(path), cache_dir=cache_dir), demo_tokenizer, str(path), "not UTF-8 text")


def test_skip_mode_counts_bad_rows_by_reason(dataset_writer, demo_tokenizer, cache_dir):
    rows = standard_rows(8)
    rows[1] = {"prompt": "q", "chosen": "c"}
    rows[2]["chosen"] = None
    rows[4]["chosen"] = 5
    rows[5]["rejected"] = ""
    rows[6] = "not a row"
    rows[7]["rejected"] = None
    path = dataset_writer(rows, "json")
    prepared = prepare_pairs(DataConfig(str(path), on_bad_row="skip", cache_dir=cache_dir), demo_tokenizer)
    assert prepared.summary["dropped"] == {
        "empty_completion": 1, "missing_field": 1, "non_string_field": 1, "not_an_object": 1, "null_field": 2,
    }
    assert (prepared.summary["rows"], prepared.summary["kept"]) == (8, 2)
    assert prepared.dataset["pair_id"] == [0, 3]
    assert pair_ids(prepared)[1]["chosen_ids"] == text_ids(demo_tokenizer, "good answer 3") + [demo_tokenizer.eos_token_id]

    rows = [{"prompt": "q", "chosen": None, "rejected": "r"}] * 3
    assert_input_error(DataConfig(str(dataset_writer(rows, "json", "all_bad")), on_bad_row="skip", cache_dir=cache_dir),
                       demo_tokenizer, "no valid pairs", "null_field")


def test_max_pairs_keeps_the_first_valid_rows(dataset_writer, demo_tokenizer, cache_dir):
    rows = standard_rows(6)
    rows[1]["chosen"] = None
    cfg = DataConfig(str(dataset_writer(rows, "json")), on_bad_row="skip", max_pairs=3, cache_dir=cache_dir)
    prepared = prepare_pairs(cfg, demo_tokenizer)
    assert prepared.dataset["pair_id"] == [0, 2, 3]
    summary = prepared.summary
    assert (summary["kept"], summary["beyond_max_pairs"], summary["dropped"]) == (3, 2, {"null_field": 1})


def test_identical_chosen_and_rejected_warns_and_is_kept(dataset_writer, demo_tokenizer, cache_dir, capsys):
    rows = standard_rows(3)
    rows[1]["rejected"] = rows[1]["chosen"]
    path = dataset_writer(rows, "json")
    prepared = prepare_pairs(DataConfig(str(path), cache_dir=cache_dir), demo_tokenizer)
    assert [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")] == [
        f"warning: {path}: 1 pairs have identical chosen and rejected completions; kept, but they teach nothing"]
    assert prepared.summary["identical_chosen_rejected"] == 1
    assert prepared.summary["kept"] == 3


def test_duplicate_pairs_and_prompts_ending_with_the_assistant_are_counted_and_warned(dataset_writer, demo_tokenizer,
                                                                                    cache_dir, capsys):
    rows = rows_in("conversational")
    rows.append(json.loads(json.dumps(rows[0])))  # an exact repeat
    rows[1]["prompt"] = rows[1]["prompt"] + assistant("And a follow-up.")  # the split is one turn late
    path = dataset_writer(rows, "jsonl")
    prepared = prepare_pairs(DataConfig(str(path), cache_dir=cache_dir), demo_tokenizer)
    messages = [line.removeprefix("warning: ") for line in capsys.readouterr().err.splitlines()]
    assert f"{path}: 1 pairs repeat an earlier pair exactly (prompt, chosen and rejected); kept, so those pairs " \
           "weigh double" in messages
    assert any(m.startswith(f"{path}: 1 prompts end with an assistant turn") for m in messages)
    assert (prepared.summary["duplicate_pairs"], prepared.summary["prompt_ends_with_assistant"]) == (1, 1)
    assert prepared.summary["kept"] == len(rows)
    clean = prepare_pairs(DataConfig(str(dataset_writer(rows_in("conversational"), "jsonl", "clean")),
                                     cache_dir=cache_dir), demo_tokenizer)
    assert (clean.summary["duplicate_pairs"], clean.summary["prompt_ends_with_assistant"]) == (0, 0)


def test_data_config_rejects_bad_settings():
    for kwargs, expected in [({"format": "xml"}, "format 'xml'"), ({"on_bad_row": "ignore"}, "on_bad_row 'ignore'"),
                             ({"max_length": 0}, "max_length must be >= 1"), ({"max_pairs": 0}, "max_pairs must be >= 1")]:
        with pytest.raises(InputError, match=expected):
            DataConfig("x.json", **kwargs)
    settings_obj = parse_train_args(["--dataset", "d.json", "--max-length", "64", "--lr", "1e-6", "--format",
                                     "sharegpt", "--max-pairs", "5"])
    expected = DataConfig("d.json", max_length=64, format="sharegpt", max_pairs=5)
    assert settings_obj.data_spec().tokenization == expected


# ----------------------------------------------------------------------------- truncation
def test_truncation_on_exact_ids(demo_tokenizer, cache_dir):
    row = {"prompt": " ".join(f"w{i}" for i in range(40)), "chosen": "one two three four five six", "rejected": "seven eight"}
    tok = demo_tokenizer
    prompt = [tok.bos_token_id] + text_ids(tok, row["prompt"])
    chosen = text_ids(tok, row["chosen"]) + [tok.eos_token_id]
    rejected = text_ids(tok, row["rejected"]) + [tok.eos_token_id]
    assert len(prompt) > 20 and len(chosen) > len(rejected) > 2

    def run(**kwargs):
        prepared = prepare_pairs(DataConfig("mem", cache_dir=cache_dir, **kwargs), tok, rows=[row])
        return pair_ids(prepared)[0], prepared.summary

    ids, summary = run(max_length=1000, max_prompt_length=5)  # the prompt keeps its end
    assert ids == {"prompt_ids": prompt[-5:], "chosen_ids": chosen, "rejected_ids": rejected}
    assert (summary["prompt_truncated"], summary["completion_truncated"]) == (1, 0)

    ids, summary = run(max_length=len(prompt) + len(chosen) - 3)  # the prompt gives way first, just enough
    assert ids == {"prompt_ids": prompt[3:], "chosen_ids": chosen, "rejected_ids": rejected}
    assert (summary["prompt_truncated"], summary["completion_truncated"]) == (1, 0)

    ids, summary = run(max_length=4)  # then the completions keep their start; the prompt its last token
    assert ids == {"prompt_ids": prompt[-1:], "chosen_ids": chosen[:3], "rejected_ids": rejected[:3]}
    assert (summary["prompt_truncated"], summary["completion_truncated"]) == (1, 1)

    ids, summary = run(max_length=len(prompt) + len(chosen))  # fits: untouched
    assert ids == {"prompt_ids": prompt, "chosen_ids": chosen, "rejected_ids": rejected}
    assert (summary["prompt_truncated"], summary["completion_truncated"]) == (0, 0)

    # max_length=1: the one token left is the prompt's, no room for a completion token.
    assert_input_error(DataConfig("mem", max_length=1, cache_dir=cache_dir), tok,
                       "no pair left after truncation", "'no_room_for_completion': 1", rows=[row])


@settings(max_examples=300, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(0, 60), st.integers(1, 60), st.integers(1, 60)), min_size=1, max_size=20),
    max_length=st.integers(1, 80),
    max_prompt_length=st.one_of(st.none(), st.integers(1, 80)),
)
def test_truncation_rules_property(lengths, max_length, max_prompt_length):
    raw_prompt, raw_chosen, raw_rejected = (np.array(x) for x in zip(*lengths))
    prompt, chosen, rejected = truncation_lengths(raw_prompt, raw_chosen, raw_rejected, max_length, max_prompt_length)
    capped = raw_prompt if max_prompt_length is None else np.minimum(raw_prompt, max_prompt_length)
    longest = np.maximum(raw_chosen, raw_rejected)
    fits = capped + longest <= max_length
    # nothing is cut that fits; the prompt is cut only as far as needed, down to one token
    np.testing.assert_array_equal(prompt[fits], capped[fits])
    np.testing.assert_array_equal(prompt[~fits], np.minimum(capped, np.maximum(max_length - longest, 1))[~fits])
    assert np.all((prompt >= np.minimum(capped, 1)) & (prompt <= capped))
    # completions keep as much of their start as the room allows
    np.testing.assert_array_equal(chosen, np.minimum(raw_chosen, max_length - prompt))
    np.testing.assert_array_equal(rejected, np.minimum(raw_rejected, max_length - prompt))
    kept = np.minimum(chosen, rejected) >= 1
    assert np.all(prompt[kept] + np.maximum(chosen, rejected)[kept] <= max_length)
    assert np.all(kept | (max_length <= prompt))


# ----------------------------------------------------------------------------- cache, fingerprint, output
def test_second_call_hits_the_cache(dataset_writer, demo_tokenizer, cache_dir, monkeypatch):
    calls = []
    encode = data._encode_batch

    def counting(batch, **kwargs):
        calls.append(len(batch["pair_id"]))
        return encode(batch, **kwargs)

    monkeypatch.setattr(data, "_encode_batch", counting)
    cfg = DataConfig(str(dataset_writer(rows_in("sharegpt"), "json")), cache_dir=cache_dir)
    first = prepare_pairs(cfg, demo_tokenizer)
    assert sum(calls) == len(SAMPLES)
    cache_files = sorted(Path(cache_dir).glob("pairs-*.arrow"))
    assert [p.name for p in cache_files] == [f"pairs-{first.fingerprint}.arrow"]
    mtime = cache_files[0].stat().st_mtime_ns

    second = prepare_pairs(cfg, demo_tokenizer)
    assert sum(calls) == len(SAMPLES)  # not called again
    assert second.dataset.cache_files[0]["filename"] == str(cache_files[0])
    assert cache_files[0].stat().st_mtime_ns == mtime
    assert (second.fingerprint, pair_ids(second), second.summary) == (first.fingerprint, pair_ids(first), first.summary)

    third = prepare_pairs(dataclasses.replace(cfg, max_length=8), demo_tokenizer)  # other settings, other key
    assert third.fingerprint != first.fingerprint
    assert sum(calls) == 2 * len(SAMPLES)


def test_parallel_tokenization_matches_serial(demo_tokenizer, tmp_path):
    rows = rows_in("sharegpt") * 10
    serial = prepare_pairs(DataConfig("mem", cache_dir=str(tmp_path / "a")), demo_tokenizer, rows=rows)
    parallel = prepare_pairs(DataConfig("mem", tokenize_procs=2, cache_dir=str(tmp_path / "b")), demo_tokenizer, rows=rows)
    assert parallel.fingerprint == serial.fingerprint
    assert pair_ids(parallel) == pair_ids(serial) and parallel.summary == serial.summary
    assert len(list((tmp_path / "b").glob("pairs-*_of_00002.arrow"))) == 2


def test_tokenize_procs_zero_picks_one_process_per_block_of_pairs_up_to_the_cores(monkeypatch):
    """--tokenize-procs 0 (the default): one process per PAIRS_PER_TOKENIZE_PROC pairs, at most the usable cores and
    MOST_TOKENIZE_PROCS, one inside a rank; a number asked is kept; one process is None (no worker spawned)."""
    per, most = data.PAIRS_PER_TOKENIZE_PROC, data.MOST_TOKENIZE_PROCS
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    assert [data.tokenize_processes(0, n) for n in (1, per, per + 1, 3 * per)] == [None, None, 2, 3]
    assert data.tokenize_processes(0, 1000 * per) == most
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert data.tokenize_processes(0, 1000 * per) == 2
    assert data.tokenize_processes(5, 1) == 5 and data.tokenize_processes(1, 1000 * per) is None
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert data.tokenize_processes(0, 1000 * per) is None and data.tokenize_processes(3, 1) == 3


def test_tokenizer_fingerprint_tracks_what_changes_ids(demo_tokenizer):
    same = copy.deepcopy(demo_tokenizer)
    assert tokenizer_fingerprint(same) == tokenizer_fingerprint(demo_tokenizer)
    same("some text", padding="max_length", max_length=12, truncation=True)  # per-call settings do not count
    assert tokenizer_fingerprint(same) == tokenizer_fingerprint(demo_tokenizer)
    same.chat_template = demo_tokenizer.chat_template.replace("bos_token", "''")
    assert tokenizer_fingerprint(same) != tokenizer_fingerprint(demo_tokenizer)


def test_write_pairs_jsonl_round_trips_and_never_half_writes(dataset_writer, demo_tokenizer, cache_dir, tmp_path, monkeypatch):
    cfg = DataConfig(str(dataset_writer(rows_in("conversational"), "json")), cache_dir=cache_dir)
    out = tmp_path / "out" / "pairs.jsonl"
    summary = run_prepare(cfg, demo_tokenizer, out)
    prepared = prepare_pairs(cfg, demo_tokenizer)
    assert summary == {**prepared.summary, "fingerprint": prepared.fingerprint, "output": str(out),
                       "cache": [str(cfg.cache_file(prepared.fingerprint))]}
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines == [{k: row[k] for k in ("pair_id", "prompt_ids", "chosen_ids", "rejected_ids")} for row in prepared.dataset]

    before = out.read_text()
    real_dumps = json.dumps
    written = []

    def failing_dumps(obj, *args, **kwargs):
        if len(written) == 1:
            raise OSError("disk full")
        written.append(obj)
        return real_dumps(obj, *args, **kwargs)

    monkeypatch.setattr(data.json, "dumps", failing_dumps)
    with pytest.raises(OSError, match="disk full"):
        write_pairs_jsonl(prepared, out)
    assert out.read_text() == before
    assert sorted(p.name for p in out.parent.iterdir()) == ["pairs.jsonl"]


def test_no_progress_hides_the_tokenization_bar(dpo_demo_rows, demo_tokenizer, tmp_path, capfd):
    """--no-progress reaches the tokenization (datasets' 'tokenize pairs' bar printed on every prepare, train, bench and
    eval with --no-progress), and leaves datasets' switch as it found it."""
    rows = dpo_demo_rows[:4]
    prepare_pairs(DataConfig("demo", cache_dir=str(tmp_path / "quiet"), progress=False), demo_tokenizer, rows=rows)
    assert "tokenize pairs" not in capfd.readouterr().err
    assert datasets.is_progress_bar_enabled()
    prepare_pairs(DataConfig("demo", cache_dir=str(tmp_path / "shown")), demo_tokenizer, rows=rows)
    assert "tokenize pairs" in capfd.readouterr().err
