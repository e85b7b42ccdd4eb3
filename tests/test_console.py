"""A quiet console (ds_packdpo/console.py): a run shows its plan, its progress, its last line and errors."""

from __future__ import annotations

import ast
import logging
import os
import warnings
from pathlib import Path

import pytest

from ds_packdpo import cli
from ds_packdpo.console import progress_bar, quiet_libraries
from ds_packdpo.run.launch_group import LaunchOutcome

from launching import BIN, SMALL_RUN, read_metrics, run

NOISE = ("FutureWarning", "[INFO]", "[WARNING]", "Attempting to get learning rate", "built successfully",
         "spawned with command", "return func(")


@pytest.mark.multirank
def test_a_run_prints_its_plan_progress_and_last_line_only(tmp_path):
    """``ds-packdpo train`` (2 CPU ranks through the deepspeed launcher) with --no-progress: the plan, the
    trainable-parameter line, a line every --logging-steps steps (and the last), the final summary; none of the
    libraries' noise."""
    out = tmp_path / "run"
    proc = run([str(BIN / "ds-packdpo"), "train", *SMALL_RUN, "--logging-steps", "2", "--output-dir", str(out),
                "--cache-dir", str(tmp_path / "cache")])
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert not [line for line in lines if "tokenize pairs" in line]  # --no-progress: no tokenization bar either
    assert not [line for line in lines if any(noise in line for noise in NOISE)], lines
    records = read_metrics(out / "metrics.jsonl")
    # the front process's phase one says once (not every rank) that --max-length 96 cuts most synthetic prompts
    said = [line for line in lines if line.startswith("warning: ")]
    assert len(said) == 1 and said[0].startswith("warning: synthetic: truncation (--max-length 96) cut "), said
    lines = [line for line in lines if line not in said]
    assert [line.split(":")[0] for line in lines] == ["plan", "trainable parameters", "step 2/3", "step 3/3", "done"]
    assert lines[-2].startswith(f"step 3/3: loss {records[2]['loss']:.4f}, acc ")
    assert lines[-1].startswith(f"done: 3 steps (to step 3) in ") and f"loss {records[0]['loss']:.4f} -> " \
        f"{records[2]['loss']:.4f} (step 1 -> step 3)" in lines[-1] and \
        lines[-1].endswith(f"metrics in {out / 'metrics.jsonl'}")


