"""What the pre-pass of the sorted batch-coupled losses (aot, aot_unpaired) costs: the extra no-grad policy
forwards of a step's rows against the whole training step, measured in one process (1 rank), interleaved step by
step so a busy machine slows both alike.  Times are CPU time of the process on one thread (steadier than wall time
on a shared machine, see scripts/bench_logps.py) and wall time.

Takes train flags (give a ``--loss`` with aot or aot_unpaired); runs ``--max-steps`` steps through the trainer's own
``DPOTrainer.train_step`` and, before each, times the no-grad policy forwards of that step's rows
(what ``run/step_statistics.CoupledStep`` adds to a step; its reference forwards are the step's own, moved, not
extra).  Prints JSON with the medians over the steps after the first.

    DS_ACCELERATOR=cpu PYTHONPATH=. .venv/bin/python scripts/bench_coupled_prepass.py --synthetic-pairs 192 \\
        --global-batch-pairs 48 --max-length 96 --max-steps 12 --epochs 4 --dtype fp32 --loss sigmoid,aot
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys
import time

import torch

from ds_packdpo.config import parse_train_args
from ds_packdpo.data.run_plan import run_plan
from ds_packdpo.run.assemble import prepare, start
from ds_packdpo.run.process_group import close_process_group
from ds_packdpo.run.trainer import DPOTrainer


def main(argv: list[str]) -> dict:
    torch.set_num_threads(1)
    cfg = parse_train_args(["--output-dir", "/tmp/bench_coupled_prepass", "--overwrite", "--no-progress", *argv])
    setup = prepare(cfg, "train")
    run = start(setup)
    trainer = DPOTrainer(run)
    times = {"extra_cpu_s": [], "step_cpu_s": [], "extra_wall_s": [], "step_wall_s": []}
    plan_spec = setup.spec.plan
    for plan in itertools.islice(run_plan(setup.prepared, plan_spec.config, plan_spec.epochs), plan_spec.max_steps):
        batches = [run.row_batch(row, plan) for row in plan.ranks[setup.spec.layout.dp_rank]]
        cpu, wall = time.process_time(), time.perf_counter()
        with torch.no_grad():
            for batch in batches:
                run.forward_logps(run.policy, batch)
        times["extra_cpu_s"].append(time.process_time() - cpu)
        times["extra_wall_s"].append(time.perf_counter() - wall)
        cpu, wall = time.process_time(), time.perf_counter()
        trainer.train_step(plan)
        times["step_cpu_s"].append(time.process_time() - cpu)
        times["step_wall_s"].append(time.perf_counter() - wall)
    close_process_group()
    medians = {name: statistics.median(values[1:]) for name, values in times.items()}
    return {"loss": cfg.loss, "rows_per_rank": len(batches), "steps_measured": len(times["step_cpu_s"]) - 1,
            **medians, "extra_share_of_step_cpu": medians["extra_cpu_s"] / medians["step_cpu_s"]}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:]), indent=1))
