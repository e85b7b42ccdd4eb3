"""Every flag of every command changes exactly the setting it names (design invariant 6).

Each command's parser is walked option by option: the option is set to a value other
than its default and the parsed settings (the validated TrainConfig and the command's
own options) must differ from those of the same command line without it in exactly the
field the flag names.  Booleans are tried in both spellings.  A new flag is covered
without touching this file; one whose value needs a real file or another flag gets it
from the ``values`` fixture and CONTEXT.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from ds_packdpo import bench, cli, evaluate, precompute_ref
from ds_packdpo import config as config_module
from ds_packdpo.command_settings import not_acted_on
from ds_packdpo.errors import InputError
from ds_packdpo.config import TrainConfig, config_from_args, flag_fields, parse_train_args, train_parser
from ds_packdpo.run.assemble import output_spec


def to_dict(cfg) -> dict:
    """Every setting, the --config file's name included (run_config.json leaves it out)."""
    return {f.name: getattr(cfg, f.name) for f in flag_fields(type(cfg))}


def _train(argv):
    return to_dict(parse_train_args(argv))


def _data_command(parser_fn):
    def parse(argv):
        args = parser_fn().parse_args(argv)
        settings = to_dict(config_from_args(args))
        return {**settings, **{k: v for k, v in vars(args).items() if k not in settings}}  # + the command's own
    return parse


def _bench(argv):
    cfg, settings = bench.parse_bench_args(argv)
    return {**to_dict(cfg), **dataclasses.asdict(settings)}


def _precompute_ref(argv):
    cfg, out = precompute_ref.parse_args(argv)
    return {**to_dict(cfg), "out": out}


def _eval(argv):
    return to_dict(evaluate.parse_eval_args(argv))


def _plain(parser_fn):
    return lambda argv: vars(parser_fn().parse_args(argv))


# command -> (parser, parse to a flat dict of settings, the required arguments)
COMMANDS = {
    "train": (train_parser, _train, []),
    "bench": (lambda: bench.bench_parser("ds-packdpo bench"), _bench, []),
    "precompute-ref": (None, _precompute_ref, []),
    "eval": (evaluate.eval_parser, _eval, []),
    "prepare": (cli.prepare_parser, _data_command(cli.prepare_parser), []),
    "pack-stats": (cli.pack_stats_parser, _data_command(cli.pack_stats_parser), []),
    "check": (cli.check_parser, _data_command(cli.check_parser), []),
    "export": (cli.export_parser, _plain(cli.export_parser), ["--checkpoint", "c", "--out", "o"]),
    "report": (cli.report_parser, _plain(cli.report_parser), ["folder", "--out", "o"]),
}
# The settings a command refuses typed (command_settings.py): the flag must be refused, naming it.
REFUSED = {command: not_acted_on(command) for command in ("precompute-ref", "eval", "bench")}
# Flags that need another one to be valid at all (they are given in both command lines).
CONTEXT = {"--ref-model": ["--model", "MODEL"], "--save-total-limit": ["--save-steps", "1"],
           "--allow-new-layout": ["--resume", "MODEL"], "--revision": ["--model", "org/hub-model"],
           "--eval-steps": ["--eval-fraction", "0.5"], "--eval-max-pairs": ["--eval-fraction", "0.5"],
           "--project": ["--report-to", "wandb"],
           **{f"--lora-{name}": ["--lora-r", "1"] for name in ("alpha", "dropout", "target-modules")},
           **{f"--ref-model-{name}": ["--sync-ref-model"] for name in ("mixup-alpha", "sync-steps")}}


