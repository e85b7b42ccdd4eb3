"""The throughput benchmark: the same model, data and steps, packed against padded, in one launch.

One rank of ``deepspeed --num_gpus N --module ds_packdpo.bench <train flags> --out DIR``
(or any launcher the trainer runs under; ``ds-packdpo bench`` starts one and isolates a
configuration that crashes: ``bench_front.py``).  In ``--bench-rounds`` rounds, every named
configuration in turn (``packed`` -- prefix-shared, the default --, ``packed-no-prefix-sharing``,
``padded``, ... see :data:`CONFIGURATIONS`; the order rotated each round: ``bench_rounds.py``)
gets fresh engines with the same seed, runs ``--bench-warmup-steps`` optimizer steps unmeasured
and then ``--max-steps`` measured ones through the trainer's own ``DPOTrainer.train_step``, and
frees its engines before the next.  Rank 0 rewrites the report folder (``report.py``) after each.

Nothing here re-implements a step: the figures are the trainer's step metrics, the
wall time of ``StepTimer`` (the slowest rank's, since ZeRO-3 runs the ranks in lock
step), the plan's per-rank loads, the analytic FLOPs of ``flops.py`` and a peak-memory
probe per configuration.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import shlex
import statistics
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
import transformers
from deepspeed.accelerator import get_accelerator
from filelock import FileLock

from .bench_front import FAILED_ENV, failure_line, measuring_line
from .bench_rounds import schedule
from .command_settings import NOT_ACTED_ON, refused_epilog
from .comparisons import GROUPS_OFF, headline
from .config import LARGEST_COUNT, FlagParser, add_arguments, config_from_args
from .console import progress_bar, said_already
from .data.run_plan import run_length, run_plan
from .errors import InputError, run_guarded
from .files import check_output_folder
from .model.build import ModelSpec, tiny_config
from .precompute_ref import precompute
from .report import build_report, run_rounds, write_report_folder
from .run.assemble import RunSetup, model_spec, prepare, start
from .run.cpu_memory import release_free_memory, steady_allocator
from .run.engines import model_config
from .run.process_group import close_process_group, exit_rank
from .run.reference import precomputed_conflict
from .run.timing import PeakMemory, StepTimer, throughput_meter
from .run.trainer import DPOTrainer

# A configuration is a name and the flags it overrides; add one here and it can be measured with --configurations
# (a speed-up between two of them is a row of comparisons.COMPARISONS).
CONFIGURATIONS: dict[str, dict] = {
    "packed": {"packing": True},  # each pair's prompt once (prefix sharing, the default)
    "packed-no-prefix-sharing": {"packing": True, "prefix_sharing": False},  # packing alone: every prompt twice
    # prefix sharing alone: each pair's prompt once, but a prompt of several pairs and their shared responses
    # computed once per pair (against "packed", which runs each prompt group once)
    "packed-no-prompt-groups": {"packing": True, "prompt_groups": False},
    "padded": {"packing": False},
    # the dense block-diagonal mask (of packing alone: sdpa's masks cannot share prefixes)
    "packed-sdpa-dense": {"packing": True, "attn": "sdpa", "prefix_sharing": False},
    # the exact per-sequence CPU kernel on any device (against auto's varlen kernel on a GPU)
    "packed-sdpa-varlen": {"packing": True, "attn": "sdpa_varlen"},
    "packed-plain-logps": {"packing": True, "logps_impl": "plain"},  # the whole [tokens x vocab] logits
    # No reference engine: its log-probs come from a file that precompute-ref writes first (not timed).
    "packed-precomputed-ref": {"packing": True, "ref_logps": "precomputed"},
    # LoRA adapters on the frozen base; the reference is the policy with its adapters off (no reference engine).
    "packed-lora": {"packing": True, "lora_r": 8},
}
PRECOMPUTED = "precomputed"  # the ref_logps value that stands for the file the bench computes first
# Measured by default; on data whose prompts repeat (prompt groups), packed-no-prompt-groups too, before padded.
DEFAULT_CONFIGURATIONS = ("packed", "packed-no-prefix-sharing", "padded")
DEFAULT_MEASURED_STEPS = 4
MAX_ROUNDS = 100  # each round rebuilds every configuration: more is a typo, not a bench
# Test-only fault hooks: each is called with (configuration, round) as a configuration's round starts on every rank
# (tests/bench_fault_rank.py installs one); empty in every run of the package.
BEFORE_ROUND: list[Callable[[str, int], None]] = []


@dataclass
class BenchSettings:
    """The bench's own flags (the train flags come from config.py; --max-steps is the measured steps)."""

    out: str = "runs/bench"
    # Per round: every round builds its configurations afresh, and a fresh engine's first steps pay for the first
    # gathers and allocations (bench_rounds.py).
    bench_warmup_steps: int = 2
    bench_rounds: int = 3
    configurations: list[str] | None = None  # None: DEFAULT_CONFIGURATIONS (+ packed-no-prompt-groups), by the data
    bench_model: bool = True

    def validate(self) -> None:
        if not 0 <= self.bench_warmup_steps <= LARGEST_COUNT:
            raise InputError(f"--bench-warmup-steps must be in [0, {LARGEST_COUNT}], got {self.bench_warmup_steps}")
        if not 1 <= self.bench_rounds <= MAX_ROUNDS:
            raise InputError(f"--bench-rounds must be in [1, {MAX_ROUNDS}], got {self.bench_rounds}")
        if self.configurations is None:
            return
        unknown = [name for name in self.configurations if name not in CONFIGURATIONS]
        if unknown or not self.configurations:
            raise InputError(f"--configurations: unknown {', '.join(unknown) or '(empty)'} "
                             f"(known: {', '.join(CONFIGURATIONS)})")
        if len(set(self.configurations)) != len(self.configurations):
            raise InputError(f"--configurations: a name is repeated in {','.join(self.configurations)}")


