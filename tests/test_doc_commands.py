"""The commands the docs show still parse, and every flag their prose names still exists.

A renamed or removed flag, a dropped choice or a flag that lost its value leaves the docs showing a command that
fails on its first line; docs/cli.md is generated from the parsers, the pages written by hand are checked here.

A command is a line of a ```bash, ```sh or bare ``` block of README.md, docs/*.md or examples/**/*.md that runs
this project: ``ds-packdpo COMMAND ...``, ``python -m ds_packdpo.MODULE ...``, a launcher's (``deepspeed``,
``torchrun``, ``mpirun``) ``--module``/``-m ds_packdpo.MODULE ...`` (the launcher's own options, before the module,
are its business), or a ``launch/*.sh`` script (the ranks' flags: after its ``--``, if it takes launcher options).
Backslash continuations are joined, comments dropped, ``;``, ``&&`` and `` | `` separate commands (a pipe has
spaces around it: ``a|b`` is a usage alternative); ``NAME=value`` prefixes are the environment; ``$NAME`` is the
value a ``NAME=...`` line of the same block gave it, all the values of a ``for NAME in ...`` loop at once (argparse
takes a repeated flag), or nothing.
Placeholders: ``...`` (the rest of a command, e.g. ``ds-packdpo train ... --resume auto``) is dropped and the flags
around it are still checked; ``[--flag value]`` is usage notation for an optional part, parsed as given, and a
``a|b`` value in it is parsed with each alternative.  Placeholder paths (/models/my-llama) are fine: only the
parsers' own step runs (argparse, and the refusal of the training flags a command does not act on), never the
validation that opens files or models.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from collections import Counter
from pathlib import Path

import pytest
from doc_pages import PAGES, ROOT, code_blocks, prose_lines

from ds_packdpo.cli import launch_options_parser
from ds_packdpo.cli_reference import COMMAND_PARSERS
from ds_packdpo.command_settings import NOT_ACTED_ON
from ds_packdpo.config import TrainConfig, flag_fields, set_aside
from ds_packdpo.errors import InputError

SHELL_BLOCKS = ("bash", "sh", "")
PARSERS = {command: parser for command, parser, _ in COMMAND_PARSERS}
FRONT_LAUNCHES = {command for command, _, launches in COMMAND_PARSERS if launches}  # take --num-procs, --master-port
# the module a rank runs -> its command (cli.py launches them so); ds_packdpo.cli is `ds-packdpo` itself
RANK_MODULES = {"ds_packdpo.train": "train", "ds_packdpo.evaluate": "eval",
                "ds_packdpo.precompute_ref": "precompute-ref", "ds_packdpo.bench": "bench"}
# launch/*.sh -> whether its own launcher options come first, ending at "--" (else every argument is the ranks')
LAUNCH_SCRIPTS = {"launch/local.sh": False, "launch/multinode.sh": True, "launch/mpirun.sh": True,
                  "launch/slurm.sbatch": False}
USAGE_OPTIONAL = re.compile(r"\[(--[^\[\]]*)\]")  # [--dtype bf16|fp32]: an optional part, in usage notation
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
SEPARATORS = {"|", "||", "&&", ";", "&"}


def _closed(text: str) -> bool:
    try:
        shlex.split(text, comments=True)
    except ValueError:  # no closing quotation: a quoted argument goes on on the next line (python -c "...)
        return False
    return True


def _shell_lines(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """The block's lines as the shell reads them: backslash-continued lines and a quote's lines as one, numbered by
    their first."""
    joined, start, text = [], None, ""
    for number, line in lines:
        start = number if start is None else start
        continued = line.rstrip().endswith("\\")
        text += line.rstrip()[:-1] + " " if continued else line
        if not continued:
            if _closed(text):
                joined.append((start, text))
                start, text = None, ""
            else:
                text += "\n"
    return joined


def _simple_commands(line: str) -> list[list[str]]:
    """The line's commands (split at ;, && and a | word), as words, its comment dropped."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&")  # not |: a usage a|b is one word
    lexer.whitespace_split = True
    commands = [[]]
    for word in lexer:
        if word in SEPARATORS:
            commands.append([])
        else:
            commands[-1].append(word)
    return [words for words in commands if words]


