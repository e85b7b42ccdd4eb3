"""One rank of ``ds-packdpo precompute-ref``: the reference model run once over the dataset.

``deepspeed ... --module ds_packdpo.precompute_ref <training flags> --out FILE``.
It takes the training flags so that the data, the tokenizer, the model, the dtype
and the row plan are exactly those of the run that will use the file.  Every pair
of one epoch is run once, packed into the same rows and dealt to the ranks as in
training (same number of rows per rank: the ZeRO-3 reference engine gathers its
weights collectively), under ``torch.no_grad``; the per-pair results are gathered
to rank 0, which writes ``FILE`` and ``FILE.meta.json`` (see :mod:`ds_packdpo.run.reference`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch.distributed as dist

from .command_settings import NOT_ACTED_ON, refused_epilog
from .config import FlagParser, add_arguments, config_from_args
from .console import progress_bar
from .data.run_plan import run_plan
from .run.assemble import RunSetup, prepare, start
from .run.process_group import exit_rank, run_rank_job
from .run.reference import RECORD_KEYS, check_output_path, reference_fingerprint, write_reference
from .run.response_exchange import exchanged_pairs


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
    """Phase one: ``--out`` checked, then the run's (its output folder is --out's, which may hold other files)."""
    path = check_output_path(out, flags.overwrite, reads=flags.local_inputs())
    return path, prepare(dataclasses.replace(flags, output_dir=str(path.parent), overwrite=True), "precompute-ref",
                         world_size)


def precompute(flags, out: str | None) -> dict | None:
    """The whole job on this rank; rank 0 writes the file and returns a summary (other ranks: None).

    Each data-parallel share of the plan runs its rows; under sequence parallelism the
    ranks of a group run them together and only the first of the group keeps the sums
    (they are the same on every rank of the group).
    """
    path, setup = precompute_setup(flags, out)
    run = start(setup)
    spec = setup.spec
    layout = spec.layout
    pair_ids = setup.prepared.dataset["pair_id"]
    plan_cfg = dataclasses.replace(spec.plan.config, drop_last=False)  # every pair, once
    local = {key: [] for key in RECORD_KEYS}
    bar = progress_bar(len(pair_ids), "reference log-probs", "pair", layout.rank == 0 and spec.outputs.progress)
    for plan in run_plan(setup.prepared, plan_cfg, epochs=1):
        found = []  # (pair indices, their sums in canonical order) this rank records
        batches = [run.row_batch(row, plan) for row in plan.ranks[layout.dp_rank]]
        references = [run.reference_logps(batch) for batch in batches]
        if plan.responses is not None:  # responses spread over ranks: exchanged, rank 0 records the step's pairs
            _, every = exchanged_pairs(run, plan, batches, [None] * len(batches), references)
            found = [(plan.pairs, every)] if layout.rank == 0 else []
        elif layout.counts_metrics:
            found = [(batch.pair_indices.tolist(), seqs) for batch, seqs in zip(batches, references)]
        for pairs, seqs in found:
            local["pair_id"] += [pair_ids[i] for i in pairs]
            for key, values in (("chosen_logps", seqs.chosen_logps), ("rejected_logps", seqs.rejected_logps),
                                ("chosen_tokens", seqs.chosen_tokens), ("rejected_tokens", seqs.rejected_tokens)):
                local[key] += values.tolist()
        bar.update(plan.num_pairs)  # the ranks run their rows in lock step: rank 0's steps are everyone's
    bar.close()
    gathered = [None] * layout.world_size if layout.rank == 0 else None
    dist.gather_object(local, gathered, dst=0)
    summary = None
    if layout.rank == 0:
        merged = {key: [v for part in gathered for v in part[key]] for key in RECORD_KEYS}
        order = sorted(range(len(merged["pair_id"])), key=merged["pair_id"].__getitem__)
        merged = {key: [values[i] for i in order] for key, values in merged.items()}
        merged["chosen_tokens"] = [int(v) for v in merged["chosen_tokens"]]
        merged["rejected_tokens"] = [int(v) for v in merged["rejected_tokens"]]
        if len(merged["pair_id"]) != len(pair_ids):
            raise RuntimeError(f"precompute-ref: {len(merged['pair_id'])} pairs computed for {len(pair_ids)}")
        info = {"dataset": spec.data.tokenization.dataset, "pairs": len(pair_ids), "attn": spec.attention.backend,
                **layout.as_dict(), "max_tokens_per_row": spec.plan.row_budget, "logps_impl": spec.logps.impl}
        write_reference(path, merged, reference_fingerprint(setup), info)
        summary = {"output": str(path), "meta": f"{path}.meta.json", **info}
    run.close()
    dist.barrier()  # no rank leaves (and no launcher reports success) before the file is written
    return summary


def main(argv: list[str] | None = None) -> int:
    return run_rank_job(lambda: precompute(*parse_args(argv, prog="ds_packdpo.precompute_ref")))


if __name__ == "__main__":
    exit_rank(main())