def bench_parser(prog: str) -> argparse.ArgumentParser:
    parser = FlagParser(prog=prog, description="Packed vs padded throughput of the DPO step.",
                        epilog=refused_epilog("bench"))
    add_arguments(parser)
    group = parser.add_argument_group("bench")
    group.add_argument("--out", default=BenchSettings.out, help="Report folder (written atomically by rank 0).")
    group.add_argument("--bench-warmup-steps", type=int, default=BenchSettings.bench_warmup_steps,
                       help="Optimizer steps run before measuring, per configuration and round (--warmup-steps is the "
                            "LR schedule's). --max-steps is the number of measured steps per round (default "
                            f"{DEFAULT_MEASURED_STEPS}).")
    group.add_argument("--bench-rounds", type=int, default=BenchSettings.bench_rounds,
                       help="Rounds: every configuration is built afresh and measured once per round, the order "
                            "rotated each round; its figures are its median round's, the spread of its rounds is "
                            "reported beside them.")
    group.add_argument("--configurations", default=None,
                       help=f"Comma-separated configurations to measure (known: {', '.join(CONFIGURATIONS)}). "
                            f"Default: {','.join(DEFAULT_CONFIGURATIONS)}, and {GROUPS_OFF} when prompts repeat in "
                            f"the data (prompt groups).")
    group.add_argument("--bench-model", action=argparse.BooleanOptionalAction, default=True,
                       help="Without --model/--model-config, measure the bench model (Llama, hidden 256, 4 layers, "
                            "4 heads, 2 KV heads) instead of the 'tiny' default (hidden 64).")
    return parser


