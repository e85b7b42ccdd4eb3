"""eval and precompute-ref honour every training setting they accept or refuse it (command_settings.py).

They take the training flags, and ran without a word those they never act on (--lr, --save-steps, --eval-fraction
for precompute-ref, ...).  Typed, such a setting is now refused in one line before any rank starts; from a --config
training recipe it is set aside with one warning and the command runs.  The launcher is a recorder here.
"""

from __future__ import annotations

import pytest
import yaml
from test_bad_input import assert_one_line_error
from test_reference import save_tiny_model

from ds_packdpo import cli, evaluate, precompute_ref
from ds_packdpo.command_settings import NOT_ACTED_ON, not_acted_on
from ds_packdpo.config import TrainConfig
from ds_packdpo.run.launch_group import LaunchOutcome

# A training recipe: settings every command acts on, and some only training does.
RECIPE = {"max_length": 64, "synthetic_pairs": 16, "beta": 0.2, "ld_alpha": 0.5, "global_batch_pairs": 8,
          "lr": 2.0e-5, "max_steps": 3, "save_steps": 2, "output_dir": "runs/recipe", "sync_ref_model": True,
          "eval_fraction": 0.25, "report_to": "csv"}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("model") / "tiny", seed=0))


@pytest.fixture
def launches(monkeypatch):
    """The command lines the front process handed to the launcher (none started)."""
    started = []
    monkeypatch.setattr(cli, "run_launcher", lambda cmd, env, grace_s, on_line=None: started.append(cmd) or LaunchOutcome(0))
    for key in cli.LAUNCHED_ENV:
        monkeypatch.delenv(key, raising=False)
    return started


def command_line(command: str, model: str, tmp_path) -> list[str]:
    common = ["--cache-dir", str(tmp_path / "cache"), "--no-progress", "--num-procs", "1"]
    if command == "eval":
        return ["eval", "--model", model, "--ref-model", model, *common]
    return ["precompute-ref", "--model", model, "--out", str(tmp_path / "ref.jsonl"), *common]


@pytest.mark.parametrize("command, flags", [
    ("eval", ["--lr", "1e-3", "--max-steps", "3"]),
    ("eval", ["--save-steps", "2", "--output-dir", "elsewhere"]),
    ("eval", ["--sync-ref-model"]),
    ("precompute-ref", ["--lr", "1e-3", "--epochs", "2"]),
    ("precompute-ref", ["--eval-fraction", "0.25", "--beta", "0.3"]),
    ("precompute-ref", ["--resume", "auto", "--loss", "ipo"]),
])
def test_a_typed_setting_the_command_does_not_act_on_is_refused_before_any_launch(command, flags, model, tmp_path,
                                                                                    launches, capsys):
    assert cli.main([*command_line(command, model, tmp_path), *flags]) == 2
    named = [flag for flag in flags if flag.startswith("--")]
    assert_one_line_error(2, capsys.readouterr().err, f"{', '.join(named)}: {command} ", "drop them")
    assert launches == [] and not (tmp_path / "ref.jsonl").exists() and not (tmp_path / "elsewhere").exists()


@pytest.mark.parametrize("command", ["eval", "precompute-ref"])
def test_a_training_recipe_runs_with_what_the_command_does_not_act_on_set_aside(command, model, tmp_path, launches,
                                                                               capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(RECIPE))
    argv = [*command_line(command, model, tmp_path), "--config", str(recipe)]
    assert cli.main(argv) == 0, capsys.readouterr().err
    assert len(launches) == 1 and launches[0][-2:] == ["--config", str(recipe)]  # the ranks read the same recipe
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: ")]
    aside = [name for name in not_acted_on(command) if name in RECIPE]
    assert f"warning: {', '.join(aside)} from --config {recipe}: {command} " in "\n".join(warnings)
    assert len([line for line in warnings if f"from --config {recipe}" in line]) == 1
    # what a rank parses: the settings the command acts on from the recipe, the others at their defaults
    rank_argv = launches[0][launches[0].index("--module") + 2:]
    cfg = evaluate.parse_eval_args(rank_argv) if command == "eval" else precompute_ref.parse_args(rank_argv)[0]
    defaults = TrainConfig()
    for name, value in RECIPE.items():
        assert getattr(cfg, name) == (getattr(defaults, name) if name in aside else value), name
    assert not set(aside) & (cfg.given | cfg.from_file)
    assert {"max_length", "ld_alpha"} <= cfg.given  # both commands act on them
    assert ("beta" in aside) is (command == "precompute-ref")  # eval's loss, not the reference's


def test_each_command_keeps_what_it_acts_on():
    """eval computes the loss and its figures on the held-out pairs; precompute-ref runs the reference over every
    pair on the ranks' plan; bench trains."""
    for name in ("loss", "beta", "ld_alpha", "use_weighting", "ref_logps", "eval_fraction", "eval_dataset",
                 "eval_max_pairs", "micro_batch_pairs", "max_tokens_per_row", "seed", "ref_offload"):
        assert name not in not_acted_on("eval"), name
    for name in ("ld_alpha", "ref_model", "max_length", "max_prompt_length", "global_batch_pairs", "tokens_per_step",
                 "overwrite", "dtype", "max_tokens_per_row", "seed", "ref_offload"):
        assert name not in not_acted_on("precompute-ref"), name
    for name in ("lr", "max_steps", "optimizer", "lora_r", "loss", "peak_tflops"):
        assert name not in not_acted_on("bench"), name
    for command, groups in NOT_ACTED_ON.items():
        names = not_acted_on(command)
        assert len(set(names)) == len(names) and set(names) <= set(TrainConfig.__dataclass_fields__), command


def test_what_a_command_sets_aside_is_not_judged(model, tmp_path, capsys):
    """A training recipe that names the --ref-logps file precompute-ref is about to write: set aside before the
    settings are validated (validated first, the missing file was refused)."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"max_length": 64, "ref_logps": str(tmp_path / "ref.jsonl"), "lr": 1.0e-5}))
    cfg, _ = precompute_ref.parse_args(["--config", str(recipe), "--model", model, "--out", str(tmp_path / "r.jsonl")])
    assert cfg.ref_logps is None and cfg.lr == TrainConfig().lr and cfg.max_length == 64
    assert f"warning: lr, ref_logps from --config {recipe}: precompute-ref" in capsys.readouterr().err
