"""The CLI reference (docs/cli.md), generated from the parsers themselves.

Written by hand it drifted (a command missing from the table, defaults shown that runs did not record);
generated, it cannot: ``tests/test_docs.py`` fails when docs/cli.md differs from :func:`render`.
Regenerate with ``python -m ds_packdpo.cli_reference --write``.

Training flags have ``default=None`` in argparse (so a ``--config`` file can fill what the command line
left out); their real defaults are read from :class:`~ds_packdpo.config.TrainConfig`.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from .bench import bench_parser
from .cli import (check_parser, export_parser, launch_options_parser, pack_stats_parser, prepare_parser, report_parser,
                  verify_checkpoint_parser)
from .config import flag_fields, train_parser
from .evaluate import eval_parser
from .precompute_ref import precompute_parser

DOC_PATH = Path(__file__).resolve().parent.parent / "docs" / "cli.md"

# (command, its parser, whether its front process starts the ranks itself and so takes the launch options)
COMMAND_PARSERS = (
    ("train", train_parser(), True),
    ("prepare", prepare_parser(), False),
    ("pack-stats", pack_stats_parser(), False),
    ("check", check_parser(), False),
    ("precompute-ref", precompute_parser(), True),
    ("eval", eval_parser(), True),
    ("export", export_parser(), False),
    ("verify-checkpoint", verify_checkpoint_parser(), False),
    ("bench", bench_parser("ds-packdpo bench"), True),
    ("report", report_parser(), False),
)

TRAINING_FLAGS = {f.name: f for f in flag_fields()}


def _default(action: argparse.Action, training: bool = True) -> str:
    """The flag's default: a training flag's from TrainConfig (``training``), any other's from its parser."""
    field = TRAINING_FLAGS.get(action.dest) if training else None
    if field is not None:
        value = field.default if field.default is not dataclasses.MISSING else field.default_factory()
    else:
        value = action.default
    if action.required or (not action.option_strings and value is None):
        return "required"
    if value is None:
        return "-"
    return f"`{value}`"


def _names(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.dest.upper()}`"
    if isinstance(action, argparse.BooleanOptionalAction):
        return " / ".join(f"`{name}`" for name in action.option_strings)
    metavar = "{" + ",".join(map(str, action.choices)) + "}" if action.choices else action.dest.upper()
    takes_value = action.nargs != 0
    return ", ".join(f"`{name}{' ' + metavar if takes_value else ''}`" for name in action.option_strings)


def _cell(text: str | None) -> str:
    return " ".join((text or "").split()).replace("|", "\\|")


def _table(actions: list[argparse.Action], training: bool = True) -> list[str]:
    lines = ["| flag | default | what it sets |", "|---|---|---|"]
    lines += [f"| {_names(a)} | {_default(a, training)} | {_cell(a.help)} |" for a in actions]
    return lines


def _documented(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.help != argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)]


def render() -> str:
    """docs/cli.md: every command, every flag, its default and its help."""
    training = {a.dest for a in _documented(train_parser())}
    out = ["# CLI reference", "",
           "Generated from the parsers by `python -m ds_packdpo.cli_reference --write`; `tests/test_docs.py` fails "
           "when this file and the parsers differ. Every training flag is also a key of a `--config` YAML/JSON "
           "file (underscores or dashes).", ""]
    out += [f"- [`ds-packdpo {name}`](#ds-packdpo-{name})" for name, _, _ in COMMAND_PARSERS]
    out += ["- [Training flags](#training-flags)", "- [Launch options](#launch-options)", ""]
    for name, parser, launches in COMMAND_PARSERS:
        takes_training = training <= {a.dest for a in _documented(parser)}
        # a command without the training flags documents all of its own, those named like one too (export's --dtype)
        own = [a for a in _documented(parser) if not takes_training or a.dest not in training]
        out += [f"## `ds-packdpo {name}`", "", _cell(parser.description), ""]
        notes = (["the [training flags](#training-flags)"] if takes_training else []) + \
            (["the [launch options](#launch-options)"] if launches else [])
        if notes:
            out += [f"Takes {' and '.join(notes)}{', and:' if own else '.'}", ""]
        if own:
            out += _table(own, training=takes_training) + [""]
        if parser.epilog:
            out += [_cell(parser.epilog), ""]
    out += ["## Training flags", "", "Taken by train, prepare, pack-stats, check, precompute-ref, eval and bench.", ""]
    out += _table(_documented(train_parser())) + [""]
    out += ["## Launch options", "", _cell(launch_options_parser().description) or
            "Taken by the front process of train, eval, precompute-ref and bench (not passed to the ranks).", ""]
    out += _table(_documented(launch_options_parser()))
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--write"]:
        DOC_PATH.write_text(render())
        print(DOC_PATH)
    else:
        sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
