"""Stale torch extension build locks (a killed JIT build) are removed at start-up instead of hanging every launch."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from ds_packdpo import cli
from ds_packdpo.run import build_lock
from ds_packdpo.run.build_lock import MIN_AGE_S, STALE_AFTER_S, remove_stale_locks


def make_lock(root: Path, relative: str, age_s: float) -> Path:
    lock = root / relative / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.touch()
    past = time.time() - age_s
    os.utime(lock, (past, past))
    return lock


def test_unheld_locks_are_removed_held_and_fresh_ones_kept(tmp_path, capsys):
    stale = make_lock(tmp_path, "deepspeed_shm_comm", 60)  # the TORCH_EXTENSIONS_DIR layout
    stale_default = make_lock(tmp_path, "py311_cpu/cpu_adam", 60)  # torch's default-root layout
    fresh = make_lock(tmp_path, "fresh_build", MIN_AGE_S / 2)
    held = make_lock(tmp_path, "live_build", 600)
    fd = os.open(held, os.O_RDONLY)  # a live builder keeps its lock open
    try:
        assert sorted(remove_stale_locks(tmp_path)) == sorted([stale, stale_default])
    finally:
        os.close(fd)
    assert not stale.exists() and not stale_default.exists() and fresh.exists() and held.exists()
    warnings = capsys.readouterr().err.splitlines()
    assert len(warnings) == 2 and all(w.startswith("warning: removed the stale torch extension build lock ")
                                      for w in warnings)
    assert any(str(stale) in w and "every build of deepspeed_shm_comm would wait for it forever" in w
               for w in warnings)


def test_without_proc_only_old_locks_are_stale(tmp_path, monkeypatch):
    monkeypatch.setattr(build_lock, "_open_files", lambda: None)
    recent = make_lock(tmp_path, "recent", 60)
    old = make_lock(tmp_path, "old", STALE_AFTER_S + 60)
    assert remove_stale_locks(tmp_path) == [old]
    assert recent.exists()


def test_extensions_root_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    assert build_lock.extensions_root() == tmp_path / "ext"
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert build_lock.extensions_root() == tmp_path / "cache" / "torch_extensions"


def front_train(tmp_path, monkeypatch, demo_tokenizer) -> int:
    """``ds-packdpo train`` of 16 synthetic pairs in-process, outside a launcher (the launch itself stubbed)."""
    for key in cli.LAUNCHED_ENV:
        monkeypatch.delenv(key, raising=False)
    demo_tokenizer.save_pretrained(tmp_path / "tok")
    return cli.main(["train", "--num-procs", "2", "--output-dir", str(tmp_path / "out"), "--cache-dir",
                     str(tmp_path / "cache"), "--tokenizer", str(tmp_path / "tok"), "--max-length", "128",
                     "--synthetic-pairs", "16"])


def test_front_command_removes_a_stale_lock_and_launches(tmp_path, monkeypatch, capsys, demo_tokenizer):
    """``ds-packdpo train`` with a stale lock of DeepSpeed's comm extension: one warning, then the launch."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    lock = make_lock(tmp_path / "ext", "deepspeed_shm_comm", 3600)
    launched = []
    monkeypatch.setattr(cli, "_launch", lambda argv, procs, port, module, **kwargs: launched.append((procs, module)) or 0)
    code = front_train(tmp_path, monkeypatch, demo_tokenizer)
    assert code == 0 and launched == [(2, "ds_packdpo.train")]
    assert not lock.exists()
    assert f"warning: removed the stale torch extension build lock {lock}" in capsys.readouterr().err


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")
def test_a_lock_open_in_another_process_is_held(tmp_path):
    import subprocess
    import sys

    lock = make_lock(tmp_path, "other_process", 600)
    holder = subprocess.Popen([sys.executable, "-c", f"f = open({str(lock)!r}); import time; time.sleep(60)"])
    try:
        deadline = time.monotonic() + 30
        while str(lock) not in (build_lock._open_files() or set()):
            assert time.monotonic() < deadline, "the holder never opened the lock"
            time.sleep(0.05)
        assert remove_stale_locks(tmp_path) == [] and lock.exists()
    finally:
        holder.kill()
        holder.wait()
    assert remove_stale_locks(tmp_path) == [lock]


@pytest.mark.multirank
def test_a_rank_with_a_stale_lock_of_the_comm_extension_trains(tmp_path):
    """A real rank whose DeepSpeed comm extension lock was left by a killed build: it warns, and trains.

    Without the removal, ``deepspeed.init_distributed`` waits for the lock forever.  The extension is
    copied (with its timestamps, so ninja has nothing to rebuild) from this venv's build folder, which
    the first run of the suite fills (a fresh build takes minutes on 2 shared cores).
    """
    import shutil

    from launching import SMALL_RUN, cpu_env, rank_module, read_metrics, run

    from ds_packdpo.run.build_lock import venv_extensions_dir

    built = Path(venv_extensions_dir() or "") / "deepspeed_shm_comm"
    if not (built / "deepspeed_shm_comm.so").is_file():
        pytest.skip(f"{built} is not built yet (any earlier run of the suite builds it)")
    extensions = tmp_path / "ext"
    shutil.copytree(built, extensions / "deepspeed_shm_comm", ignore=shutil.ignore_patterns("lock"))
    lock = make_lock(extensions, "deepspeed_shm_comm", 3600)
    out = tmp_path / "out"
    proc = run(rank_module("ds_packdpo.train", "--output-dir", str(out), "--cache-dir", str(tmp_path / "cache"),
                           *SMALL_RUN, "--max-steps", "1"),
               timeout=300, env=cpu_env(TORCH_EXTENSIONS_DIR=str(extensions)))
    assert f"warning: removed the stale torch extension build lock {lock}" in proc.stderr
    assert not lock.exists()
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1]


@pytest.mark.parametrize("built", [True, False])
def test_front_command_gives_the_ranks_this_venvs_extensions_folder(tmp_path, monkeypatch, capsys, demo_tokenizer,
                                                                    built):
    """Without TORCH_EXTENSIONS_DIR a plain ``ds-packdpo train`` gives its ranks the venv's folder, where ``make
    install`` built DeepSpeed's CPU comm op (torch's default folder made every rank build it again, silently); when
    the op is not there yet, one line says the ranks build it and how long that takes."""
    from ds_packdpo.run.launch_group import LaunchOutcome

    venv_folder = tmp_path / "venv_ext"
    if built:
        (venv_folder / "deepspeed_shm_comm").mkdir(parents=True)
        (venv_folder / "deepspeed_shm_comm" / "deepspeed_shm_comm.so").touch()
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setattr(build_lock, "venv_extensions_dir", lambda: str(venv_folder))
    envs = []
    monkeypatch.setattr(cli, "run_launcher",
                        lambda cmd, env, grace_s, on_line=None: envs.append(env) or LaunchOutcome(0))
    code = front_train(tmp_path, monkeypatch, demo_tokenizer)
    assert code == 0 and [env["TORCH_EXTENSIONS_DIR"] for env in envs] == [str(venv_folder)]
    building = [line for line in capsys.readouterr().err.splitlines() if line.startswith("building DeepSpeed")]
    assert building == ([] if built else [
        f"building DeepSpeed's CPU communication op (deepspeed_shm_comm) into {venv_folder}: once, about 1-3 "
        f"minutes; later runs load it"])
