"""Every recipe of examples/ passes phase one (settings, DeepSpeed config, data, plan, memory estimate) at the
world size it is written for, with its hub model replaced by a local tiny one and its dataset by a local file:
what a user's first command with it would meet, short of the weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from ds_packdpo import cli
from ds_packdpo.command_settings import not_acted_on
from ds_packdpo.config import TrainConfig, parse_train_args
from ds_packdpo.evaluate import parse_eval_args
from ds_packdpo.precompute_ref import parse_args, precompute_setup

from conftest import DPO_DEMO_PATH
from test_reference import save_tiny_model

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
MULTI_RESPONSE_PATH = DPO_DEMO_PATH.parent / "multi_response_demo.jsonl"
# recipe -> ranks it runs on (its comment's launch)
WORLD = {"llama8b_full_1node.yaml": 8, "qwen7b_lora_4gpu.yaml": 4, "llama70b_4nodes_sp.yaml": 32,
         "many_responses.yaml": 2}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("model") / "tiny", seed=0)


def test_every_recipe_is_checked():
    assert sorted(p.name for p in EXAMPLES.glob("*.yaml")) == sorted([*WORLD, "precomputed_reference.yaml"])


def local_flags(recipe: Path, model: Path, tmp_path: Path) -> list[str]:
    """The recipe with its hub model and its dataset replaced (flags on the command line win over --config)."""
    settings = yaml.safe_load(recipe.read_text())
    assert "/" in settings["model"] and not Path(settings["model"]).exists(), "a recipe names a hub model"
    dataset = MULTI_RESPONSE_PATH if settings.get("pairs_from") else DPO_DEMO_PATH
    return ["--config", str(recipe), "--model", str(model), "--dataset", str(dataset),
            "--output-dir", str(tmp_path / "run"), "--cache-dir", str(tmp_path / "cache")]


@pytest.mark.parametrize("name", sorted(WORLD))
def test_recipe_passes_phase_one(name, tiny_model, tmp_path, no_launch, capsys):
    recipe = EXAMPLES / name
    flags = local_flags(recipe, tiny_model, tmp_path)
    assert cli.main(["train", *flags, "--num-procs", str(WORLD[name]), "--dry-run"]) == 0, capsys.readouterr().err
    plan, estimate = capsys.readouterr().out.splitlines()
    settings = yaml.safe_load(recipe.read_text())
    sp = settings.get("sequence_parallel_size", 1)
    assert f"on {WORLD[name]} ranks ({WORLD[name] // sp} data-parallel x {sp} sequence-parallel)" in plan, plan
    assert estimate.startswith("memory per GPU (estimate): ")
    cfg = parse_train_args(flags)
    for key, value in settings.items():
        if key not in ("model", "dataset", "output_dir"):
            assert getattr(cfg, key) == value, key
    assert not (tmp_path / "run").exists()


def test_precomputed_reference_recipe_passes_phase_one(tiny_model, tmp_path, capfd):
    """Its first command as its comment gives it: precompute-ref runs the training recipe, setting aside (in one
    warning) the settings it does not act on."""
    recipe = EXAMPLES / "precomputed_reference.yaml"
    flags = local_flags(recipe, tiny_model, tmp_path)
    at = flags.index("--output-dir")  # precompute-ref writes --out only: it refuses the flag typed
    out = tmp_path / "ref" / "ref_logps.jsonl"
    cfg, _ = parse_args([*flags[:at], *flags[at + 2:], "--out", str(out)])
    precompute_setup(cfg, str(out), world_size=2)
    assert not out.exists()
    assert f"warning: output_dir from --config {recipe}: precompute-ref runs" in capfd.readouterr().err


@pytest.mark.parametrize("name", sorted(WORLD))
def test_training_recipes_run_with_eval_and_precompute_ref(name, tiny_model, tmp_path, capfd):
    """A training recipe given to eval or precompute-ref: the settings the command does not act on (the recipe's
    lr, save_steps, eval_steps, lora_r ...) are set aside in one warning, never refused."""
    recipe = EXAMPLES / name
    flags = local_flags(recipe, tiny_model, tmp_path)
    at = flags.index("--output-dir")  # both refuse it typed: eval writes no folder, precompute-ref only --out
    flags = flags[:at] + flags[at + 2:]
    settings = yaml.safe_load(recipe.read_text())
    for command, parse in (("eval", lambda: parse_eval_args([*flags, "--ref-model", str(tiny_model)])),
                           ("precompute-ref", lambda: parse_args([*flags, "--out", str(tmp_path / "ref.jsonl")])[0])):
        cfg = parse()
        defaults = TrainConfig()
        aside = [key for key in not_acted_on(command) if key in settings and settings[key] != getattr(defaults, key)]
        assert aside and f"warning: {', '.join(aside)} from --config {recipe}: {command} " in capfd.readouterr().err
        assert all(getattr(cfg, key) == getattr(defaults, key) for key in aside)
        assert cfg.max_length == settings["max_length"]
