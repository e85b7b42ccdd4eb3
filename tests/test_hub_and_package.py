"""Hub ids for --model/--ref-model/--tokenizer (from a hub cache built here, offline: nothing is downloaded), and the
installable package: the wheel carries the DeepSpeed configs, found through importlib.resources."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants
from launching import REPO

from ds_packdpo.config import parse_train_args
from ds_packdpo.data.synthetic import default_tokenizer, synthetic_preference_rows
from ds_packdpo.data import tokenizer as tokenizer_module
from ds_packdpo.errors import InputError
from ds_packdpo.hub import is_hub_id
from ds_packdpo.model import build
from ds_packdpo.run.assemble import model_alone, model_spec, prepare
from ds_packdpo.run.engines import builtin_ds_configs, load_ds_config
from ds_packdpo.run.reference import model_fingerprint

HUB_ID = "tiny-org/tiny-dpo"
COMMITS = {"main": "a" * 40, "v1": "b" * 40}


@pytest.fixture
def offline_hub_cache(tmp_path, monkeypatch):
    """A hub cache holding HUB_ID at two commits (main, tag v1: other weights), read offline."""
    cache = tmp_path / "hub"
    repo = cache / f"models--{HUB_ID.replace('/', '--')}"
    tokenizer = default_tokenizer(synthetic_preference_rows(16, seed=0))
    for seed, (ref, commit) in enumerate(COMMITS.items()):
        snapshot = repo / "snapshots" / commit
        build.build_model(None, "tiny", len(tokenizer) + 8, torch.float32, "eager", seed=seed).save_pretrained(snapshot)
        tokenizer.save_pretrained(snapshot)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def _spy(monkeypatch, owner, name: str, calls: list):
    real = getattr(owner, "from_pretrained")

    def recording(source, *args, **kwargs):
        calls.append((name, source, kwargs.get("revision")))
        return real(source, *args, **kwargs)

    monkeypatch.setattr(owner, "from_pretrained", recording)


def test_a_hub_id_reaches_from_pretrained_unchanged_with_its_revision(offline_hub_cache, tmp_path, monkeypatch):
    calls = []
    _spy(monkeypatch, build.AutoModelForCausalLM, "model", calls)
    _spy(monkeypatch, build.AutoConfig, "config", calls)
    _spy(monkeypatch, tokenizer_module.AutoTokenizer, "tokenizer", calls)
    models = {}
    for revision in (None, "v1"):
        flags = ["--model", HUB_ID, "--synthetic-pairs", "16", "--max-length", "48", "--cache-dir", str(tmp_path / "c")]
        cfg = parse_train_args(flags + (["--revision", revision] if revision else []))
        setup = prepare(cfg, "check")
        models[revision] = model_alone(setup)
        assert model_fingerprint(setup.spec.model, setup.vocab_size, False) == {"hub_id": HUB_ID,
                                                                         "commit": COMMITS[revision or "main"]}
    assert {name for name, _, _ in calls} == {"model", "config", "tokenizer"}
    assert all(source == HUB_ID for _, source, _ in calls), calls
    # (transformers' own inner calls pass the revision on resolved, as ResolvedRevision(initial=...))
    assert {getattr(revision, "initial", revision) for _, _, revision in calls} == {None, "v1"}
    assert not torch.equal(models[None].lm_head.weight, models["v1"].lm_head.weight)  # v1 is the other commit


def test_offline_mode_gives_one_line_error_for_an_uncached_id(offline_hub_cache, tmp_path):
    for flags, where in [(["--model", "nobody/nothing"], "tokenizer nobody/nothing"),
                         (["--model", HUB_ID, "--ref-model", "nobody/nothing"], "--ref-model nobody/nothing")]:
        cfg = parse_train_args([*flags, "--synthetic-pairs", "16", "--cache-dir", str(tmp_path / "c"),
                                "--output-dir", str(tmp_path / "out")])
        with pytest.raises(InputError) as info:
            prepare(cfg, "train", world_size=1)
        message = str(info.value)
        assert message.startswith(where) and "HF_HUB_OFFLINE is set" in message and "\n" not in message, message


def test_hub_ids_and_local_paths_are_told_apart(tmp_path):
    assert is_hub_id("Qwen/Qwen2.5-0.5B-Instruct") and is_hub_id("gpt2")
    assert not is_hub_id(str(tmp_path)) and not is_hub_id("./model") and not is_hub_id("a/b/c")
    with pytest.raises(InputError, match="no such folder, and not a hub model id"):
        model_spec(parse_train_args(["--model", str(tmp_path / "missing")]), "fp32", "cpu")
    with pytest.raises(InputError, match="--revision v1: names a revision of a hub --model"):
        model_spec(parse_train_args(["--revision", "v1"]), "fp32", "cpu")


# ----------------------------------------------------------------------------- the installable package


def test_builtin_ds_configs_resolve_through_the_package():
    assert builtin_ds_configs() == ["zero2", "zero3", "zero3_offload"]
    config, source = load_ds_config("zero3")
    assert config["zero_optimization"]["stage"] == 3 and "ds_packdpo/ds_configs/zero3.json" in source
    # the README's ds_configs/ paths name the same files
    assert load_ds_config(str(REPO / "ds_configs" / "zero2.json"))[0] == load_ds_config("zero2")[0]


def test_the_wheel_carries_the_ds_configs(tmp_path):
    """``pip wheel .`` (no build isolation: nothing is downloaded) packs every built-in config into the package.
    Built from a copy of what the wheel is made of, so the checkout gets no build/ folder."""
    source = tmp_path / "source"
    shutil.copytree(REPO / "ds_packdpo", source / "ds_packdpo", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(source)], check=True, capture_output=True, timeout=300, cwd=tmp_path)
    (wheel,) = tmp_path.glob("ds_packdpo-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    shipped = sorted(Path(n).stem for n in names if n.startswith("ds_packdpo/ds_configs/") and n.endswith(".json"))
    assert shipped == builtin_ds_configs(), names
    assert "ds_packdpo/hub.py" in names and not any(n.startswith("tests/") for n in names)