def parse_bench_args(argv: list[str] | None, prog: str = "ds-packdpo bench") -> tuple[object, BenchSettings]:
    """(the training flags, --max-steps defaulting to the measured steps; the bench's own settings)."""
    args = bench_parser(prog).parse_args(argv)
    flags = config_from_args(args, aside=NOT_ACTED_ON["bench"])  # refused typed, set aside from a recipe
    if flags.max_steps is None:
        flags = dataclasses.replace(flags, max_steps=DEFAULT_MEASURED_STEPS)
    named = None if args.configurations is None else [n.strip() for n in args.configurations.split(",") if n.strip()]
    settings = BenchSettings(out=args.out, bench_warmup_steps=args.bench_warmup_steps, bench_rounds=args.bench_rounds,
                             configurations=named, bench_model=args.bench_model)
    settings.validate()
    reads = [*flags.local_inputs(), flags.data_spec().tokenization.cache_path]  # the cache, made by phase one
    check_output_folder(settings.out, "--out", flags.overwrite, reads=reads)  # --overwrite replaces the whole folder
    return flags, settings


BENCH_MODEL = dict(hidden_size=256, layers=4, heads=4, kv_heads=2)


def bench_model_config(flags, first: RunSetup, settings: BenchSettings) -> object:
    """The flags with the bench model's config.json (written once per node) unless a model was given (``first``:
    the base flags' set-up)."""
    if flags.model is not None or flags.model_config is not None or not settings.bench_model:
        return flags
    folder = bench_model_folder(first)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"bench_model_vocab{first.vocab_size}.json"
    with FileLock(str(path) + ".lock"):
        if not path.is_file():
            tiny_config("llama", vocab_size=first.vocab_size,
                        max_position_embeddings=max(4096, first.spec.plan.row_budget),
                        **BENCH_MODEL).to_json_file(str(path))
    return dataclasses.replace(flags, model_config=str(path))


def bench_model_folder(setup: RunSetup) -> Path:
    return setup.spec.data.tokenization.cache_path / "bench_models"


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=float), q))


@dataclass
class RoundResult:
    """One configuration's round on this rank: its measured steps (their times the slowest rank's), every rank's peak
    memory and torch threads, and the FLOP meter of its engines."""

    steps: list[dict]
    peaks: list[int]
    memory_kind: str
    threads: list[int]
    meter: object


def measure_round(name: str, setup: RunSetup, warmup_steps: int) -> RoundResult:
    """Runs one round of one configuration (phase one done) on this rank: fresh engines, the warm-up steps, the
    measured steps; frees the engines and the memory they held.  Figures aggregated over all ranks (the same on
    every rank)."""
    spec = setup.spec
    layout, measured = spec.layout, spec.plan.max_steps
    with PeakMemory(spec.device_type) as memory:
        run = start(setup)
        trainer = DPOTrainer(run)
        meter = throughput_meter(run)
        lengths = (setup.prepared.chosen_lengths, setup.prepared.rejected_lengths)
        timer = StepTimer()
        steps = []
        bar = progress_bar(warmup_steps + measured, f"bench {name}", "step", layout.rank == 0 and spec.outputs.progress)
        # Every rank holds the whole plan, so rank 0's records carry every data-parallel share's load.
        epochs = run_length(spec.plan, setup.prepared, warmup_steps + measured).epochs
        for index, plan in enumerate(run_plan(setup.prepared, spec.plan.config, epochs)):
            if index >= warmup_steps + measured:
                break
            timer.begin()
            metrics = trainer.train_step(plan)
            seconds = timer.seconds()
            bar.update(1)
            if index < warmup_steps:
                continue
            steps.append({
                "step": index + 1, "step_time_s": seconds, "loss": metrics["loss"], "grad_norm": metrics["grad_norm"],
                "pairs": metrics["pairs"], "real_tokens": metrics["tokens"],
                "computed_tokens": metrics["computed_tokens"], "prompt_tokens_shared": metrics["prompt_tokens_shared"],
                "rows_per_rank": metrics["rows_per_rank"],
                "rank_real_tokens": rank_real_tokens(plan, lengths),
                "rank_tokens": list(plan.rank_tokens), "rank_computed_tokens": list(plan.rank_computed_tokens),
                "lockstep_tokens": sum(max(rows[i].computed_tokens for rows in plan.ranks)
                                       for i in range(plan.rows_per_rank)),
                "prompt_copy_tokens": plan.prompt_copy_tokens,
                "attention_sq": meter.attention_sq(plan), "flops": meter.step_flops(plan),
                "prepass_flops": meter.prepass_flops(plan),
                "row_fill": [row.tokens / spec.plan.config.max_tokens_per_row for rows in plan.ranks for row in rows
                             if row.pairs],
                "sequence_lengths": [int(lengths[k][p]) for p in plan.pairs for k in (0, 1)],
            })
        bar.close()
        run.close()
        del run, trainer
        release_free_memory()  # the next configuration starts from the allocator state this one did
    # every rank's peak memory and threads go into the report
    peaks, threads = [None] * layout.world_size, [None] * layout.world_size
    dist.all_gather_object(peaks, memory.peak_bytes)
    dist.all_gather_object(threads, torch.get_num_threads())
    for step, seconds in zip(steps, slowest_rank_seconds([s["step_time_s"] for s in steps])):
        step["step_time_s"] = seconds
    return RoundResult(steps, peaks, memory.kind, threads, meter)


