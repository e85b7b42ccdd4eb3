"""The default row budget (--max-tokens-per-row auto): one padded micro-batch's worth of tokens."""

from __future__ import annotations

import pytest

from ds_packdpo.config import TrainConfig, parse_train_args
from ds_packdpo.run.layout import ParallelLayout


def row_budget(flags) -> int:
    """One rank's row budget of a run of these flags (a row is one rank's here)."""
    return flags.plan_spec(ParallelLayout(world_size=1), flags.row_layout).row_budget


@pytest.mark.parametrize("max_length, micro_batch_pairs, expected", [
    (256, 4, 2048),  # 2 x 4 pairs x 256: a packed step never runs more forwards than the padded one
    (1024, 1, 2048),  # never below one pair at full length (2 x max-length)
    (2048, 2, 8192),
])
def test_auto_budget_is_a_padded_micro_batch(max_length, micro_batch_pairs, expected):
    cfg = TrainConfig(max_length=max_length, micro_batch_pairs=micro_batch_pairs)
    assert row_budget(cfg) == expected
    # a padded micro-batch computes 2 x pairs x longest <= 2 x pairs x max-length tokens: the auto row holds it
    assert row_budget(cfg) >= 2 * micro_batch_pairs * max_length >= 2 * max_length


def test_given_budget_wins_and_the_default_follows_the_flags():
    assert row_budget(TrainConfig(max_length=256, micro_batch_pairs=4, max_tokens_per_row=300)) == 300
    assert row_budget(parse_train_args(["--max-length", "256"])) == 2 * 4 * 256  # --micro-batch-pairs default 4
    assert row_budget(parse_train_args(["--max-length", "256", "--micro-batch-pairs", "1"])) == 512
