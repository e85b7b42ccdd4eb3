"""One bench rank with a fault injected through ``bench.BEFORE_ROUND`` (a test-only hook; the package never installs
one): ``BENCH_FAULT=CONFIGURATION:ROUND:RANK`` makes that rank raise a CUDA error as that configuration's round
starts, as a kernel fault on a GPU would; under ``CUDA_LAUNCH_BLOCKING=1`` the error names the kernel, as the
synchronous launch would.

    python tests/rank_launcher.py --num_gpus 2 --master_port P tests/bench_fault_rank.py BENCH_FLAGS...
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds_packdpo import bench  # noqa: E402
from ds_packdpo.run.process_group import exit_rank  # noqa: E402

KERNEL = "fused_attention_kernel"


def illegal_access(name: str, number: int) -> None:
    configuration, round_number, rank = os.environ["BENCH_FAULT"].split(":")
    if (name, number, os.environ.get("RANK")) == (configuration, int(round_number), rank):
        blocking = os.environ.get("CUDA_LAUNCH_BLOCKING") == "1"
        raise RuntimeError(f"CUDA error: an illegal memory access was encountered{f' in {KERNEL}' if blocking else ''}"
                           "\nCUDA kernel errors might be asynchronously reported at some other API call")


if __name__ == "__main__":
    bench.BEFORE_ROUND.append(illegal_access)
    exit_rank(bench.main())