def slowest_rank_seconds(seconds: list[float]) -> list[float]:
    """Each step's time on the slowest rank (which sets the lock-step pace), reduced on the accelerator: NCCL reduces
    no CPU tensor (the first H200 run ended there)."""
    times = torch.tensor(seconds, dtype=torch.float64, device=get_accelerator().current_device_name())
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return times.tolist()


def summarize(name: str, setup: RunSetup, rounds: list[RoundResult], positions: list[int]) -> dict:
    """One configuration's entry of ``report.json`` ``runs`` (see report.py for the schema): the figures of its
    median round, every round's beside them."""
    figures = run_rounds([result.steps for result in rounds], positions)
    steps = rounds[figures["median_round"] - 1].steps
    total_time = sum(s["step_time_s"] for s in steps)
    real = sum(s["real_tokens"] for s in steps)
    computed = sum(s["computed_tokens"] for s in steps)
    shared = sum(s["prompt_tokens_shared"] for s in steps)
    pairs = sum(s["pairs"] for s in steps)
    flops = sum(s["flops"] for s in steps)
    times = [s["step_time_s"] for s in steps]
    balance = [max(s["rank_computed_tokens"]) / (sum(s["rank_computed_tokens"]) / len(s["rank_computed_tokens"]))
               for s in steps]
    peaks = [max(result.peaks[rank] for result in rounds) for rank in range(len(rounds[0].peaks))]
    return {
        "name": name,
        "overrides": CONFIGURATIONS[name],
        "attn": setup.spec.attention.backend,
        "packing": setup.spec.row_layout.packed,
        "sequence_parallel_size": setup.spec.layout.sp_size,
        "measured_steps": len(steps),
        "tokens_per_s": real / total_time,
        "pairs_per_s": pairs / total_time,
        "computed_tokens_per_s": computed / total_time,
        "step_time_s": {"median": statistics.median(times), "p90": _percentile(times, 90), "mean": total_time / len(times),
                        "min": min(times), "max": max(times)},
        **figures,
        "real_tokens": real,
        "computed_tokens": computed,
        "prompt_tokens_shared": shared,
        "pairs": pairs,
        "utilization": (real - shared) / computed,
        "rank_load_max_over_mean": max(balance),
        "rank_load_max_over_mean_mean": sum(balance) / len(balance),
        "rows_per_rank_mean": sum(s["rows_per_rank"] for s in steps) / len(steps),
        "lockstep_utilization": (sum(sum(s["rank_computed_tokens"]) for s in steps)
                                 / (setup.spec.layout.dp_size * sum(s["lockstep_tokens"] for s in steps))),
        "prompt_copy_tokens": sum(s["prompt_copy_tokens"] for s in steps),
        "peak_mem_mb": max(peaks) / 2**20,
        "peak_mem_mb_per_rank": [p / 2**20 for p in peaks],
        "peak_mem_kind": rounds[0].memory_kind,
        "model_flops": flops,
        "prepass_flops": sum(s["prepass_flops"] for s in steps),
        **rounds[0].meter.figures(flops, total_time),
        "steps": steps,
    }


