"""``ds-packdpo``: train, prepare, pack-stats, check, precompute-ref, eval, export, verify-checkpoint, bench and
report.

``ds-packdpo train`` outside a launcher starts the deepspeed launcher itself
(2 CPU ranks, or one per GPU), so the embedded default runs with one command;
under a launcher (``deepspeed --module ds_packdpo.train``, mpirun) it is one rank.
Bad input ends every subcommand with ``error: <one line>`` and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Callable

from .config import FlagParser, TrainConfig, add_arguments, config_from_args, parse_train_args
from .console import launcher_options, quiet_libraries, rank_environment
from .data.plan_report import pack_stats, write_plan_jsonl
from .data.prepare import prepare_pairs, run_prepare
from .data.run_plan import checked_plan_config, run_length, run_plan
from .data.source import prepare_run_data, split_held_out, tokenizer_and_rows
from .errors import InputError, PeerFailureError, StoppedError, run_guarded
from .files import check_output_file, check_output_folder
from .run.build_lock import remove_stale_locks, say_if_comm_op_unbuilt, use_venv_extensions
from .run.launch_group import LaunchOutcome, run_launcher
from .run.layout import ParallelLayout, free_port

# The commands that run a model import DeepSpeed and the model stack (seconds, and DeepSpeed probes the
# accelerator) inside their own function: prepare, pack-stats and report stay free of them.

MAX_RANKS = 65536  # the largest world a launch or a plan is made for
LAUNCHED_ENV = ("LOCAL_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")


def _launch(argv: list[str], procs: int, master_port: int | None, module: str, verbose: bool = False,
            grace_s: float = 20.0, save_dir: Path | None = None, extra_env: dict | None = None,
            on_line: Callable[[str], None] | None = None) -> int:
    """Re-runs this command (``module``) under the deepspeed launcher (arguments as a list, never through a shell),
    in a session of its own: SIGTERM/SIGINT to this process reach every rank (run/launch_group.py).  ``extra_env``:
    set for the ranks; ``on_line``: sees every line of the launch's output."""
    # with DS_ACCELERATOR=cpu on a machine without CUDA (_cpu_unless_cuda)
    device_type = "cpu" if os.environ.get("DS_ACCELERATOR") == "cpu" else "cuda"
    env = rank_environment({**os.environ, **(extra_env or {})}, procs, device_type)
    if device_type == "cpu":
        say_if_comm_op_unbuilt()
    launcher = shutil.which("deepspeed") or os.path.join(os.path.dirname(sys.executable), "deepspeed")
    cmd = [launcher, *launcher_options(verbose), "--num_gpus", str(procs), "--master_port",
           str(master_port or free_port()), "--module", module, *argv]
    outcome = run_launcher(cmd, env, grace_s, on_line)
    if outcome.signal_name is None:
        return launcher_status(outcome.code)
    return stop_status(outcome, grace_s, save_dir)


def stop_status(outcome: LaunchOutcome, grace_s: float, save_dir: Path | None) -> int:
    """Our exit code after a stop signal: 7 (StoppedError) unless the job finished first (0) or failed on its own
    (a rank's code 2-6).  Rank 0 printed the ``stopped:`` line when the ranks saved and exited 7; otherwise it is
    said here, with the newest checkpoint (``latest``, read after the launcher ended) to resume from."""
    if outcome.code == StoppedError.exit_code and not outcome.killed:
        return StoppedError.exit_code
    if not outcome.killed and outcome.code in (0, 2, 3, 4, 5, 6):
        return outcome.code
    latest = save_dir / "latest" if save_dir is not None else None
    tag = latest.read_text().strip() if latest is not None and latest.is_file() else None
    if outcome.killed:
        how = ("a second signal killed the ranks" if outcome.repeated
               else f"the ranks did not stop within --stop-grace-s {grace_s:g} s and were killed")
    else:
        how = f"the launcher exited {outcome.code}"  # e.g. a scheduler signalled it too: it exits 1 after its ranks
    resume = f"resume with --resume auto (tag {tag})" if tag else "no checkpoint to resume from"
    print(f"stopped: {outcome.signal_name}; {how}; {resume}", file=sys.stderr)
    return StoppedError.exit_code


