"""What a data setting destroys is said on stderr, not only counted in data_summary.json: truncation of most
prompts or completions, rows left out by --on-bad-row skip; and every bad row of a file is found in one pass."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from launching import run
from test_data import standard_rows

from ds_packdpo.console import SAID_ENV
from ds_packdpo.data.formats import BAD_ROWS_NAMED
from ds_packdpo.data.prepare import DataConfig, prepare_pairs
from ds_packdpo.errors import InputError


def long_rows(n: int = 8) -> list[dict]:
    return [{"prompt": f"question {i} " * 6, "chosen": f"good answer {i} " * 4, "rejected": f"bad answer {i} " * 4}
            for i in range(n)]


def test_max_length_that_cuts_most_pairs_is_said_on_stderr(tmp_path, demo_tokenizer):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(long_rows()))
    demo_tokenizer.save_pretrained(tmp_path / "tokenizer")
    flags = ["--dataset", str(path), "--cache-dir", str(tmp_path / "cache"), "--tokenizer", str(tmp_path / "tokenizer")]
    cut = run([sys.executable, "-m", "ds_packdpo.cli", "prepare", *flags, "--max-length", "4"])
    summary = json.loads(cut.stdout)
    assert summary["prompt_truncated"] == summary["kept"] == 8
    assert (f"warning: {path}: truncation (--max-length 4) cut 8 of 8 prompts and {summary['completion_truncated']} "
            f"of 8 pairs' completions") in cut.stderr.splitlines()
    whole = run([sys.executable, "-m", "ds_packdpo.cli", "prepare", *flags])  # the default length cuts nothing
    assert json.loads(whole.stdout)["prompt_truncated"] == 0 and "truncation" not in whole.stderr


def test_skipped_rows_are_said_with_count_and_reasons(tmp_path, demo_tokenizer, capsys, monkeypatch):
    rows = standard_rows(6)
    rows[1], rows[4] = {"prompt": "q", "chosen": "c"}, 7
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(rows))
    monkeypatch.delenv(SAID_ENV, raising=False)
    prepared = prepare_pairs(DataConfig(str(path), on_bad_row="skip", cache_dir=str(tmp_path / "c")), demo_tokenizer)
    assert prepared.summary["kept"] == 4
    said = f"warning: {path}: skipped 2 of 6 rows (--on-bad-row skip): missing_field 1, not_an_object 1"
    assert capsys.readouterr().err.splitlines().count(said) == 1
    monkeypatch.setenv(SAID_ENV, "1")  # a rank of a front process that said it already
    prepare_pairs(DataConfig(str(path), on_bad_row="skip", cache_dir=str(tmp_path / "c")), demo_tokenizer)
    assert said not in capsys.readouterr().err


def test_every_bad_row_of_a_file_in_one_error(tmp_path, demo_tokenizer):
    rows = standard_rows(30)
    bad_at = list(range(2, 26, 2))  # 12 bad rows: the first 10 named, all counted
    for index in bad_at:
        rows[index] = {"prompt": "q", "chosen": None, "rejected": "r"}
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(rows))
    with pytest.raises(InputError) as error:
        prepare_pairs(DataConfig(str(path), cache_dir=str(tmp_path / "c")), demo_tokenizer)
    named = "; ".join(f"row {index}: field 'chosen' is null" for index in bad_at[:BAD_ROWS_NAMED])
    assert str(error.value) == (f"{path}: 12 bad rows: {named}; and 2 more (fix them, or pass --on-bad-row skip to "
                                f"leave them out)")
    assert "\n" not in str(error.value)


def test_a_data_warning_is_one_warning_line_per_job(tmp_path, demo_tokenizer, capsys, monkeypatch):
    """`prepare` said a data warning as a raw Python UserWarning (file path and source line); train said it in the
    front process and again in every rank.  Now one `warning:` line, by the process that runs phase one first."""
    rows = standard_rows(4)
    rows[2]["rejected"] = rows[2]["chosen"]
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(rows))
    demo_tokenizer.save_pretrained(tmp_path / "tokenizer")
    said = f"warning: {path}: 1 pairs have identical chosen and rejected completions; kept, but they teach nothing"
    flags = ["--dataset", str(path), "--cache-dir", str(tmp_path / "cache"), "--tokenizer", str(tmp_path / "tokenizer")]
    prepared = run([sys.executable, "-m", "ds_packdpo.cli", "prepare", *flags])
    assert prepared.stderr.splitlines().count(said) == 1 and "UserWarning" not in prepared.stderr, prepared.stderr
    monkeypatch.setenv(SAID_ENV, "1")  # a rank of a front process that said it already (its cache read again)
    prepare_pairs(DataConfig(str(path), cache_dir=str(tmp_path / "cache")), demo_tokenizer)
    assert "teach nothing" not in capsys.readouterr().err


def test_prepare_with_the_recipe_fills_the_cache_train_reads_and_a_miss_says_why(tmp_path, demo_tokenizer):
    """`prepare` without the recipe (default --max-length 1024) left train (its recipe's 128) to tokenize again, with
    no word: the miss now says what differs; `prepare --config RECIPE` fills the very cache the run reads and names
    it; --tokenize-procs and --progress do not change the cache."""
    from ds_packdpo.config import parse_train_args
    from ds_packdpo.data.source import prepare_run_data, tokenizer_and_rows

    path = tmp_path / "rows.json"
    path.write_text(json.dumps(standard_rows(6)))
    demo_tokenizer.save_pretrained(tmp_path / "tokenizer")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"dataset: {path}\ntokenizer: {tmp_path / 'tokenizer'}\ncache_dir: {tmp_path / 'cache'}\n"
                      f"max_length: 128\nlr: 1.0e-5\nsave_steps: 5\n")
    cli = [sys.executable, "-m", "ds_packdpo.cli", "prepare"]
    plain = run([*cli, "--dataset", str(path), "--tokenizer", str(tmp_path / "tokenizer"), "--cache-dir",
                 str(tmp_path / "cache")])
    assert f"tokenizing {path}: no cache of this file in {tmp_path / 'cache'} yet" in plain.stderr.splitlines()
    warmed = run([*cli, "--config", str(recipe), "--tokenize-procs", "2", "--no-progress"])
    assert (f"tokenizing {path}: its cache in {tmp_path / 'cache'} has other settings (--max-length 1024 there, 128 "
            f"here)") in warmed.stderr.splitlines(), warmed.stderr
    cache = json.loads(warmed.stdout)["cache"]  # --tokenize-procs 2: datasets wrote two shards
    assert f"cache: {cache[0]} and 1 more shards (" in warmed.stderr and all(Path(f).is_file() for f in cache)
    flags = parse_train_args(["--config", str(recipe)])  # what train's phase one reads: the warmed cache, no word
    data = flags.data_spec()
    prepared = prepare_run_data(data.tokenization, *tokenizer_and_rows(data))
    assert data.tokenization.cache_files(prepared.fingerprint) == [Path(f) for f in cache]
    again = run([*cli, "--config", str(recipe)])
    assert "tokenizing" not in again.stderr and json.loads(again.stdout)["cache"] == cache


def test_a_row_with_two_faults_names_both(tmp_path, demo_tokenizer):
    """A row whose chosen is null and whose rejected is empty was refused for its chosen alone: fixed, it failed again
    on the next run.  Every faulty field of a row is named at once (skip mode still counts the row once)."""
    rows = standard_rows(3)
    rows[1] = {"prompt": "q", "chosen": None, "rejected": "  "}
    conversational = [{"prompt": [{"role": "user", "content": "q"}], "chosen": "a",
                       "rejected": [{"role": "user", "content": "r"}]}]
    for name, data, named in (
            ("standard.json", rows, "row 1: field 'chosen' is null and field 'rejected' is an empty completion"),
            ("conversational.json", conversational,
             "row 0: field 'chosen' must be a non-empty list of messages, got a string and rejected[0] has role "
             "'user'; a completion is assistant messages")):
        path = tmp_path / name
        path.write_text(json.dumps(data))
        with pytest.raises(InputError) as error:
            prepare_pairs(DataConfig(str(path), cache_dir=str(tmp_path / "c")), demo_tokenizer)
        assert str(error.value) == f"{path} {named}"
    path = tmp_path / "standard.json"
    skipped = prepare_pairs(DataConfig(str(path), on_bad_row="skip", cache_dir=str(tmp_path / "c")), demo_tokenizer)
    assert skipped.summary["dropped"] == {"null_field": 1}