def _expand(words: list[str], variables: dict[str, str]) -> list[str]:
    """``$NAME``/``${NAME}`` as the words of its value in the block (nothing if the block does not set it)."""
    expanded = []
    for word in words:
        name = re.fullmatch(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", word)
        expanded += shlex.split(variables.get(name.group(1), "")) if name else [word]
    return expanded


def _invocation(words: list[str]) -> tuple[str, list[str], bool] | None:
    """(command, its arguments, whether the front process parses them) if ``words`` run this project, else None."""
    for i, word in enumerate(words):
        if Path(word).name == "ds-packdpo":
            return (words[i + 1] if i + 1 < len(words) else "", words[i + 2:], True)
        if word in ("-m", "--module") and i + 1 < len(words) and words[i + 1].startswith("ds_packdpo."):
            module, rest = words[i + 1], words[i + 2:]
            if module == "ds_packdpo.cli":
                return (rest[0] if rest else "", rest[1:], True)
            return (RANK_MODULES.get(module, module), rest, False)
        if word in LAUNCH_SCRIPTS:
            rest = words[i + 1:]
            if LAUNCH_SCRIPTS[word] and "--" in rest:
                rest = rest[rest.index("--") + 1:]
            return ("train", rest, False)
    return None


def _alternatives(words: list[str]) -> list[list[str]]:
    """The argument lists ``words`` stands for: each alternative of a usage ``a|b`` value in turn."""
    choices = [word.split("|") if "|" in word else [word] for word in words]
    return [[options[min(k, len(options) - 1)] for options in choices]
            for k in range(max((len(options) for options in choices), default=1))]


def collect_commands(pages: list[Path]) -> list[tuple[str, int, str, list[str], bool]]:
    """(page, line, command, arguments, front process?) of every command the pages show that runs this project."""
    found = []
    for page in pages:
        for language, lines in code_blocks(page):
            if language not in SHELL_BLOCKS:
                continue
            variables = {}
            for number, line in _shell_lines(lines):
                for words in _simple_commands(USAGE_OPTIONAL.sub(r"\1", line)):
                    if words[0] == "for" and words[2:3] == ["in"]:  # a loop's variable: all its values at once
                        variables[words[1]] = " ".join(words[3:])
                    while words and ASSIGNMENT.match(words[0]):
                        name, _, value = words.pop(0).partition("=")
                        if not words:  # a line that only sets variables: the block's $NAME
                            variables[name] = value
                    invocation = _invocation(_expand(words, variables))
                    if invocation:
                        command, arguments, front = invocation
                        found.append((str(page.relative_to(ROOT)), number, command,
                                      [a for a in arguments if a != "..."], front))
    return found


COMMANDS = collect_commands(PAGES)


def parse_error(command: str, arguments: list[str], front: bool) -> str | None:
    """Why ``command`` refuses ``arguments`` at its parse (None: it takes them).

    The front process (``ds-packdpo``) takes the launch options and train's --dry-run itself; a rank does not.
    Beyond argparse only the refusal of a typed training flag the command does not act on runs (set_aside), on
    the settings as typed: the rest of the validation opens files and models the docs only name."""
    if command not in PARSERS:
        return f"no command {command!r} (commands: {', '.join(PARSERS)})"
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):  # argparse prints its one line, then exits
            if front and command in FRONT_LAUNCHES:
                _, arguments = launch_options_parser().parse_known_args(arguments)
                if command == "train":
                    arguments = [a for a in arguments if a != "--dry-run"]
            args = PARSERS[command].parse_args(arguments)
    except SystemExit:
        return errors.getvalue().strip()
    typed = {f.name: getattr(args, f.name) for f in flag_fields() if getattr(args, f.name, None) is not None}
    try:
        for names, why in NOT_ACTED_ON.get(command, ()):  # eval, precompute-ref, bench
            set_aside(TrainConfig(**typed), names, why)
    except InputError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("page, line, command, arguments, front", COMMANDS,
                         ids=[f"{page}:{line}" for page, line, *_ in COMMANDS])
def test_documented_command_parses(page, line, command, arguments, front):
    for variant in _alternatives(arguments):
        error = parse_error(command, variant, front)
        assert error is None, f"{page}:{line}: ds-packdpo {command} {shlex.join(variant)}: {error}"


# Commands shown per command, as measured when this test was written less a margin: a collector that silently
# finds nothing (a changed fence, a renamed module) fails here rather than passing on no commands.
LEAST_SHOWN = {"train": 14, "export": 4, "bench": 4, "precompute-ref": 1, "prepare": 1, "report": 1}


def test_the_collector_finds_the_documented_commands():
    shown = Counter(command for _, _, command, _, _ in COMMANDS)
    pages = {page for page, *_ in COMMANDS}
    assert all(shown[command] >= least for command, least in LEAST_SHOWN.items()), shown
    assert len(pages) >= 8, pages


