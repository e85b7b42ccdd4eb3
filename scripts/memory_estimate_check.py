"""The dry run's memory estimate against the measured peak of the same run, on one CPU rank.

``python scripts/memory_estimate_check.py [train flags]`` (no launcher: one rank): phase
one, the estimate of ``ds-packdpo train --dry-run``, the resident memory then (imports,
tokenizer, data, plan: the baseline), then the run itself -- engines and every step --
with its RSS sampled every 10 ms.  Prints the estimate, the peak above the baseline and
their ratio as JSON.  On CPU the RSS also holds what the allocator keeps and DeepSpeed's
CPU buffers; on a GPU the acceptance script compares with ``max_memory_allocated``.
"""

from __future__ import annotations

import json
import sys

import psutil

from ds_packdpo.config import parse_train_args
from ds_packdpo.run.assemble import prepare, start
from ds_packdpo.run.memory_estimate import estimate_memory
from ds_packdpo.run.process_group import close_process_group
from ds_packdpo.run.timing import PeakMemory
from ds_packdpo.run.trainer import train_loop


def main(argv: list[str]) -> dict:
    setup = prepare(parse_train_args(argv), "train")
    estimate = estimate_memory(setup)
    baseline = psutil.Process().memory_info().rss
    with PeakMemory(setup.spec.device_type) as peak:
        train_loop(start(setup), {})
    close_process_group()
    measured = peak.peak_bytes - baseline if setup.spec.device_type == "cpu" else peak.peak_bytes
    return {"estimate_mib": estimate["total"] / 2**20, "measured_mib": measured / 2**20,
            "estimate_over_measured": estimate["total"] / measured, "baseline_rss_mib": baseline / 2**20,
            "parts_mib": {"model_states": estimate["model_states"] / 2**20,
                          "reference": estimate["reference_weights"] / 2**20,
                          "activations": {k: v / 2**20 for k, v in estimate["activations"].items()},
                          "logps_chunk": estimate["logps_chunk"] / 2**20},
            "gradient_checkpointing": setup.spec.model.gradient_checkpointing, "row_tokens": estimate["row_tokens"],
            "parameters": estimate["parameters"]}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:]), indent=1))
