"""One rank of ``ds-packdpo precompute-ref``: the reference model run once over the dataset.

``deepspeed ... --module ds_packdpo.precompute_ref <training flags> --out FILE``.
It takes the training flags so that the data, the tokenizer, the model, the dtype
and the row plan are exactly those of the run that will use the file.  Every pair
of one epoch is run once, packed into the same rows and dealt to the ranks as in
training (same number of rows per rank: the ZeRO-3 reference engine gathers its
weights collectively), under ``torch.no_grad``; the per-pair results are gathered
to rank 0, which writes ``FILE`` and ``FILE.meta.json`` (see :mod:`ds_packdpo.reference`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from .errors import run_guarded
from .config import add_arguments, config_from_args


def parse_args(argv: list[str] | None = None, prog: str = "ds-packdpo precompute-ref"):
    parser = argparse.ArgumentParser(prog=prog, description="Reference log-probs of every pair, computed once, "
                                     "for 'ds-packdpo train --ref-logps FILE'. Takes the training flags.")
    add_arguments(parser)
    parser.add_argument("--out", default=None, help="The file to write: FILE.jsonl (or FILE.parquet), "
                        "with its fingerprint in FILE.meta.json.")
    args = parser.parse_args(argv)
    return config_from_args(args), args.out


def _packed_row(columns, pair_indices, pad_token_id: int):
    from .model.collate import collate_packed

    cols = columns[list(pair_indices)] if pair_indices else {"prompt_ids": [], "chosen_ids": [], "rejected_ids": []}
    pairs = [{"prompt_ids": p, "chosen_ids": c, "rejected_ids": r}
             for p, c, r in zip(cols["prompt_ids"], cols["chosen_ids"], cols["rejected_ids"])]
    return collate_packed(pairs, list(pair_indices), pad_token_id)


def precompute(cfg, out: str | None) -> dict | None:
    """The whole job on this rank; rank 0 writes the file and returns a summary (other ranks: None)."""
    import torch
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    from .run.engines import build_reference
    from .model.guard import assert_packing_exact
    from .data.plan import iter_plan
    from .run.reference import (RECORD_KEYS, check_output_path, reference_fingerprint, reference_logps,
                            write_reference)
    from .run.trainer import init_process_group, prepare_run

    path = check_output_path(out, cfg.overwrite)
    # The run's output folder is the one of --out, which may hold other files.
    run = prepare_run(dataclasses.replace(cfg, output_dir=str(path.parent), overwrite=True))
    fingerprint = reference_fingerprint(run)
    init_process_group(cfg)
    reference = build_reference(cfg, run.ds_config, len(run.tokenizer), run.attn)
    device = get_accelerator().current_device_name()
    pad_token_id = run.tokenizer.pad_token_id if run.tokenizer.pad_token_id is not None else 0
    if not cfg.skip_packing_check:
        assert_packing_exact(reference, run.attn, len(run.tokenizer), pad_token_id, device=device)

    rank, world_size = dist.get_rank(), dist.get_world_size()
    columns = run.prepared.dataset
    pair_ids = columns["pair_id"]
    plan_cfg = dataclasses.replace(run.plan_cfg, drop_last=False)  # every pair, once
    local = {key: [] for key in RECORD_KEYS}
    lengths = (run.prepared.chosen_lengths, run.prepared.rejected_lengths)
    with torch.no_grad():
        for plan in iter_plan(*lengths, plan_cfg, epochs=1):
            for row in plan.ranks[rank]:
                batch = _packed_row(columns, row.pairs, pad_token_id).to(device)
                seqs = reference_logps(reference, batch, run.attn, cfg.logps_chunk_tokens, cfg.logps_impl)
                local["pair_id"] += [pair_ids[i] for i in row.pairs]
                for key, values in (("chosen_logps", seqs.chosen_logps), ("rejected_logps", seqs.rejected_logps),
                                    ("chosen_tokens", seqs.chosen_tokens), ("rejected_tokens", seqs.rejected_tokens)):
                    local[key] += values.tolist()
    gathered = [None] * world_size if rank == 0 else None
    dist.gather_object(local, gathered, dst=0)
    summary = None
    if rank == 0:
        merged = {key: [v for part in gathered for v in part[key]] for key in RECORD_KEYS}
        order = sorted(range(len(merged["pair_id"])), key=merged["pair_id"].__getitem__)
        merged = {key: [values[i] for i in order] for key, values in merged.items()}
        merged["chosen_tokens"] = [int(v) for v in merged["chosen_tokens"]]
        merged["rejected_tokens"] = [int(v) for v in merged["rejected_tokens"]]
        if len(merged["pair_id"]) != len(pair_ids):
            raise RuntimeError(f"precompute-ref: {len(merged['pair_id'])} pairs computed for {len(pair_ids)}")
        info = {"dataset": cfg.dataset or "synthetic", "pairs": len(pair_ids), "attn": run.attn,
                "world_size": world_size, "max_tokens_per_row": cfg.row_budget, "logps_impl": cfg.logps_impl}
        write_reference(path, merged, fingerprint, info)
        summary = {"output": str(path), "meta": f"{path}.meta.json", **info}
    dist.barrier()  # no rank leaves (and no launcher reports success) before the file is written
    return summary


def main(argv: list[str] | None = None) -> int:
    def job() -> int:
        cfg, out = parse_args(argv, prog="ds_packdpo.precompute_ref")
        summary = precompute(cfg, out)
        if summary is not None:
            print(json.dumps(summary, indent=2))
        return 0

    return run_guarded(job)


if __name__ == "__main__":
    sys.exit(main())
