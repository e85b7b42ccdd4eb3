"""Sections of a run's settings from flags, as run/assemble.py resolves them, for the tests that need a few of them
without a whole phase one (no data, no model): the CPU's precision, the flags' own row layout."""

from __future__ import annotations

from ds_packdpo.config import resolve_dtype
from ds_packdpo.run import assemble
from ds_packdpo.run.checkpoint import ResumePoint, check_resume, plan_fingerprint
from ds_packdpo.run.engines import fill_ds_config
from ds_packdpo.run.layout import ParallelLayout
from ds_packdpo.run.schedule import Schedule

ONE_RANK = ParallelLayout(world_size=1)


def fingerprint(flags, data_fingerprint: str, layout: ParallelLayout = ONE_RANK) -> str:
    """The plan fingerprint of a run with these flags over data of ``data_fingerprint``."""
    return plan_fingerprint(flags.plan_spec(layout, flags.row_layout).config, flags.eval_fraction, data_fingerprint)


def resume(flags, data_fingerprint: str, layout: ParallelLayout = ONE_RANK) -> ResumePoint | None:
    """Phase one's resume point of a run with these flags."""
    return check_resume(assemble.checkpoint_spec(flags), fingerprint(flags, data_fingerprint, layout), layout,
                        assemble.model_spec(flags, resolve_dtype(flags.dtype, "cpu"), "cpu"),
                        assemble.ref_sync(flags))


def schedule(flags, total_steps: int) -> Schedule:
    """The LR schedule of a run of these flags over ``total_steps`` steps."""
    return assemble.schedule_spec(flags).over(flags.lr, total_steps)


def ds_config(flags, raw: dict, source: str, dp_size: int, total_steps: int, hidden_size: int = 64) -> dict:
    """The filled DeepSpeed config of a CPU run of these flags (the DeepSpeed config's values taken already) on
    ``dp_size`` data-parallel ranks."""
    sp = flags.sequence_parallel_size
    return fill_ds_config(raw, source, assemble.optimizer_spec(flags), resolve_dtype(flags.dtype, "cpu"),
                          assemble.output_spec(flags), ParallelLayout(world_size=dp_size * sp, sp_size=sp),
                          hidden_size, "cpu", schedule(flags, total_steps), assemble.zero_spec(flags))
