"""Fuzz over every flag of every command that starts ranks or reads data: no value reaches a rank that would die.

Each case runs the command in-process with the launcher replaced by a recorder (no rank starts; ``check``'s model
never builds).  A value outside what its consumer accepts (a negative count, a port beyond 65535, NaN, a seed
numpy rejects, text for a number, an unknown choice) must be refused before the launch, in one line
``error: ...`` naming the flag, exit 2.  Any other value (and seeded random combinations of several flags) must
end either in that one-line refusal or in the launch: never a traceback.  The seed and the count of cases tried
are printed (DS_PACKDPO_FUZZ_SEED replays another draw).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
from pathlib import Path

import datasets
import huggingface_hub
import pytest
from test_bad_input import tokenizer_dir  # noqa: F401  (a fixture)

from transformers import AutoModelForCausalLM

from ds_packdpo import bench, check, cli
from ds_packdpo.config import train_parser
from ds_packdpo.model.build import tiny_config

SEED = int(os.environ.get("DS_PACKDPO_FUZZ_SEED", "28"))
COMBINATIONS = 40
FRONT_ONLY = {"--num-procs": int, "--master-port": int}
NEGATIVE_OK = {"--simpo-gamma", "--f-alpha-divergence-coef"}  # a target margin, an alpha-divergence's alpha: any real
BAD_TEXT = {int: ["-1", "-7", str(2**63), "1.5", "x", ""], float: ["nan", "inf", "-inf", "-1", "1e400", "x"]}
OTHER = {int: ["0", "1", "3", "64", str(2**31)], float: ["0", "0.5", "1", "2", "1e-12"],
         str: ["", "/proc/ds_packdpo_fuzz/x", "a,b", "./nope"]}  # no bare names: a hub lookup retries for 23 s offline


class Launched(Exception):
    """Phase one accepted the case: the command would start ranks (or build check's model) now."""


def parsers() -> dict[str, argparse.ArgumentParser]:
    precompute = train_parser("ds-packdpo precompute-ref")
    precompute.add_argument("--out")
    return {"train": train_parser(), "eval": train_parser("ds-packdpo eval"), "precompute-ref": precompute,
            "bench": bench.bench_parser("ds-packdpo bench"), "prepare": cli.prepare_parser(),
            "pack-stats": cli.pack_stats_parser(), "check": cli.check_parser()}


def options(command: str, parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    found = {action.option_strings[0]: action for action in parser._actions
             if action.option_strings and action.help != argparse.SUPPRESS
             and not isinstance(action, argparse._HelpAction)}
    if command in ("train", "eval", "precompute-ref", "bench"):
        for name, tp in FRONT_ONLY.items():
            found[name] = argparse.Action([name], name[2:], type=tp)
    return found


def bad_values(name: str, action: argparse.Action) -> list[str]:
    """Values every consumer refuses: outside the type's range, of another type, or no choice."""
    if action.choices:
        return ["no-such-choice"]
    values = list(BAD_TEXT.get(action.type, []))
    if name in NEGATIVE_OK:
        values = [v for v in values if v not in ("-1",)]
    if name == "--master-port":
        values.append("65536")
    if name == "--seed":
        values.append(str(2**32))  # numpy's seeds are below 2**32
    return values


def other_values(action: argparse.Action, rng: random.Random) -> list[str]:
    if isinstance(action, argparse.BooleanOptionalAction):
        return [rng.choice(action.option_strings)]
    if action.nargs == 0:
        return [action.option_strings[0]]
    if action.choices:
        return [action.option_strings[0], str(rng.choice(list(action.choices)))]
    return [action.option_strings[0], rng.choice(OTHER.get(action.type, OTHER[str]))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, demo_tokenizer) -> Path:
    """A tiny HF folder (weights and tokenizer): eval needs a trained model to look at."""
    folder = tmp_path_factory.mktemp("model")
    AutoModelForCausalLM.from_config(tiny_config(vocab_size=len(demo_tokenizer))).save_pretrained(folder)
    demo_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def attempt(tmp_path, tokenizer_dir, model_dir, monkeypatch, capsys):  # noqa: F811
    """``attempt(command, *flags) -> (exit code, stderr, launched)`` with no rank and no model."""
    def launch(*args, **kwargs):
        raise Launched

    def model_alone(*args, **kwargs):
        raise Launched

    monkeypatch.setattr(cli, "_launch", launch)
    monkeypatch.setattr(check, "model_alone", model_alone)
    for key in cli.LAUNCHED_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.chdir(tmp_path)
    for module in (huggingface_hub.constants, datasets.config):  # no hub lookups (a bare --dataset name is one)
        monkeypatch.setattr(module, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    base = ["--cache-dir", str(tmp_path / "cache"), "--tokenizer", str(tokenizer_dir), "--max-length", "64",
            "--synthetic-pairs", "16", "--no-progress"]
    count = [0]

    def run(command: str, *flags: str) -> tuple[int, str, bool]:
        count[0] += 1
        # eval writes no folder, precompute-ref only --out (command_settings.py: they refuse the flags typed)
        extra = {"eval": [], "precompute-ref": ["--overwrite"]}.get(
            command, ["--output-dir", str(tmp_path / "out"), "--overwrite"])
        extra += ["--out", str(tmp_path / f"ref{count[0]}.jsonl")] if command == "precompute-ref" else []
        extra += ["--out", str(tmp_path / f"bench{count[0]}")] if command == "bench" else []
        extra += ["--model", str(model_dir), "--ref-model", str(model_dir)] if command == "eval" else []
        argv = [command, *base, *extra, *flags]
        try:
            code, launched = cli.main(argv), False
        except Launched:
            code, launched = 0, True
        except SystemExit as exit_:  # argparse: a value of the wrong type or no choice
            code, launched = exit_.code, False
        err = capsys.readouterr().err
        assert "Traceback" not in err, (argv, err[-2000:])
        if not launched and code:
            lines = err.strip().splitlines()
            assert code == 2 and lines and lines[-1].startswith("error: "), (argv, code, err[-2000:])
        return code, err, launched

    run.count = count
    return run


def test_every_flag_of_every_command_refuses_what_its_consumer_cannot_take(attempt, capsys):
    rng = random.Random(SEED)
    refused, missed = 0, []
    for command, parser in parsers().items():
        for name, action in options(command, parser).items():
            if name in ("--config", "--out"):
                continue  # files: a --config file's keys are the flags fuzzed here
            for value in bad_values(name, action):
                code, err, launched = attempt(command, f"{name}={value}")
                last = err.strip().splitlines()[-1] if err.strip() else ""
                if launched or code != 2 or name not in last:  # the one line names the flag
                    missed.append((command, name, value, "launched" if launched else last))
                else:
                    refused += 1
            attempt(command, *other_values(action, rng))
    assert not missed, "\n".join(map(str, missed))
    with capsys.disabled():
        print(f"\nflag fuzz seed {SEED}: {refused} out-of-range values refused in phase one, "
              f"{attempt.count[0]} cases in all")


def test_random_combinations_end_in_one_line_or_a_launch(attempt, capsys):
    rng = random.Random(SEED)
    outcomes = {"refused": 0, "launched": 0}
    commands = parsers()
    for _ in range(COMBINATIONS):
        command = rng.choice(list(commands))
        names = [name for name in options(command, commands[command]) if name not in ("--config", "--out")]
        flags = []
        for name in rng.sample(names, rng.randint(2, 4)):
            action = options(command, commands[command])[name]
            flags += other_values(action, rng)
        _, _, launched = attempt(command, *flags)
        outcomes["launched" if launched else "refused"] += 1
    with capsys.disabled():
        print(f"flag combinations seed {SEED}: {outcomes}")


@pytest.mark.parametrize("command, flag", [("train", "--output-dir"), ("train", "--save-dir"), ("prepare", "--cache-dir"),
                                           ("train", "--metrics-out"), ("pack-stats", "--plan-out"),
                                           ("prepare", "--out"), ("bench", "--out")])
def test_an_output_path_the_os_refuses_is_refused_in_phase_one(attempt, command, flag):
    """/proc takes no new folder, even for root: without the check the first mkdir (a rank's) raised a traceback."""
    code, err, launched = attempt(command, f"{flag}=/proc/ds_packdpo_fuzz/x")
    assert not launched and code == 2
    assert err.strip().splitlines()[-1].startswith(f"error: {flag} /proc/ds_packdpo_fuzz"), err
    assert "cannot write there (in /proc)" in err


# export, report and verify-checkpoint start no rank: bad arguments of each kind (a missing or wrong folder, a value
# of the wrong type or out of range, an output that would replace an input), each with what the one line must name.
# ``report BENCH --out /proc/...`` ended in a traceback, and ``--out`` naming (or holding) an input with --overwrite
# replaced a bench folder with its own report.
NO_RANK_CASES = [
    ("export", ["--checkpoint", "missing", "--out", "hf"], "--checkpoint missing: no such checkpoint folder"),
    ("export", ["--checkpoint", "empty", "--out", "hf"], "--checkpoint empty: neither a checkpoint"),
    ("export", ["--checkpoint", "afile", "--out", "hf"], "--checkpoint afile: neither a checkpoint"),
    ("export", ["--checkpoint", "junk", "--out", "hf"], "--checkpoint junk: no manifest.json"),
    ("export", ["--checkpoint", "empty", "--out", "hf", "--dtype", "fp16"], "--dtype: invalid choice: 'fp16'"),
    ("export", ["--checkpoint", "empty", "--out", "hf", "--max-shard-size", "0GB"], "--max-shard-size 0GB: must be"),
    ("export", ["--checkpoint", "empty", "--out", "hf", "--max-shard-size", "lots"],
     "--max-shard-size lots: not a size"),
    ("export", ["--checkpoint", "empty", "--out", "afile"], "--out afile: exists and is not a folder"),
    ("export", ["--checkpoint", "empty", "--out", "full"], "--out full: folder is not empty (pass --overwrite"),
    ("export", ["--checkpoint", "empty", "--out", "/proc/ds_packdpo_fuzz/x"], "--out /proc/ds_packdpo_fuzz/x: cannot"),
    ("export", ["--checkpoint", "junk", "--out", ".", "--overwrite"], "--out .: would replace junk, which this"),
    ("export", ["--out", "hf"], "the following arguments are required: --checkpoint"),
    ("report", ["missing", "--out", "r"], "report missing: no report.json"),
    ("report", ["empty", "--out", "r"], "report empty: no report.json"),
    ("report", ["junk", "--out", "r"], "report junk: no report.json"),
    ("report", ["not_json", "--out", "r"], "not_json/report.json: not valid JSON"),
    ("report", ["bench", "--out", "/proc/ds_packdpo_fuzz/x"], "--out /proc/ds_packdpo_fuzz/x: cannot write there"),
    ("report", ["bench", "--out", "bench", "--overwrite"], "--out bench: would replace bench, which this command"),
    ("report", ["bench", "--out", ".", "--overwrite"], "--out .: would replace bench"),
    ("report", ["bench", "--out", "afile", "--overwrite"], "--out afile: exists and is not a folder"),
    ("report", ["bench", "--out", "full"], "--out full: folder is not empty (pass --overwrite"),
    ("report", ["bench"], "the following arguments are required: --out"),
    ("report", ["--out", "r"], "the following arguments are required: folders"),
    ("bench", ["--dataset", "full/kept.txt", "--out", "full", "--overwrite"],
     "--out full: would replace full/kept.txt, which this command reads"),  # --overwrite replaced the dataset's folder
    ("bench", ["--tokenizer", "bench", "--out", ".", "--overwrite"], "--out .: would replace bench, which this"),
    ("bench", ["--out", "afile", "--overwrite"], "--out afile: exists and is not a folder"),
    ("bench", ["--cache-dir", "new/cache", "--out", "new"], "--out new: would replace new/cache"),  # made later
    ("bench", ["--out", "/proc/ds_packdpo_fuzz/x"], "--out /proc/ds_packdpo_fuzz/x: cannot write there"),
    ("verify-checkpoint", ["missing"], "verify-checkpoint missing: no such checkpoint folder"),
    ("verify-checkpoint", ["afile"], "verify-checkpoint afile: no such checkpoint folder"),
    ("verify-checkpoint", ["empty"], "verify-checkpoint empty: neither a checkpoint"),
    ("verify-checkpoint", ["junk"], "verify-checkpoint junk: no intact checkpoint (junk: DAMAGED: no manifest.json"),
    ("verify-checkpoint", [], "the following arguments are required: folder"),
    ("verify-checkpoint", ["empty", "--overwrite"], "unrecognized arguments: --overwrite"),
]


def _tree(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.is_dir(), p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


@pytest.mark.parametrize("command, args, named", NO_RANK_CASES,
                         ids=[f"{c}-{'-'.join(a) or 'none'}" for c, a, _ in NO_RANK_CASES])
def test_commands_without_ranks_refuse_bad_arguments_in_one_line_and_write_nothing(command, args, named, tmp_path,
                                                                                    monkeypatch, capsys):
    """Exit 2 (docs/troubleshooting.md: bad input; verify-checkpoint: none intact) with one line ``error: ...``
    naming the argument, no traceback, and the folder as it was."""
    monkeypatch.chdir(tmp_path)
    for folder in ("empty", "full", "junk", "not_json", "bench"):
        (tmp_path / folder).mkdir()
    (tmp_path / "afile").write_text("x")
    (tmp_path / "full" / "kept.txt").write_text("x")
    (tmp_path / "junk" / "ds_packdpo_state.json").write_text("{bad")  # no manifest: a save that did not finish
    (tmp_path / "not_json" / "report.json").write_text("{bad")
    shutil.copy(Path(__file__).resolve().parent.parent / "docs" / "bench_prefix_report.json",
                tmp_path / "bench" / "report.json")
    before = _tree(tmp_path)
    try:
        code = cli.main([command, *args])
    except SystemExit as exit_:  # argparse: a missing argument, a value of the wrong type or no choice
        code = exit_.code
    err = capsys.readouterr().err
    assert "Traceback" not in err, err[-2000:]
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and named in lines[0], (code, err)
    assert _tree(tmp_path) == before