def rank_real_tokens(plan, lengths) -> list[int]:
    """The real tokens of the pair sides each data-parallel share computes (``lengths``: chosen, rejected): a pair's
    two sides lie on two shares where prompt groups are spread over ranks, so it is counted by side, not by pair."""
    share = plan.side_rows() // plan.rows_per_rank
    pairs = np.asarray(plan.pairs, dtype=np.int64)
    tokens = np.stack([np.asarray(lengths[0])[pairs], np.asarray(lengths[1])[pairs]], 1)
    return np.bincount(share.reshape(-1), weights=tokens.reshape(-1), minlength=len(plan.ranks)).astype(int).tolist()


def environment(device_type: str, threads: list[int] | None = None) -> dict:
    """The software and machine of the bench; ``threads``: every rank's torch threads (None before a round ran)."""
    if device_type == "cuda":
        device_name = torch.cuda.get_device_name()
    else:
        device_name = platform.processor() or platform.machine()
    return {"python": platform.python_version(), "torch": torch.__version__, "deepspeed": deepspeed.__version__,
            "transformers": transformers.__version__, "device_type": device_type, "device_name": device_name,
            "hostname": platform.node(), "torch_threads": torch.get_num_threads(),
            "torch_threads_per_rank": threads, "cpu_cores": len(os.sched_getaffinity(0)),
            "local_ranks": int(os.environ["LOCAL_SIZE"]) if os.environ.get("LOCAL_SIZE") else None}


def model_summary(model: ModelSpec, setup: RunSetup) -> dict:
    """The measured model's shape (``setup``: a set-up of the bench's data, for its tokenizer)."""
    hf = model_config(model, setup.vocab_size, own_tokenizer=setup.spec.data.tokenizer is None)
    return {"source": model.name, "architecture": (hf.architectures or [hf.model_type])[0],
            "hidden_size": hf.hidden_size, "num_layers": hf.num_hidden_layers, "num_heads": hf.num_attention_heads,
            "num_kv_heads": getattr(hf, "num_key_value_heads", hf.num_attention_heads),
            "intermediate_size": getattr(hf, "intermediate_size", None), "vocab_size": hf.vocab_size}


def check_enough_steps(setup: RunSetup, warmup_steps: int) -> None:
    plan = setup.spec.plan
    asked = f"--max-steps {plan.max_steps} + --bench-warmup-steps {warmup_steps}"
    available = run_length(plan, setup.prepared, warmup_steps + plan.max_steps, asked).steps  # --epochs: they cap it
    if available < warmup_steps + plan.max_steps:
        raise InputError(f"{asked}: the data holds only "
                         f"{available} steps of {plan.config.global_batch_pairs or '--tokens-per-step'} pairs in "
                         f"--epochs {plan.epochs} (use fewer steps, more --epochs, or leave --epochs out)")


def configuration_flags(flags, name: str, first: RunSetup):
    """The flags of one configuration (the precomputed reference's file stands in as its path)."""
    overrides = dict(CONFIGURATIONS[name])
    if overrides.get("ref_logps") == PRECOMPUTED:
        overrides["ref_logps"] = str(precomputed_reference_path(first))
    return dataclasses.replace(flags, **overrides, overwrite=True)


def precomputed_reference_path(setup: RunSetup) -> Path:
    """Where precompute-ref writes the bench's reference file (shared by the nodes of a multi-node bench, as for
    ``train --ref-logps``)."""
    return bench_model_folder(setup) / "reference_logps.jsonl"