def test_the_launch_is_quiet_and_shares_the_cores(monkeypatch):
    """The deepspeed launcher logs errors only, unless --verbose; on CPU each rank gets cores / ranks threads unless
    OMP_NUM_THREADS is set."""
    calls = []
    monkeypatch.setattr(cli, "run_launcher", lambda cmd, env, grace_s, on_line=None: calls.append((cmd, env)) or LaunchOutcome(0))
    for key in cli.LAUNCHED_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert cli.main(["train", "--max-steps", "1", "--num-procs", "2"]) == 0
    cmd, env = calls[-1]
    assert cmd[1:3] == ["--log_level", "error"]
    assert env["OMP_NUM_THREADS"] == str(max(1, os.cpu_count() // 2))
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cli.main(["train", "--max-steps", "1", "--num-procs", "2", "--verbose"]) == 0
    cmd, env = calls[-1]
    assert "--log_level" not in cmd and env["OMP_NUM_THREADS"] == "3"


def test_verbose_keeps_the_libraries_output():
    deepspeed_logger = logging.getLogger("DeepSpeed")
    level = deepspeed_logger.level
    with warnings.catch_warnings():
        try:
            quiet_libraries(verbose=True)
            assert deepspeed_logger.level == level
            with pytest.warns(FutureWarning):
                warnings.warn("kept", FutureWarning)
            quiet_libraries(verbose=False)
            assert deepspeed_logger.level == logging.ERROR
            with warnings.catch_warnings(record=True) as seen:
                warnings.warn("dropped", FutureWarning)
            assert not seen
        finally:
            deepspeed_logger.setLevel(level)


def test_own_warnings_are_one_line():
    """A warning of this package reads ``warning: <message>`` (not Python's file:line: UserWarning and source line);
    a library's keeps Python's format; --verbose gives Python's format back."""
    from ds_packdpo.data import source

    python_format = warnings.formatwarning
    try:
        quiet_libraries(verbose=False)
        own = warnings.formatwarning("f.jsonl: 2 pairs repeat", UserWarning, source.__file__, 38, "prepared = ...")
        assert own == "warning: f.jsonl: 2 pairs repeat\n"
        library = warnings.formatwarning("x", UserWarning, "/site-packages/torch/a.py", 3, "y = 1")
        assert "UserWarning: x" in library and "a.py:3" in library
        quiet_libraries(verbose=True)
        assert "UserWarning" in warnings.formatwarning("m", UserWarning, source.__file__, 38, "z")
    finally:
        warnings.formatwarning = python_format


def test_version(capsys):
    from ds_packdpo import __version__

    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"ds-packdpo {__version__}\n"


def test_long_work_has_a_bar_that_no_progress_hides(capfd):
    """precompute-ref, eval and bench had no bar at all (a 100k-pair precompute-ref was silent until done): each now
    shows one on rank 0 over its pairs, rows or steps, and --no-progress (shown=False) prints nothing.  Checked by
    running them: 'ds-packdpo precompute-ref --model-config tiny --synthetic-pairs 48 ...' printed 3 'reference
    log-probs' bar updates, 0 with --no-progress; eval 5 and 0; bench 'bench packed/padded' bars, 0."""
    bar = progress_bar(4, "reference log-probs", "pair", shown=True)
    bar.update(4)
    bar.close()
    assert "reference log-probs: 100%" in capfd.readouterr().err
    bar = progress_bar(4, "reference log-probs", "pair", shown=False)
    bar.update(4)
    bar.close()
    assert capfd.readouterr().err == ""
    package = Path(__file__).resolve().parents[1] / "ds_packdpo"
    for module in ("precompute_ref.py", "bench.py", "run/evaluation.py"):
        calls = [node for node in ast.walk(ast.parse((package / module).read_text()))
                 if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "progress_bar"]
        assert len(calls) == 1, module


def test_the_done_line_compares_windows_of_steps_and_says_which():
    """A resume's `done: loss 0.2395 -> 0.4699` compared two single steps and read as a regression: the line now
    compares the means of the first and last windows (up to 10 steps, never overlapping) and names their steps."""
    from ds_packdpo.run.metrics import loss_change

    history = [{"step": 40 + i, "loss": loss} for i, loss in enumerate([0.5, 0.3, 0.4, 0.2, 0.1, 0.45])]
    assert loss_change(history) == "loss 0.4000 -> 0.2500 (mean of steps 40-42 -> steps 43-45)"
    long = [{"step": s, "loss": 1.0 if s <= 10 else 0.5 if s <= 30 else 0.25} for s in range(1, 41)]
    assert loss_change(long) == "loss 1.0000 -> 0.2500 (mean of steps 1-10 -> steps 31-40)"
    assert loss_change(history[:2]) == "loss 0.5000 -> 0.3000 (step 40 -> step 41)"
    assert loss_change(history[:1]) == "loss 0.5000 (step 40)"
    skipped = [*history[:3], {"step": 43, "loss": float("nan")}, *history[4:]]  # a bad step's loss is left out
    assert loss_change(skipped) == "loss 0.4000 -> 0.2750 (mean of steps 40-42 -> steps 43-45)"


def test_export_shows_no_librarys_future_warning(tmp_path, monkeypatch, capsys):
    """`ds-packdpo export` of a LoRA checkpoint showed transformers' FutureWarning (`is_gradient_checkpointing` is
    deprecated); the export runs with the libraries' FutureWarnings off, as every training command does (the real
    export: tests/test_lora.py's multi-rank test)."""
    import warnings

    from ds_packdpo.run import export

    def warns(*args, **kwargs):
        warnings.warn("`is_gradient_checkpointing` is deprecated and will be removed in v6.", FutureWarning)
        return {"written": "adapter"}

    monkeypatch.setattr(export, "export_checkpoint", warns)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cli.main(["export", "--checkpoint", str(tmp_path), "--out", str(tmp_path / "hf")]) == 0
    assert not [w for w in caught if issubclass(w.category, FutureWarning)]
    assert capsys.readouterr().out == '{"written": "adapter"}\n'
