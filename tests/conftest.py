"""Shared fixtures: the real demo data, a local tokenizer trained on it, and dataset-file writers."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pyarrow as pa
import pytest

from ds_packdpo.data.tokenizer import train_bpe_tokenizer

DPO_DEMO_PATH = Path(__file__).resolve().parents[2] / "shared/data/dpo_en_demo.json"
DATASET_KINDS = ("json", "jsonl", "parquet", "arrow", "disk")


@pytest.fixture(scope="session")
def dpo_demo_path() -> Path:
    """dpo_en_demo.json: 300 real ShareGPT preference pairs (read-only)."""
    return DPO_DEMO_PATH


@pytest.fixture(scope="session")
def dpo_demo_rows(dpo_demo_path) -> list[dict]:
    """The parsed demo rows; shared by the session, so copy before changing them."""
    return json.loads(dpo_demo_path.read_text())


@pytest.fixture(scope="session")
def demo_tokenizer(dpo_demo_rows):
    """Byte-level BPE (vocab 4096) with a chat template, trained on every text of dpo_en_demo.json."""
    def texts():
        for row in dpo_demo_rows:
            for message in row["conversations"]:
                yield message["value"]
            yield row["chosen"]["value"]
            yield row["rejected"]["value"]

    return train_bpe_tokenizer(texts(), vocab_size=4096)


def write_rows(rows: list[dict], folder: Path, kind: str, name: str = "data") -> Path:
    """Writes ``rows`` as one dataset of ``kind`` (see DATASET_KINDS) under ``folder``; returns its path."""
    if kind == "json":
        path = folder / f"{name}.json"
        path.write_text(json.dumps(rows, indent=1))
    elif kind == "jsonl":
        path = folder / f"{name}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    elif kind == "parquet":
        path = folder / f"{name}.parquet"
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    elif kind == "arrow":  # an Arrow IPC stream, the layout datasets itself writes
        path = folder / f"{name}.arrow"
        table = pa.Table.from_pylist(rows)
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    elif kind == "disk":
        path = folder / name
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    else:
        raise ValueError(f"unknown dataset kind {kind!r}")
    return path


@pytest.fixture
def dataset_writer(tmp_path):
    """``dataset_writer(rows, kind, name="data") -> Path`` writing into this test's tmp_path."""
    return lambda rows, kind, name="data": write_rows(rows, tmp_path, kind, name)


@pytest.fixture
def cache_dir(tmp_path) -> str:
    """A per-test tokenization cache folder, so tests never share or pollute ~/.cache."""
    return str(tmp_path / "cache")


@pytest.fixture
def no_launch(monkeypatch):
    """The front command in-process with no launcher: starting one fails the test (bad input must stop before)."""
    from ds_packdpo import cli

    def launch_tripwire(*args, **kwargs):
        raise AssertionError("the launcher started although the input is bad")

    monkeypatch.setattr(cli, "_launch", launch_tripwire)
    for key in cli.LAUNCHED_ENV:
        monkeypatch.delenv(key, raising=False)


@pytest.fixture(scope="session")
def two_rank_run(tmp_path_factory) -> Path:
    """The uninterrupted 2-rank run of 6 steps (test_checkpoint.py's flags) on a cosine schedule, a checkpoint after
    every step, --export-on-end in shards of at most 300 KB (the tiny model is 1 MB in fp32): one launch that the
    resumes of test_checkpoint.py, test_chaos.py and test_stop.py compare against (test_trdpo.py reads a checkpoint)."""
    from launching import ranks_module, run
    from test_checkpoint import SCHEDULE, flags

    tmp = tmp_path_factory.mktemp("two_ranks")
    run(ranks_module(2, "ds_packdpo.train", *flags(tmp, "straight", *SCHEDULE, "--save-steps", "1",
                                                   "--export-on-end", "--max-shard-size", "300KB")))
    return tmp / "straight"