@dataclass
class BenchPlan:
    """Phase one of a bench: the flags with the measured model, and each configuration's checked set-up."""

    flags: object  # the bench's flags (config.py), with the bench model's config when it measures one
    first: RunSetup  # the base flags' set-up: layout, tokenizer, device for the report
    setups: dict[str, RunSetup | None]  # None: the precomputed-reference configuration, prepared once its file exists


def prompt_groups_ideal(setup: RunSetup) -> float:
    """The computed tokens of prefix sharing pair by pair over those of prompt groups (each prompt and each response
    of a group once) on the configuration's pairs: what packed-no-prompt-groups would measure against packed (1.0
    where the configuration does not group prompts)."""
    if not setup.spec.row_layout.groups_prompts:
        return 1.0
    groups, prepared = setup.prepared.groups, setup.prepared
    chosen, rejected, prompt = (np.asarray(lengths, dtype=np.int64) for lengths in
                                (prepared.chosen_lengths, prepared.rejected_lengths, prepared.prompt_lengths))
    responses = np.concatenate([groups.chosen, groups.rejected])
    response_tokens = np.concatenate([chosen - prompt, rejected - prompt])
    first_of_group = np.unique(groups.group, return_index=True)[1]
    first_of_response = np.unique(responses, return_index=True)[1]
    grouped = prompt[first_of_group].sum() + response_tokens[first_of_response].sum()
    return float((chosen + rejected - prompt).sum() / grouped)


# packed-no-prompt-groups joins the default configurations when prompt groups save at least this share of the tokens
# prefix sharing computes pair by pair (2.6x on multi_response_demo's 693 pairs; 1.017x on dpo_en_demo's 5 repeated
# pairs, within the noise of a bench: not worth a configuration's time)
PROMPT_GROUPS_WORTH = 1.05


def check_configurations(flags, settings: BenchSettings, world_size: int | None = None) -> BenchPlan:
    """Phase one of the bench: every configuration checked with the model it will measure, before any process group
    (a configuration the layout cannot run is refused here, not after the others were measured).  Without
    --configurations: the defaults, and packed-no-prompt-groups where the data's prompts repeat enough for prompt
    groups to save tokens (:data:`PROMPT_GROUPS_WORTH`)."""
    first = prepare(flags, "bench", world_size)
    check_enough_steps(first, settings.bench_warmup_steps)
    flags = bench_model_config(flags, first, settings)
    setups = {}
    for name in settings.configurations or DEFAULT_CONFIGURATIONS:
        setups[name] = configuration_setup(flags, name, first, world_size)
    if settings.configurations is None and prompt_groups_ideal(setups["packed"]) >= PROMPT_GROUPS_WORTH:
        setups = {**{n: s for n, s in setups.items() if n != "padded"},
                  GROUPS_OFF: configuration_setup(flags, GROUPS_OFF, first, world_size), "padded": setups["padded"]}
    return BenchPlan(flags, first, setups)


@contextlib.contextmanager
def said_before():
    """A configuration's phase one, on the data the first set-up prepared and warned about: none of this package's
    warnings again, neither say_warning's lines (said_already) nor ``warnings.warn``'s, which Python would repeat
    (each phase one's quiet_libraries sets a warning filter, and that empties Python's record of warnings shown)."""
    with said_already(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, module=r"ds_packdpo\.")
        yield


def configuration_setup(flags, name: str, first: RunSetup, world_size: int | None) -> RunSetup | None:
    """Phase one of one configuration (``first``: the base flags' set-up; None for the precomputed reference: its
    file does not exist yet)."""
    if CONFIGURATIONS[name].get("ref_logps") == PRECOMPUTED:
        conflict = precomputed_conflict(first.spec.loss, first.spec.reference.offload, first.spec.reference.whole)
        if conflict:  # else it would measure the run without it, under its name
            raise InputError(f"--configurations {name}: {conflict}")
        return None
    try:
        with said_before():
            return prepare(configuration_flags(flags, name, first), "bench", world_size)
    except InputError as error:
        raise InputError(f"--configurations {name}: {error}") from None


