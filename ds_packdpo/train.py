"""Entry point of one training rank: ``deepspeed ... --module ds_packdpo.train <flags>``."""

from __future__ import annotations

from .config import parse_train_args
from .errors import run_guarded
from .run import stop
from .run.process_group import exit_rank
from .run.trainer import train


def main(argv: list[str] | None = None) -> int:
    stop.install()  # SIGTERM/SIGINT: stop at the next step boundary, saved (run/stop.py)

    def job() -> int:
        train(parse_train_args(argv, prog="ds_packdpo.train"))
        return 0

    return run_guarded(job)


if __name__ == "__main__":
    exit_rank(main())