def launcher_status(code: int) -> int:
    """Our exit code for the deepspeed launcher's ``code``.

    The launcher exits with the status of the first rank that failed and stops the
    others: a rank's own code (2 bad input, 4, 5 ...) comes through unchanged, but a
    rank killed by signal N (OOM killer, SIGKILL) shows as ``256 - N`` (Python's
    ``sys.exit(-N)``; 247 for SIGKILL).  That is a dead peer of the run: exit 5, as
    its survivors would have.
    """
    try:
        killed_by = signal.Signals(256 - code) if 128 < code < 256 else None
    except ValueError:
        killed_by = None
    if killed_by is None:
        return code
    print(f"error: a rank was killed by {killed_by.name} (the deepspeed launcher exited {code}) and the launcher "
          f"stopped the others; relaunch with --resume auto to continue from the last complete checkpoint",
          file=sys.stderr)
    return PeerFailureError.exit_code


def _data_parser(prog: str, description: str) -> argparse.ArgumentParser:
    parser = FlagParser(prog=prog, description=description)
    add_arguments(parser)
    return parser


def prepare_parser() -> argparse.ArgumentParser:
    parser = _data_parser("ds-packdpo prepare", "Tokenize and validate a preference dataset into the cache a run with "
                          "the same data settings reads (give train's --config RECIPE to fill the cache of that "
                          "recipe); print a JSON summary, the cache file among it.")
    parser.add_argument("--out", default=None, help="Write the tokenized pairs as JSON lines (an existing file only "
                        "with --overwrite).")
    return parser


def cmd_prepare(argv: list[str]) -> int:
    args = prepare_parser().parse_args(argv)

    def job() -> int:
        cfg = config_from_args(args)
        if args.out:
            check_output_file(args.out, "--out", overwrite=cfg.overwrite, reads=cfg.local_inputs())
        data = cfg.data_spec()
        tokenizer, rows = tokenizer_and_rows(data)
        if args.out:
            summary = run_prepare(data.tokenization, tokenizer, args.out, rows=rows)
        else:
            prepared = prepare_pairs(data.tokenization, tokenizer, rows=rows)
            summary = {**prepared.summary, "fingerprint": prepared.fingerprint,
                       "cache": [str(f) for f in data.tokenization.cache_files(prepared.fingerprint)]}
        print(json.dumps(summary, indent=2))
        if summary["cache"]:
            shards = f" and {len(summary['cache']) - 1} more shards" if len(summary["cache"]) > 1 else ""
            print(f"cache: {summary['cache'][0]}{shards} (train, bench, eval and precompute-ref with these data "
                  f"settings read it)", file=sys.stderr)
        return 0

    return run_guarded(job)


def pack_stats_parser() -> argparse.ArgumentParser:
    parser = _data_parser("ds-packdpo pack-stats", "Plan only (no model): packing and balance figures as JSON, "
                          "exactly as training would plan them.")
    parser.add_argument("--world-size", type=int, default=1,
                        help="Ranks to plan for (data-parallel ranks x --sequence-parallel-size).")
    parser.add_argument("--plan-out", default=None, help="Write one JSON line per (step, data-parallel rank, row).")
    return parser


def cmd_pack_stats(argv: list[str]) -> int:
    args = pack_stats_parser().parse_args(argv)

    def job() -> int:
        cfg = config_from_args(args)
        if not 1 <= args.world_size <= MAX_RANKS:
            raise InputError(f"--world-size must be in [1, {MAX_RANKS}], got {args.world_size}")
        if args.plan_out:
            # the plan is derived data, replaced without --overwrite; the data it is derived from is not
            check_output_file(args.plan_out, "--plan-out", overwrite=True, reads=cfg.local_inputs())
        layout = ParallelLayout(world_size=args.world_size, sp_size=cfg.sequence_parallel_size)
        data = cfg.data_spec()
        evaluation, plan = cfg.evaluation_spec(data.tokenization), cfg.plan_spec(layout, cfg.row_layout)
        tokenizer, rows = tokenizer_and_rows(data)
        prepared, _ = split_held_out(evaluation, tokenizer, prepare_run_data(data.tokenization, tokenizer, rows))
        plan_cfg = checked_plan_config(plan, layout.sp_size, prepared)  # what trains
        epochs = run_length(plan, prepared).epochs  # --max-steps may extend them, as in training
        stats = pack_stats(prepared.chosen_lengths, prepared.rejected_lengths, plan_cfg, epochs=epochs,
                           prompt_lengths=prepared.prompt_lengths, groups=prepared.groups)
        if args.plan_out:
            write_plan_jsonl(run_plan(prepared, plan_cfg, epochs), args.plan_out,
                             pair_ids=prepared.pair_ids)
        print(json.dumps({"dataset": data.tokenization.dataset, "layout": layout.as_dict(), **stats,
                          "data": {k: prepared.summary[k] for k in ("rows", "kept", "dropped")}}, indent=2))
        return 0

    return run_guarded(job)