def run_bench(flags, settings: BenchSettings, argv: list[str]) -> dict | None:
    """The whole bench on this rank, in rounds; rank 0 rewrites the report folder after each configuration's round
    (a bench that ends early, out of memory in its padded configuration say, keeps the figures it measured) and
    returns the report."""
    plan = check_configurations(flags, settings)
    flags, first = plan.flags, plan.first
    rank = first.spec.layout.rank
    order = schedule(list(plan.setups), settings.bench_rounds)
    failed = json.loads(os.environ.get(FAILED_ENV) or "{}")  # configurations an earlier launch lost (bench_front.py)
    rounds: dict[str, list[RoundResult]] = {}
    positions: dict[str, list[int]] = {}
    runs, report = {}, None
    for number, (round_number, name) in enumerate(order):
        position = number % len(plan.setups) + 1
        if rank == 0:  # a log, and the front process, say which one died
            print(measuring_line(name, round_number, settings.bench_rounds, position, len(plan.setups)), flush=True)
        try:
            for hook in BEFORE_ROUND:
                hook(name, round_number)
            if plan.setups[name] is None:
                with said_before():
                    precompute(dataclasses.replace(flags, overwrite=True), str(precomputed_reference_path(first)))
                    plan.setups[name] = prepare(configuration_flags(flags, name, first), "bench")  # (untimed)
            result = measure_round(name, plan.setups[name], settings.bench_warmup_steps)
        except InputError:
            raise
        except Exception as error:
            print(failure_line(name, round_number, rank, error), file=sys.stderr, flush=True)
            raise
        rounds.setdefault(name, []).append(result)
        positions.setdefault(name, []).append(position)
        runs[name] = summarize(name, plan.setups[name], rounds[name], positions[name])
        if rank == 0:
            report = write_bench_report(plan, settings, argv, runs, unmeasured=[n for n in plan.setups if n not in runs],
                                        order=order, failed=failed, threads=result.threads,
                                        overwrite=first.spec.outputs.overwrite or number > 0)
    if report is not None:
        print("\n".join(f"bench: {headline(figures)}" for figures in report["comparisons"]), flush=True)
    return report


def write_bench_report(plan: BenchPlan, settings: BenchSettings, argv: list[str], runs: dict, unmeasured: list[str],
                       order: list, failed: dict, threads: list[int] | None, overwrite: bool) -> dict:
    """The report of the rounds measured so far, written atomically over the previous one (rank 0)."""
    first = plan.first
    spec = first.spec
    # the measured model (the bench model's config unless given)
    model = model_spec(plan.flags, spec.model.dtype, spec.device_type)
    report = build_report(
        command=shlex.join([sys.executable, "-m", "ds_packdpo.bench", *argv]),
        layout=spec.layout.as_dict(), dataset=spec.data.tokenization.dataset,
        model=model_summary(model, first), environment=environment(spec.device_type, threads),
        settings={**spec.settings, "model_config": model.config,
                  "bench_warmup_steps": settings.bench_warmup_steps, "bench_rounds": settings.bench_rounds,
                  "configurations": list(plan.setups), "row_budget": spec.plan.row_budget},
        runs=dict(runs), unmeasured=tuple(unmeasured), rounds=settings.bench_rounds, order=order, failed=failed)
    write_report_folder(report, Path(settings.out), overwrite=overwrite)
    return report


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    def job() -> int:
        if get_accelerator().device_name() == "cpu":
            steady_allocator()  # each configuration's memory served alike whatever ran before (run/cpu_memory.py)
        flags, settings = parse_bench_args(argv, prog="ds_packdpo.bench")
        run_bench(flags, settings, [a for a in argv if not a.startswith("--local_rank")])
        close_process_group()
        return 0

    return run_guarded(job)


if __name__ == "__main__":
    exit_rank(main())
