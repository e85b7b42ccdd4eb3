"""Entry point of one training rank: ``deepspeed ... --module ds_packdpo.train <flags>``."""

from __future__ import annotations

from deepspeed.accelerator import get_accelerator

from .config import parse_train_args
from .errors import run_guarded
from .run.assemble import prepare, start
from .run.cpu_memory import steady_allocator
from .run.process_group import close_process_group, exit_rank
from .run.trainer import describe_plan, export_on_end, plan_summary, train_loop


def train(flags) -> list[dict]:
    """The whole job on this rank, from its flags.  Rank 0 prints the plan summary first, before the process group
    and the engines start."""
    setup = prepare(flags, "train")
    rank = setup.spec.layout.rank
    summary = plan_summary(setup) if rank == 0 else {}
    if summary:
        print(describe_plan(summary), flush=True)
    history = train_loop(start(setup), summary)
    close_process_group()
    if setup.spec.checkpoint.export_on_end and rank == 0:
        export_on_end(setup)
    return history


def main(argv: list[str] | None = None) -> int:
    def job() -> int:
        if get_accelerator().device_name() == "cpu":
            steady_allocator()  # a step's memory kept, not faulted in again each step (run/cpu_memory.py)
        train(parse_train_args(argv, prog="ds_packdpo.train"))
        return 0

    return run_guarded(job)


if __name__ == "__main__":
    exit_rank(main())