def check_parser() -> argparse.ArgumentParser:
    parser = _data_parser("ds-packdpo check", "Packed vs one-sequence-at-a-time (eager) log-probs of a model on the "
                          "pairs a run with these flags would see (train's flags).")
    parser.add_argument("--pairs", type=int, default=4, help="Pairs of the data to compare (default 4).")
    return parser


def cmd_check(argv: list[str]) -> int:
    args = check_parser().parse_args(argv)

    def job() -> int:
        from .check import run_check

        result = run_check(config_from_args(args), pairs=args.pairs)
        print(json.dumps(result))
        return 0 if result["ok"] else 1

    return run_guarded(job)


def _distributed_command(argv: list[str], module: str, rank_main: Callable[[list[str]], int],
                         validate: Callable[[list[str], int], tuple[TrainConfig, object]],
                         supervise: Callable[[Callable[..., int]], int] | None = None) -> int:
    """Under a launcher: one rank (``rank_main``).  Outside one: validate (which returns the flags and the run's
    settings, an assemble.RunSpec), then start the launcher on ``module``; ``supervise``, when given, is handed the
    launch (``launch(extra_flags, extra_env, on_line) -> exit code``) to run as often as it needs (the bench:
    bench_front.py)."""
    if any(os.environ.get(k) for k in LAUNCHED_ENV):
        return rank_main(argv)
    launch, rest, procs = _launch_options(argv)
    validated = []

    def check() -> int:
        """Phase one runs here too, so bad input fails before any rank starts."""
        _check_procs(procs, launch.master_port)
        validated.append(validate(rest, procs))
        use_venv_extensions()  # the ranks find DeepSpeed's CPU comm op where `make install` built it
        remove_stale_locks()  # a stale one would hang every rank in init_distributed, with no output
        return 0

    code = run_guarded(check)
    if code:
        return code
    flags, spec = validated[0]

    def launch_ranks(extra: list[str] = (), extra_env: dict | None = None,
                     on_line: Callable[[str], None] | None = None) -> int:
        return _launch([*rest, *extra], procs, launch.master_port, module, verbose=spec.outputs.verbose,
                       grace_s=flags.stop_grace_s, save_dir=spec.checkpoint.save_dir, extra_env=extra_env,
                       on_line=on_line)

    return launch_ranks() if supervise is None else supervise(launch_ranks)


def _launch_options(argv: list[str]) -> tuple[argparse.Namespace, list[str], int]:
    """(--num-procs/--master-port, the rest of ``argv``, the ranks to start) of a front command; on a machine
    without CUDA the ranks will run on CPU."""
    launch, rest = launch_options_parser().parse_known_args(argv)
    procs = _default_procs() if launch.num_procs is None else launch.num_procs
    _cpu_unless_cuda()
    return launch, rest, procs


def launch_options_parser() -> argparse.ArgumentParser:
    """The options the front process of train, eval, precompute-ref and bench takes itself (not passed to ranks);
    a bad value is one line, as every flag's."""
    parser = FlagParser(prog="launch options", add_help=False)
    parser.add_argument("--num-procs", type=int, default=None,
                        help="Ranks to start on this machine. Default: one per GPU, or 2 on a machine without CUDA.")
    parser.add_argument("--master-port", type=int, default=None,
                        help="The rendezvous port of the ranks. Default: a free port.")
    return parser


