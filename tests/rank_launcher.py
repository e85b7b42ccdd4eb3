"""Starts the ranks of a one-node job as ``deepspeed --num_gpus N`` does, without DeepSpeed's launcher processes.

Why by hand: the deepspeed launcher is two Python processes that import DeepSpeed (its runner, then launch.py)
before the first rank starts, ~9 s of every launch here and minutes of the suite.  The tests that check numbers
across layouts need ranks, not the launcher: they get the environment launch.py gives each rank (MASTER_ADDR,
MASTER_PORT, WORLD_SIZE, RANK, LOCAL_RANK, LOCAL_SIZE, CROSS_RANK, CROSS_SIZE, CUDA_VISIBLE_DEVICES) and its
``--local_rank=N`` argument, and the CPU threads ``ds-packdpo train`` gives each rank (OMP_NUM_THREADS).  The launcher itself is tested where it is the subject: test_launchers.py (local.sh,
multinode.sh, mpirun.sh) and the two-node and ``ds-packdpo train --num-procs`` runs of test_checkpoint.py.

    python tests/rank_launcher.py --num_gpus N --master_port P (--module MODULE | SCRIPT) ARGS...

As launch.py does, a rank that fails ends the others, and the exit code is that rank's.
Standard library only, so that it starts in milliseconds.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num_gpus", type=int, required=True)
    parser.add_argument("--master_port", type=int, required=True)
    parser.add_argument("--module", action="store_true", help="the target is a module (python -m)")
    parser.add_argument("target")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # the ranks go with the launcher
    shared = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(args.master_port), "WORLD_SIZE": str(args.num_gpus),
              "CROSS_RANK": "0", "CROSS_SIZE": "1", "LOCAL_SIZE": str(args.num_gpus),
              "CUDA_VISIBLE_DEVICES": ",".join(map(str, range(args.num_gpus)))}
    # The CPU threads `ds-packdpo train` gives each rank (console.rank_environment): cores / ranks unless
    # OMP_NUM_THREADS is set.  torch's default of every core per rank oversubscribed the cores N times.
    threads = os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.num_gpus)))
    ranks = []
    for rank in range(args.num_gpus):
        command = [sys.executable, "-u", *(["-m"] if args.module else []), args.target, *args.args,
                   f"--local_rank={rank}"]
        env = {**os.environ, **shared, "OMP_NUM_THREADS": threads, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        ranks.append(subprocess.Popen(command, env=env))
    try:
        while True:
            codes = [rank.poll() for rank in ranks]
            failed = [code for code in codes if code]
            if failed or all(code == 0 for code in codes):
                return failed[0] if failed else 0
            time.sleep(0.2)
    finally:
        for rank in ranks:  # a rank that waits for a dead peer must not outlive the job
            if rank.poll() is None:
                rank.kill()
                rank.wait()


if __name__ == "__main__":
    sys.exit(main())
