"""One rank of ``ds-packdpo eval``: a trained (or exported) policy evaluated alone, with no training.

``deepspeed ... --module ds_packdpo.evaluate --model TRAINED --ref-model BASE --dataset D
[training flags]`` evaluates the pairs of D (or its ``--eval-fraction`` held-out part, the
same pairs a training run with that flag held out, or ``--eval-dataset``) exactly as
training evaluates them: planned on the ranks by the training planner, packed, under
ZeRO-3 and sequence parallelism when asked, the policy and the reference forward only.
Rank 0 prints the ``eval_*`` figures as one JSON object.
"""

from __future__ import annotations

from .command_settings import NOT_ACTED_ON, refused_epilog
from .config import parse_train_args, train_parser
from .run.assemble import prepare, start
from .run.evaluation import evaluate
from .run.process_group import exit_rank, run_rank_job


DESCRIPTION = ("A trained (or exported) policy evaluated against its reference, with no training: the eval_* figures "
               "of --dataset (its --eval-fraction part, or --eval-dataset) as one JSON object. Takes the training "
               "flags.")


def eval_parser(prog: str = "ds-packdpo eval"):
    return train_parser(prog, description=DESCRIPTION, epilog=refused_epilog("eval"))


def parse_eval_args(argv: list[str] | None, prog: str = "ds-packdpo eval"):
    """eval's settings: the training flags less those eval does not act on (refused typed, set aside from a recipe)."""
    return parse_train_args(argv, prog, aside=NOT_ACTED_ON["eval"], description=DESCRIPTION,
                            epilog=refused_epilog("eval"))


def evaluate_model(flags) -> dict | None:
    """The whole job on this rank; rank 0 returns the figures (other ranks: None)."""
    run = start(prepare(flags, "eval"))
    figures = evaluate(run, progress=True)
    run.close()
    return figures if run.setup.spec.layout.rank == 0 else None


def main(argv: list[str] | None = None) -> int:
    return run_rank_job(lambda: evaluate_model(parse_eval_args(argv, prog="ds_packdpo.evaluate")))


if __name__ == "__main__":
    exit_rank(main())