def _check_procs(procs: int, master_port: int | None = None) -> None:
    """--num-procs and --master-port as the launcher and the OS take them: ranks the machine can start (one per GPU
    on CUDA), a TCP port."""
    if not 1 <= procs <= MAX_RANKS:
        raise InputError(f"--num-procs must be in [1, {MAX_RANKS}], got {procs}")
    if master_port is not None and not 1 <= master_port <= 65535:
        raise InputError(f"--master-port must be a TCP port in [1, 65535], got {master_port}")
    import torch

    if torch.cuda.is_available() and procs > torch.cuda.device_count():
        raise InputError(f"--num-procs {procs}: this machine has {torch.cuda.device_count()} GPUs (one rank each)")


def _default_procs() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def _cpu_unless_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # as the launched ranks get it


def _phase_one(command: str, parse: Callable[..., TrainConfig] = parse_train_args
               ) -> Callable[[list[str], int], tuple[TrainConfig, object]]:
    """The rank's phase one of ``command`` (settings, DeepSpeed config, output folder, data, plan, resume point,
    reference file), run in the front process; its tokenization fills the cache the ranks then read."""

    def validate(argv: list[str], procs: int) -> tuple[TrainConfig, object]:
        from .run.assemble import prepare

        flags = parse(argv, prog=f"ds-packdpo {command}")
        return flags, prepare(flags, command, world_size=procs).spec

    return validate


def cmd_train(argv: list[str]) -> int:
    from .train import main as rank_main

    if "--dry-run" in argv and not any(os.environ.get(k) for k in LAUNCHED_ENV):
        return dry_run([arg for arg in argv if arg != "--dry-run"])
    return _distributed_command(argv, "ds_packdpo.train", rank_main, _phase_one("train"))


def dry_run(argv: list[str]) -> int:
    """``train --dry-run``: phase one of the run the flags describe (settings, data, plan, resume point) in this
    process, then its plan line and a per-GPU memory estimate.  No process group, no rank, no output folder."""
    launch, rest, procs = _launch_options(argv)

    def job() -> int:
        from .run.assemble import prepare
        from .run.memory_estimate import describe_estimate, estimate_memory
        from .run.trainer import describe_plan, plan_summary

        _check_procs(procs, launch.master_port)
        setup = prepare(parse_train_args(rest), "train", world_size=procs, dry_run=True)
        print(describe_plan(plan_summary(setup)))
        print(describe_estimate(estimate_memory(setup)), flush=True)
        return 0

    return run_guarded(job)


def cmd_precompute_ref(argv: list[str]) -> int:
    from .precompute_ref import main as rank_main
    from .precompute_ref import parse_args, precompute_setup

    def validate(rest: list[str], procs: int) -> tuple[TrainConfig, object]:
        cfg, out = parse_args(rest)
        _, setup = precompute_setup(cfg, out, world_size=procs)
        return cfg, setup.spec

    return _distributed_command(argv, "ds_packdpo.precompute_ref", rank_main, validate)


def cmd_eval(argv: list[str]) -> int:
    from .evaluate import main as rank_main
    from .evaluate import parse_eval_args

    return _distributed_command(argv, "ds_packdpo.evaluate", rank_main, _phase_one("eval", parse_eval_args))


def export_parser() -> argparse.ArgumentParser:
    parser = FlagParser(prog="ds-packdpo export",
                                     description="A training checkpoint as a Hugging Face folder (safetensors).")
    parser.add_argument("--checkpoint", required=True, help="A checkpoint folder, or a --save-dir (its 'latest').")
    parser.add_argument("--out", required=True, help="The Hugging Face folder to write.")
    parser.add_argument("--dtype", default=None, choices=("fp32", "bf16"), help="Default: the training dtype.")
    parser.add_argument("--max-shard-size", default="5GB", help="Largest safetensors file (e.g. 5GB, 500MB); a "
                        "larger model is split into several, with an index. Memory holds one shard at a time.")
    parser.add_argument("--overwrite", action="store_true", help="Replace a non-empty --out folder.")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="Allow custom modelling code from the checkpoint's model folder (off by default).")
    parser.add_argument("--adapter-only", action="store_true",
                        help="A LoRA checkpoint as a peft adapter folder (adapter_config.json, "
                             "adapter_model.safetensors) for PeftModel.from_pretrained. Default: the adapters merged "
                             "into the base weights, a plain Hugging Face folder.")
    return parser


