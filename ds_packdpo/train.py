"""Entry point of one training rank: ``deepspeed ... --module ds_packdpo.train <flags>``."""

from __future__ import annotations

from deepspeed.accelerator import get_accelerator

from .config import parse_train_args
from .errors import run_guarded
from .run.cpu_memory import steady_allocator
from .run.process_group import exit_rank
from .run.trainer import train


def main(argv: list[str] | None = None) -> int:
    def job() -> int:
        if get_accelerator().device_name() == "cpu":
            steady_allocator()  # a step's memory kept, not faulted in again each step (run/cpu_memory.py)
        train(parse_train_args(argv, prog="ds_packdpo.train"))
        return 0

    return run_guarded(job)


if __name__ == "__main__":
    exit_rank(main())
