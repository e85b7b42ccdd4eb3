"""Entry point of one training rank: ``deepspeed ... --module ds_packdpo.train <flags>``."""

from __future__ import annotations

from .config import parse_train_args
from .errors import run_guarded
from .run.process_group import exit_rank
from .run.trainer import train


def main(argv: list[str] | None = None) -> int:
    def job() -> int:
        train(parse_train_args(argv, prog="ds_packdpo.train"))
        return 0

    return run_guarded(job)


if __name__ == "__main__":
    exit_rank(main())
