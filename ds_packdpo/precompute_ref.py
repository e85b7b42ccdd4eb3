"""One rank of ``ds-packdpo precompute-ref``: the reference model run once over the dataset.

``deepspeed ... --module ds_packdpo.precompute_ref <training flags> --out FILE``.
It takes the training flags so that the data, the tokenizer, the model, the dtype
and the row plan are exactly those of the run that will use the file.  Every pair
of one epoch is run once, packed into the same rows and dealt to the ranks as in
training (same number of rows per rank: the ZeRO-3 reference engine gathers its
weights collectively), under ``torch.no_grad``; the per-pair results are gathered
to rank 0 every few steps and kept on disk (a rerun after a crash continues from them), and at the end rank 0
writes ``FILE`` and ``FILE.meta.json`` (see :mod:`ds_packdpo.run.reference`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch.distributed as dist

from .command_settings import NOT_ACTED_ON, refused_epilog
from .config import FlagParser, add_arguments, config_from_args
from .console import progress_bar
from .data.plan import PlanConfig, steps_per_epoch
from .data.run_plan import run_plan
from .run import hooks
from .run.assemble import RunSetup, prepare, start
from .run.process_group import exit_rank, run_rank_job
from .run.reference import RECORD_KEYS, check_output_path, reference_fingerprint, write_reference
from .run.reference_parts import check_parts, kept_steps, read_shards, remove_parts, steps_per_shard, write_shard
from .run.response_exchange import exchanged_pairs

# a kept shard's columns (RECORD_KEYS): the sums in fp64 as everywhere they are stored, token counts as integers
RECORD_DTYPES = {"pair_id": np.int64, "chosen_logps": np.float64, "rejected_logps": np.float64,
                 "chosen_tokens": np.int64, "rejected_tokens": np.int64}


def precompute_parser(prog: str = "ds-packdpo precompute-ref") -> FlagParser:
    parser = FlagParser(prog=prog, description="Reference log-probs of every pair, computed once, "
                                     "for 'ds-packdpo train --ref-logps FILE'. Takes the training flags.",
                        epilog=refused_epilog("precompute-ref"))
    add_arguments(parser)
    parser.add_argument("--out", default=None, help="The file to write: FILE.jsonl (or FILE.parquet), "
                        "with its fingerprint in FILE.meta.json.")
    return parser


def parse_args(argv: list[str] | None = None, prog: str = "ds-packdpo precompute-ref"):
    """(settings, --out): the training flags less those precompute-ref does not act on (refused typed, set aside from a
    recipe; bench calls :func:`precompute` with its own)."""
    args = precompute_parser(prog).parse_args(argv)
    return config_from_args(args, aside=NOT_ACTED_ON["precompute-ref"]), args.out


def precompute_setup(flags, out: str | None, world_size: int | None = None) -> tuple[Path, RunSetup]:
    """Phase one: ``--out`` checked, then the run's (its output folder is --out's, which may hold other files), then
    the work an interrupted job kept beside ``--out`` (refused in one line when made under other settings)."""
    path = check_output_path(out, flags.overwrite, reads=flags.local_inputs())
    setup = prepare(dataclasses.replace(flags, output_dir=str(path.parent), overwrite=True), "precompute-ref",
                    world_size)
    check_parts(path, lambda: reference_settings(setup, epoch_steps(setup)), flags.overwrite)
    return path, setup


def every_pair_once(setup: RunSetup) -> PlanConfig:
    return dataclasses.replace(setup.spec.plan.config, drop_last=False)


def epoch_steps(setup: RunSetup) -> int:
    prepared = setup.prepared
    return steps_per_epoch(prepared.chosen_lengths, prepared.rejected_lengths, every_pair_once(setup),
                           groups=prepared.groups)


def run_info(setup: RunSetup) -> dict:
    """How the file was computed (its meta's ``info``): the data, the layout, the row budget, the kernels."""
    spec = setup.spec
    return {"dataset": spec.data.tokenization.dataset, "pairs": len(setup.prepared.chosen_lengths),
            "attn": spec.attention.backend, **spec.layout.as_dict(), "max_tokens_per_row": spec.plan.row_budget,
            "logps_impl": spec.logps.impl}


def reference_settings(setup: RunSetup, steps: int) -> dict:
    """What the work kept across a crash is made under (run/reference_parts.py): what decides the numbers (the
    reference fingerprint), which pairs make up step s (the plan's), and how a step is laid out and computed."""
    return {"reference": reference_fingerprint(setup), "plan": setup.plan_fingerprint, **run_info(setup),
            "steps": steps, "steps_per_shard": steps_per_shard(steps)}


def _keep(path: Path, first: int, last: int, local: dict[str, list], rank: int, world_size: int) -> None:
    """Every rank's results of steps ``first..last`` gathered to rank 0, which writes them as one shard."""
    gathered = [None] * world_size if rank == 0 else None
    dist.gather_object(local, gathered, dst=0)
    if rank == 0:
        write_shard(path, first, last, {key: np.asarray([v for part in gathered for v in part[key]], dtype=dtype)
                                        for key, dtype in RECORD_DTYPES.items()})


def precompute(flags, out: str | None) -> dict | None:
    """The whole job on this rank; rank 0 writes the file and returns a summary (other ranks: None).

    Each data-parallel share of the plan runs its rows; under sequence parallelism the
    ranks of a group run them together and only the first of the group keeps the sums
    (they are the same on every rank of the group).  Every few steps the results go to
    disk (:mod:`ds_packdpo.run.reference_parts`); a rerun after a crash starts after the
    last step kept, and the file is built from the kept results alone.
    """
    path, setup = precompute_setup(flags, out)
    run = start(setup)
    spec = setup.spec
    layout = spec.layout
    pair_ids = setup.prepared.pair_ids
    steps = epoch_steps(setup)
    every = steps_per_shard(steps)
    settings = reference_settings(setup, steps) if layout.rank == 0 else None
    done = [kept_steps(path, settings) if layout.rank == 0 else None]
    dist.broadcast_object_list(done, src=0)
    done = done[0]
    bar = progress_bar(len(pair_ids), "reference log-probs", "pair", layout.rank == 0 and spec.outputs.progress)
    if done and layout.rank == 0:
        bar.update(len(read_shards(path, ("pair_id",), done)["pair_id"]))
    local, first = {key: [] for key in RECORD_KEYS}, done + 1
    for step, plan in enumerate(run_plan(setup.prepared, every_pair_once(setup), epochs=1, start_step=done),
                                start=done + 1):
        found = []  # (pair indices, their sums in canonical order) this rank records
        batches = [run.row_batch(row, plan) for row in plan.ranks[layout.dp_rank]]
        references = [run.reference_logps(batch) for batch in batches]
        if plan.responses is not None:  # responses spread over ranks: exchanged, rank 0 records the step's pairs
            _, exchanged = exchanged_pairs(run, plan, batches, [None] * len(batches), references)
            found = [(plan.pairs, exchanged)] if layout.rank == 0 else []
        elif layout.counts_metrics:
            found = [(batch.pair_indices.tolist(), seqs) for batch, seqs in zip(batches, references)]
        for pairs, seqs in found:
            local["pair_id"] += [pair_ids[i] for i in pairs]
            for key, values in (("chosen_logps", seqs.chosen_logps), ("rejected_logps", seqs.rejected_logps),
                                ("chosen_tokens", seqs.chosen_tokens), ("rejected_tokens", seqs.rejected_tokens)):
                local[key] += values.tolist()
        bar.update(plan.num_pairs)  # the ranks run their rows in lock step: rank 0's steps are everyone's
        if step % every == 0 or step == steps:
            _keep(path, first, step, local, layout.rank, layout.world_size)
            hooks.installed().reference_kept(layout.rank, step)
            local, first = {key: [] for key in RECORD_KEYS}, step + 1
    bar.close()
    summary = None
    if layout.rank == 0:
        kept = read_shards(path, RECORD_KEYS, steps)
        order = np.argsort(kept["pair_id"], kind="stable")
        merged = {key: kept[key][order].tolist() for key in RECORD_KEYS}
        if len(merged["pair_id"]) != len(pair_ids):
            raise RuntimeError(f"precompute-ref: {len(merged['pair_id'])} pairs computed for {len(pair_ids)}")
        info = run_info(setup)
        write_reference(path, merged, settings["reference"], info)
        remove_parts(path)
        summary = {"output": str(path), "meta": f"{path}.meta.json", **info}
    run.close()
    dist.barrier()  # no rank leaves (and no launcher reports success) before the file is written
    return summary


def main(argv: list[str] | None = None) -> int:
    return run_rank_job(lambda: precompute(*parse_args(argv, prog="ds_packdpo.precompute_ref")))


if __name__ == "__main__":
    exit_rank(main())
