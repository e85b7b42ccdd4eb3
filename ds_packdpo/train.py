"""Entry point of one training rank: ``deepspeed ... --module ds_packdpo.train <flags>``."""

from __future__ import annotations

import sys

from .errors import run_guarded
from .config import parse_train_args


def main(argv: list[str] | None = None) -> int:
    def job() -> int:
        from .run.trainer import train

        train(parse_train_args(argv, prog="ds_packdpo.train"))
        return 0

    return run_guarded(job)


if __name__ == "__main__":
    sys.exit(main())
