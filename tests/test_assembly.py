"""The run assembly and the code's shape: one layout, one plan for every command, one place per job, no circles.

The multi-rank proofs that every command honours its layout live next to what they
run: bench at S=2 (test_bench.py), precompute-ref at S=2 inside that bench, resume at
S=2 and a refused layout (test_checkpoint.py), the trajectory at S=2
(test_trainer_multirank.py).
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from ds_packdpo import cli
from ds_packdpo.config import parse_train_args
from ds_packdpo.data.run_plan import run_plan
from ds_packdpo.run.assemble import prepare

PACKAGE = Path(__file__).resolve().parents[1] / "ds_packdpo"
SMALL = ["--synthetic-pairs", "48", "--max-length", "96", "--global-batch-pairs", "12"]


def _plan_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_pack_stats_plans_exactly_what_training_runs_under_sequence_parallelism(tmp_path, capsys):
    """pack-stats at S=2 plans W/S shares of rows of S x the budget, as training's phase one does."""
    cache = ["--cache-dir", str(tmp_path / "cache")]
    sp2, sp1 = tmp_path / "sp2.jsonl", tmp_path / "sp1.jsonl"
    assert cli.main(["pack-stats", *SMALL, *cache, "--world-size", "4", "--sequence-parallel-size", "2",
                     "--max-tokens-per-row", "100", "--plan-out", str(sp2)]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["layout"] == {"world_size": 4, "dp_size": 2, "sp_size": 2}
    # the same plan as 2 data-parallel ranks with rows of 200 tokens
    assert cli.main(["pack-stats", *SMALL, *cache, "--world-size", "2", "--max-tokens-per-row", "200",
                     "--plan-out", str(sp1)]) == 0
    capsys.readouterr()
    assert _plan_lines(sp2) == _plan_lines(sp1) and {r["rank"] for r in _plan_lines(sp2)} == {0, 1}
    # training's phase one at that layout plans the same rows
    setup = prepare(parse_train_args([*SMALL, *cache, "--sequence-parallel-size", "2", "--max-tokens-per-row", "100",
                                      "--output-dir", str(tmp_path / "out")]), "train", world_size=4)
    assert (setup.spec.layout.dp_size, setup.spec.layout.sp_size, setup.spec.plan.config.max_tokens_per_row) == (2, 2, 200)
    plans = run_plan(setup.prepared, setup.spec.plan.config, 1)
    planned = [(plan.step, rank, list(row.pairs)) for plan in plans for rank, rows in enumerate(plan.ranks) for row in rows]
    pair_ids = setup.prepared.dataset["pair_id"]
    assert [(r["step"], r["rank"], r["pairs"]) for r in _plan_lines(sp2)] == [
        (step, rank, [pair_ids[i] for i in pairs]) for step, rank, pairs in planned]
    # without sequence parallelism the same budget is too small for most pairs: refused, naming the way out
    assert cli.main(["pack-stats", *SMALL, *cache, "--world-size", "4", "--max-tokens-per-row", "100"]) == 2
    assert "--sequence-parallel-size" in capsys.readouterr().err
    assert cli.main(["pack-stats", *SMALL, *cache, "--world-size", "3", "--sequence-parallel-size", "2"]) == 2
    assert "--sequence-parallel-size 2 does not divide the world size 3" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the code's shape

def _modules() -> dict[str, ast.Module]:
    return {".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts): ast.parse(path.read_text())
            for path in PACKAGE.rglob("*.py")}


def _imported(module: str, node: ast.ImportFrom | ast.Import) -> list[str]:
    """The ds_packdpo modules an import statement names (relative imports resolved)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name.startswith("ds_packdpo")]
    package = module.split(".")
    if not module.endswith("__init__"):
        package = package[:-1]
    base = package[:len(package) - node.level + 1] if node.level else []
    target = ".".join(base + ([node.module] if node.module else []))
    if not target.startswith("ds_packdpo"):
        return []
    return [f"{target}.{alias.name}" if not node.module else target for alias in node.names]


def test_no_module_imports_a_module_that_imports_it_back():
    modules = _modules()
    graph = {name: set() for name in modules}
    for name, tree in modules.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[name] |= {m for m in _imported(name, node) if m in modules and m != name}
    state: dict[str, int] = {}

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for dep in sorted(graph[name]):
            if state.get(dep) == 1:
                pytest.fail("import circle: " + " -> ".join(path[path.index(dep):] + [dep]))
            if dep not in state:
                visit(dep, path + [dep])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


# Imports inside functions, each for a reason said in a comment there: the CLI keeps prepare, pack-stats and
# report free of DeepSpeed and the model stack; config builds the data settings without importing transformers.
DEFERRED_IMPORTS_ALLOWED = {"ds_packdpo.cli", "ds_packdpo.config"}


def test_imports_sit_at_the_top_of_modules():
    for name, tree in _modules().items():
        for function in ast.walk(tree):
            if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inner = [n for n in ast.walk(function) if isinstance(n, (ast.Import, ast.ImportFrom))]
                assert not inner or name in DEFERRED_IMPORTS_ALLOWED, (name, function.name)


# The flags as users type them (config.TrainConfig) are read by the command line, the flags' reference and the
# assembly, which resolves them into the run's settings: every other module takes its section of those.
READ_THE_FLAGS = {"ds_packdpo.config", "ds_packdpo.cli", "ds_packdpo.cli_reference", "ds_packdpo.run.assemble"}


def test_only_the_assembly_and_the_command_line_name_the_flags_class():
    for name, tree in _modules().items():
        named = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)} | \
            {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)} | \
            {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for alias in node.names}
        assert "TrainConfig" not in named or name in READ_THE_FLAGS, name


def _calls(tree: ast.Module, attribute: str) -> int:
    return sum(1 for node in ast.walk(tree) if isinstance(node, ast.Call)
               and getattr(node.func, "attr", getattr(node.func, "id", None)) == attribute)


def test_one_place_builds_engines_and_one_rule_gives_the_pad_token():
    modules = _modules()
    assert {name for name, tree in modules.items() if _calls(tree, "initialize")} == {"ds_packdpo.run.engines"}
    for builder in ("build_policy", "build_reference", "init_sequence_parallel", "init_process_group", "load_model"):
        callers = {name for name, tree in modules.items() if _calls(tree, builder)}
        assert callers <= {"ds_packdpo.run.assemble", "ds_packdpo.run.engines"}, (builder, callers)
    # the pad token id: data.tokenizer.pad_token_id, nowhere else decided
    readers = {name for name, tree in modules.items()
               for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr == "pad_token_id"
               and isinstance(node.value, ast.Name) and "tok" in node.value.id}
    assert readers == {"ds_packdpo.data.tokenizer"}, readers