def cmd_export(argv: list[str]) -> int:
    args = export_parser().parse_args(argv)

    def job() -> int:
        from .run.export import export_checkpoint

        quiet_libraries(verbose=False)  # no library's FutureWarning (transformers' on a model folder's config)
        print(json.dumps(export_checkpoint(args.checkpoint, args.out, args.dtype, overwrite=args.overwrite,
                                           trust_remote_code=args.trust_remote_code, adapter_only=args.adapter_only,
                                           max_shard_size=args.max_shard_size)))
        return 0

    return run_guarded(job)


def verify_checkpoint_parser() -> argparse.ArgumentParser:
    parser = FlagParser(prog="ds-packdpo verify-checkpoint",
                                     description="Check checkpoints against their manifests (every file there, of its "
                                     "size and checksum), every rank's files, and that no pickle would run code; "
                                     "exit 0 all intact, 1 some damaged, 2 none intact.")
    parser.add_argument("folder", help="A checkpoint folder (global_stepN), or a --save-dir (each of its checkpoints).")
    return parser


def cmd_verify_checkpoint(argv: list[str]) -> int:
    args = verify_checkpoint_parser().parse_args(argv)

    def job() -> int:
        from .run.checkpoint import verify_checkpoint

        lines, code = verify_checkpoint(args.folder)
        print("\n".join(lines))
        return code

    return run_guarded(job)


def cmd_bench(argv: list[str]) -> int:
    from .bench import check_configurations, parse_bench_args
    from .bench import main as rank_main
    from .bench_front import run_isolated

    measured = []

    def validate(rest: list[str], procs: int) -> tuple[TrainConfig, object]:
        cfg, settings = parse_bench_args(rest)
        checked = check_configurations(cfg, settings, world_size=procs)
        measured.append((list(checked.setups), settings.out))
        return cfg, checked.first.spec

    def supervise(launch_ranks: Callable[..., int]) -> int:
        """One launch of every configuration; one that crashes it is named and the others launched again."""
        configurations, out = measured[0]
        return run_isolated(configurations, out, lambda extra, env, log: launch_ranks(extra, env, log.feed))

    return _distributed_command(argv, "ds_packdpo.bench", rank_main, validate, supervise)


def report_parser() -> argparse.ArgumentParser:
    parser = FlagParser(prog="ds-packdpo report",
                                     description="Merge bench folders into one comparison report.")
    parser.add_argument("folders", nargs="+", help="Bench folders (each holding report.json).")
    parser.add_argument("--out", required=True, help="Folder of the comparison (merged.json, report.md, PNG).")
    parser.add_argument("--overwrite", action="store_true", help="Replace --out if it exists.")
    return parser


def cmd_report(argv: list[str]) -> int:
    args = report_parser().parse_args(argv)

    def job() -> int:
        from .report import merge_reports, write_merged

        check_output_folder(args.out, "--out", args.overwrite, reads=args.folders)
        write_merged(merge_reports(args.folders), Path(args.out), overwrite=args.overwrite)
        print(Path(args.out) / "report.md")
        return 0

    return run_guarded(job)


COMMANDS = {"train": cmd_train, "prepare": cmd_prepare, "pack-stats": cmd_pack_stats, "check": cmd_check,
            "precompute-ref": cmd_precompute_ref, "eval": cmd_eval, "export": cmd_export,
            "verify-checkpoint": cmd_verify_checkpoint, "bench": cmd_bench,
            "report": cmd_report}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["--version"], ["-V"]):
        from . import __version__

        print(f"ds-packdpo {__version__}")
        return 0
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        if argv and argv[0] not in ("-h", "--help"):
            print(f"ds-packdpo: unknown command {argv[0]!r}", file=sys.stderr)
        names = ", ".join(COMMANDS)
        print(f"usage: ds-packdpo {{{names}}} [flags]   (ds-packdpo COMMAND --help for the flags)", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