@pytest.fixture
def values(tmp_path, monkeypatch) -> dict[str, str]:
    """Values that must name something real (validated when parsed)."""
    monkeypatch.chdir(tmp_path)  # bench's default --out (runs/bench) must not exist
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    config = tmp_path / "settings.json"
    config.write_text("{}")
    ref = tmp_path / "ref.jsonl"
    ref.write_text("")
    return {"MODEL": str(model), "--model": str(model), "--ref-model": str(model), "--tokenizer": str(model),
            "--config": str(config), "--ref-logps": str(ref), "--resume": str(model),
            "--configurations": "padded", "--adam-beta1": "0.5", "--adam-beta2": "0.5", "--optimizer": "SGD",
            "--report-to": "csv", "--logps-chunk-tokens": "256", "--out": str(tmp_path / "new_out.jsonl"),
            "--max-shard-size": "200MB", "--loss": "sigmoid,ipo", "--loss-weights": "1",
            "--ref-model-mixup-alpha": "0.3"}


def _options(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if action.option_strings and action.help != argparse.SUPPRESS and not isinstance(action, argparse._HelpAction):
            yield action


def _variants(action: argparse.Action, current, values: dict) -> list[list[str]]:
    """Command-line pieces that set ``action`` to something other than ``current`` (both spellings of a boolean)."""
    name = action.option_strings[0]
    if isinstance(action, argparse.BooleanOptionalAction):
        return [[name], [f"--no-{name[2:]}"]]
    if action.nargs == 0:  # store_true
        return [[name]]
    if name in values:
        return [[name, values[name]]]
    if action.choices:
        return [[name, next(str(c) for c in action.choices if c != current)]]
    if action.type is int:
        return [[name, str(current + 1 if current is not None else 2)]]
    if action.type is float:
        return [[name, str(current * 2 if current else 0.25)]]
    return [[name, f"other-{name[2:]}"]]


def _parser_of(command: str) -> argparse.ArgumentParser:
    if command == "precompute-ref":  # its parser lives inside parse_args: the train options plus --out
        parser = train_parser()
        parser.add_argument("--out")
        return parser
    return COMMANDS[command][0]()


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_flag_changes_exactly_what_it_names(command, values):
    _, parse, required = COMMANDS[command]
    walked = set()
    for action in _options(_parser_of(command)):
        flag = action.option_strings[0]
        field = flag[2:].replace("-", "_")
        assert action.dest == field, f"{command} {flag} stores into {action.dest!r}"
        base_argv = [*required, *(a if a.startswith("--") else values.get(a, a) for a in CONTEXT.get(flag, []))]
        base_value = []
        if flag in base_argv:  # a required option: its variant replaces the base command line's value
            at = base_argv.index(flag)
            base_value, base_argv = base_argv[at:at + 2], base_argv[:at] + base_argv[at + 2:]
        if field in REFUSED.get(command, ()):  # honoured or refused, never ignored: refused, naming the flag
            for variant in _variants(action, getattr(TrainConfig(), field), values):
                if variant[0].startswith("--no-"):
                    continue  # the spelling of the default
                with pytest.raises(InputError, match=f"^(--[a-z0-9-]+, )*{flag}(, --[a-z0-9-]+)*: {command} "):
                    parse([*base_argv, *variant])
            walked.add(field)
            continue
        base = parse([*base_argv, *base_value])
        for variant in _variants(action, base[field], values):
            got = parse([*base_argv, *variant])
            differing = sorted(k for k in set(base) | set(got) if base.get(k) != got.get(k))
            if isinstance(action, argparse.BooleanOptionalAction) and got[field] == base[field]:
                assert differing == [], (command, variant, differing)  # the spelling of the default
            else:
                assert differing == [field], (command, variant, differing)
            if isinstance(action, argparse.BooleanOptionalAction):
                assert got[field] is (not variant[0].startswith("--no-")), (command, variant)
        walked.add(field)
    if command in ("train", "bench", "precompute-ref", "eval", "prepare", "pack-stats", "check"):
        # every setting of the run has a flag, and every one was walked
        assert {f.name for f in flag_fields(TrainConfig)} <= walked


def test_packing_spellings_and_config_key(tmp_path):
    """--no-packing trains padded, --packing packed (BooleanOptionalAction once made both spellings of a
    --no-... option mean False), and the config file's "packing" key is honoured and overridden by the flag."""
    assert parse_train_args([]).packing is True
    assert parse_train_args(["--no-packing"]).packing is False
    assert parse_train_args(["--packing"]).packing is True
    settings = tmp_path / "settings.json"
    settings.write_text(json.dumps({"packing": False}))
    assert parse_train_args(["--config", str(settings)]).packing is False
    assert parse_train_args(["--config", str(settings), "--packing"]).packing is True


def test_yaml_recipe_and_run_config_round_trip(tmp_path):
    """--config takes YAML with the JSON file's flat keys (flag names, either spelling); a run's settings, written as
    run_config.json is, read back through --config give the same settings, now all counted as written."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("# a recipe\nlr: 2e-5\nmax-length: 256\nloss: ipo\npacking: false\nlr_scheduler: cosine\n"
                      "global_batch_pairs: 32\n")
    cfg = parse_train_args(["--config", str(recipe), "--max-length", "128"])
    assert (cfg.lr, cfg.max_length, cfg.loss, cfg.packing, cfg.lr_scheduler, cfg.global_batch_pairs) == (
        2e-5, 128, "ipo", False, "cosine", 32)
    assert cfg.given == {"lr", "max_length", "loss", "packing", "lr_scheduler", "global_batch_pairs", "config"}
    as_json = tmp_path / "recipe.json"
    as_json.write_text(json.dumps({"lr": 2e-5, "max_length": 256, "loss": "ipo", "packing": False,
                                   "lr_scheduler": "cosine", "global_batch_pairs": 32}))
    assert to_dict(parse_train_args(["--config", str(as_json)])) == {**to_dict(parse_train_args(
        ["--config", str(recipe)])), "config": str(as_json)}
    for suffix in ("json", "yaml"):
        run_config = tmp_path / f"run_config.{suffix}"
        saved = config_module.to_dict(cfg)
        run_config.write_text(json.dumps(saved) if suffix == "json" else yaml.safe_dump(saved))
        again = parse_train_args(["--config", str(run_config)])
        assert config_module.to_dict(again) == saved
        assert {name for name, value in saved.items() if value is not None} <= again.given


def test_a_recipe_may_write_a_comma_list_as_a_yaml_list(tmp_path):
    """loss: [sigmoid, sft] was refused ('must be str, got list'): a list is the comma-separated text, item by item;
    a list of the wrong items is refused in one line naming the key."""
    def parse(text: str) -> TrainConfig:
        recipe = tmp_path / "recipe.yaml"
        recipe.write_text(text)
        return parse_train_args(["--config", str(recipe)])

    as_lists = parse("loss: [sigmoid, sft]\nloss_weights: [1.0, 0.5]\nlora_r: 4\nlora_target_modules: [q_proj, "
                     "v_proj]\nreport_to: [csv, tensorboard]\n")
    as_text = parse("loss: sigmoid,sft\nloss_weights: '1.0,0.5'\nlora_r: 4\nlora_target_modules: q_proj,v_proj\n"
                    "report_to: csv,tensorboard\n")
    assert as_lists == as_text and as_lists.loss == "sigmoid,sft" and as_lists.loss_weights == "1.0,0.5"
    assert as_lists.loss_config().loss_weights == (1.0, 0.5) and list(output_spec(as_lists).monitors) == ["csv", "tensorboard"]
    for text, got in (("loss_weights: [1.0, yes]", "bool True"), ("loss: [sigmoid, 3]", "int 3"),
                      ("loss: []", "an empty list"), ("report_to: [csv, '']", "str ''")):
        with pytest.raises(InputError, match=f"key '{text.split(':')[0]}' must be a comma-separated string or a "
                                             f"list of .*, got {got}$"):
            parse(text + "\n")


def test_commands_parsers_are_the_ones_main_uses():
    """The parsers walked above are those the subcommands parse with (no second copy of a command's flags)."""
    source = Path(cli.__file__).read_text()
    for name in ("prepare", "pack_stats", "check", "export", "report"):
        assert f"args = {name}_parser().parse_args(argv)" in source