def test_collector_reads_shell_as_the_docs_write_it():
    variables_block = "F=\"--max-length 256 \\\n  --lr 1e-6\"\nOMP_NUM_THREADS=1 python x.py deepspeed --num_gpus 2 " \
                      "--module ds_packdpo.train $F --out-dir d $unset  # a comment\n"
    page = ROOT / "tests" / "_commands_probe.md"
    page.write_text(f"```bash\n{variables_block}ds-packdpo export --out o [--dtype bf16|fp32] && ds-packdpo report a"
                    f" --out b | tee log\nds-packdpo train ... --resume auto\npip install -e .  # ds-packdpo\n```\n"
                    "```python\nds-packdpo train --not-a-shell-block\n```\n")
    try:
        found = [(line, command, arguments, front) for _, line, command, arguments, front in collect_commands([page])]
    finally:
        page.unlink()
    assert found == [(4, "train", ["--max-length", "256", "--lr", "1e-6", "--out-dir", "d"], False),
                     (5, "export", ["--out", "o", "--dtype", "bf16|fp32"], True),
                     (5, "report", ["a", "--out", "b"], True),
                     (6, "train", ["--resume", "auto"], True)]
    assert _alternatives(found[1][2]) == [["--out", "o", "--dtype", "bf16"], ["--out", "o", "--dtype", "fp32"]]
    assert "--out-dir: did you mean --output-dir?" in parse_error("train", found[0][2], False)
    assert parse_error("eval", ["--lr", "1e-5"], True).startswith("--lr:")  # eval refuses what it does not act on
    assert parse_error("train", ["--num-procs", "2", "--dry-run"], True) is None
    assert parse_error("train", ["--num-procs", "2"], False) is not None  # a rank takes no launch option


# Flags no parser of the project has that the prose names as bare flags, on purpose: the deepspeed launcher's
# (launch/multinode.sh and launch/mpirun.sh pass them on) and multinode.sh's own, mpirun's, scripts/bench_logps.py's, and the abbreviation
# docs/settings.md shows being refused.
OTHER_FLAGS = {"--hostfile", "--include", "--exclude", "--num_nodes", "--num_gpus", "--master_addr", "--master_port",
               "--no_ssh", "--node_rank", "--launcher", "--ssh_port", "--module",  # deepspeed's launcher
               "--export",  # launch/multinode.sh's own
               "--allow-run-as-root", "--oversubscribe",  # mpirun's
               "--chunk-tokens",  # scripts/bench_logps.py's
               "--max-len"}  # refused: flags are whole names only
PROSE_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9_-]*[a-z0-9](-\*)?")


def _project_flags() -> set[str]:
    parsers = [parser for _, parser, _ in COMMAND_PARSERS] + [launch_options_parser()]
    return {name for parser in parsers for action in parser._actions for name in action.option_strings} | \
        {"--dry-run", "--version"}  # train's and ds-packdpo's own, read before any parser (cli.py)


def named_flags(span: str) -> list[str]:
    """The flags a backticked span of prose names as the project's: all of a span of bare flags (``--lr 1e-6``),
    those after the project's command in a command line; none of another program's command line (pip, a script)."""
    words = span.split()
    if words[0].startswith("--"):
        return [m.group(0) for m in PROSE_FLAG.finditer(span)]
    invocation = _invocation(words)
    if invocation is None or invocation[0] not in PARSERS:
        return []
    return [m.group(0) for m in PROSE_FLAG.finditer(" ".join(invocation[1]))]


def _exists(flag: str, known: set[str]) -> bool:
    """``flag`` is known, or for ``--lora-*`` some known flag starts with ``--lora-``."""
    return flag in known or (flag.endswith("-*") and any(k.startswith(flag[:-1]) for k in known))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_flag_the_prose_names_exists(page):
    known = _project_flags() | OTHER_FLAGS
    unknown = [f"{page.relative_to(ROOT)}: {flag} (in `{span}`)"
               for line in prose_lines(page) for span in re.findall(r"`([^`]+)`", line)
               for flag in named_flags(span) if not _exists(flag, known)]
    assert not unknown, "; ".join(unknown)


def test_prose_flags_are_read_as_the_docs_write_them():
    assert named_flags("--lr 1e-6 [--no-progress]") == ["--lr", "--no-progress"]
    assert named_flags("mpirun --bind-to none python -m mpi4py -m ds_packdpo.train --max-steps 2") == ["--max-steps"]
    assert named_flags("pip wheel --no-deps") == [] and named_flags("python -m ds_packdpo.cli_reference --write") == []
    assert _exists("--lora-*", _project_flags()) and not _exists("--lora", _project_flags())
