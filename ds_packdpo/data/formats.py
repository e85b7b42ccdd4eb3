"""What a preference row is in each format, and every row checked before any tokenization.

The format comes from the columns (or is forced); each row becomes ``{"prompt", "chosen", "rejected"}`` (strings,
or ``[{role, content}]`` lists) or, for rows of several responses, the pairs its group makes
(``data/multi_response.py``); a bad row is a :class:`~ds_packdpo.data.rows.BadRow` naming every faulty field, and
all of a file's are counted in one pass (the first few named in one error, or skipped with ``--on-bad-row skip``).
Plain Python over rows: ``data/prepare.py`` runs it first, so that bad input stops before tokenization.  ``cfg``
below is that module's ``DataConfig`` (its column names, format, ``on_bad_row``, ``pairs_from``), not imported
here: data/prepare.py imports this module.
"""

from __future__ import annotations

from collections import Counter

from ..errors import InputError
from .multi_response import MULTI_RESPONSE_FORMATS, GroupLayout, GroupPairs, columns_for, detect_layout
from .normalized import NormalizedPairs
from .raw_rows import ColumnScan, RawRows
from .rows import BadRow, completion_messages, every_field, field_value, kind_of, message_list, text_value

FORMATS = ("auto", "standard", "conversational", "implicit", "sharegpt", *MULTI_RESPONSE_FORMATS)
BAD_ROWS_NAMED = 10  # the bad rows one error names (all are counted)
SHAREGPT_ROLES = {"system": "system", "human": "user", "gpt": "assistant"}
SHAREGPT_SPELLING = {chat: source for source, chat in SHAREGPT_ROLES.items()}  # errors name roles as the file does


def _columns_for(cfg, fmt: str, columns=()) -> list[str]:
    if fmt in MULTI_RESPONSE_FORMATS:
        return columns_for(cfg.prompt_column, fmt, columns)
    if fmt == "sharegpt":
        return [cfg.conversations_column, cfg.chosen_column, cfg.rejected_column]
    if fmt == "implicit":
        return [cfg.chosen_column, cfg.rejected_column]
    return [cfg.prompt_column, cfg.chosen_column, cfg.rejected_column]


def detect_format(cfg, scan: ColumnScan, label: str) -> str:
    columns = scan.columns
    if cfg.format != "auto":
        missing = [c for c in _columns_for(cfg, cfg.format, columns) if c not in columns]
        if missing:
            raise InputError(
                f"{label}: format '{cfg.format}' needs columns {_columns_for(cfg, cfg.format, columns)}, "
                f"missing {missing}; columns found {sorted(columns)}"
            )
        return cfg.format
    if {cfg.chosen_column, cfg.rejected_column} <= columns:
        if cfg.conversations_column in columns:
            return "sharegpt"
        if cfg.prompt_column in columns:
            return "conversational" if isinstance(scan.first.get(cfg.prompt_column), list) else "standard"
        if isinstance(scan.first.get(cfg.chosen_column), list):
            return "implicit"
    multi = detect_layout(columns, cfg.prompt_column, label)
    if multi is not None:
        return multi
    raise InputError(
        f"{label}: columns found {sorted(columns)}; expected {_columns_for(cfg, 'standard')} (standard or "
        f"conversational), {_columns_for(cfg, 'sharegpt')} (sharegpt), message lists {_columns_for(cfg, 'implicit')} "
        f"(implicit), or several responses per prompt {_columns_for(cfg, 'completions')} or "
        f"{_columns_for(cfg, 'scored')} (scored); set the column names or the format"
    )


def _split_implicit(chosen: list[dict], rejected: list[dict], cfg) -> tuple[list, list, list]:
    """Prompt = longest common message prefix, cut back to end before an assistant turn."""
    common = 0
    while common < min(len(chosen), len(rejected)) and chosen[common] == rejected[common]:
        common += 1
    while common > 0 and chosen[common - 1]["role"] == "assistant":
        common -= 1
    if common == 0:
        raise BadRow("no_common_prompt", "chosen and rejected share no leading non-assistant message: no prompt")
    return (
        chosen[:common],
        completion_messages(chosen[common:], cfg.chosen_column),
        completion_messages(rejected[common:], cfg.rejected_column),
    )


def _normalize_row(row, fmt: str, cfg) -> dict:
    """{"prompt", "chosen", "rejected"}: strings (standard) or [{role, content}] lists; raises BadRow naming every
    faulty field of the row."""
    c_key, r_key = cfg.chosen_column, cfg.rejected_column
    if fmt == "standard":
        return every_field({"prompt": lambda: text_value(row, cfg.prompt_column, completion=False),
                            "chosen": lambda: text_value(row, c_key, True),
                            "rejected": lambda: text_value(row, r_key, True)})
    if fmt == "conversational":
        def completion(key: str) -> list[dict]:
            return completion_messages(message_list(field_value(row, key), key), key)

        return every_field({"prompt": lambda: message_list(field_value(row, cfg.prompt_column), cfg.prompt_column),
                            "chosen": lambda: completion(c_key), "rejected": lambda: completion(r_key)})
    if fmt == "implicit":
        both = every_field({key: lambda key=key: message_list(field_value(row, key), key) for key in (c_key, r_key)})
        prompt, chosen, rejected = _split_implicit(both[c_key], both[r_key], cfg)
        return {"prompt": prompt, "chosen": chosen, "rejected": rejected}
    # sharegpt: chosen/rejected are one {from, value} message each
    sharegpt = dict(role_key="from", content_key="value", roles=SHAREGPT_ROLES)

    def one_message(key: str) -> list[dict]:
        value = field_value(row, key)
        if not isinstance(value, dict):
            raise BadRow("malformed_messages", f"field '{key}' must be one {{from, value}} message, got {kind_of(value)}")
        return completion_messages(message_list([value], key, **sharegpt), key, SHAREGPT_SPELLING)

    return every_field({"prompt": lambda: message_list(field_value(row, cfg.conversations_column),
                                                       cfg.conversations_column, **sharegpt),
                        "chosen": lambda: one_message(c_key), "rejected": lambda: one_message(r_key)})


def validate_rows(source: RawRows, cfg, out: NormalizedPairs) -> tuple[str, int, Counter, dict | None]:
    """Every row checked before any tokenization, the valid pairs written to ``out`` as they come (a first pass over
    the rows learns their columns, the second validates); returns (format, rows, bad-row counts, and for rows with
    several responses the summary of their groups).

    A pair row's pair_id is its row index; the pairs made from groups are numbered in order.
    """
    label = source.label
    scan = source.scan()
    if not scan.rows:
        raise InputError(f"{label}: the dataset has no rows")
    # With no object at all, every row fails on its own below, before the format matters.
    fmt = detect_format(cfg, scan, label) if scan.objects else cfg.format
    grouped = fmt in MULTI_RESPONSE_FORMATS
    groups = GroupPairs(cfg.pairs_from) if grouped else None
    layout = GroupLayout.of(fmt, cfg.prompt_column, scan) if grouped else None
    valid, bad, named = 0, Counter(), []
    for index, (where, value) in enumerate(source):
        try:
            if isinstance(value, BadRow):
                raise value
            if not isinstance(value, dict):
                raise BadRow("not_an_object", f"a row must be an object, got {kind_of(value)}")
            pairs = groups.pairs(layout.read(value)) if grouped else [
                {"pair_id": index, **_normalize_row(value, fmt, cfg)}]
        except BadRow as problem:
            bad[problem.reason] += 1
            if len(named) < BAD_ROWS_NAMED:
                named.append(f"{where}: {problem.detail}")
            continue
        valid += 1
        for pair in pairs:
            out.add(pair)
    if bad and cfg.on_bad_row == "error":  # every bad row of the file in one pass, the first few named
        total = sum(bad.values())
        if total == 1:
            raise InputError(f"{label} {named[0]}")
        more = f"; and {total - len(named)} more" if total > len(named) else ""
        raise InputError(f"{label}: {total} bad rows: {'; '.join(named)}{more} (fix them, or pass --on-bad-row "
                         f"skip to leave them out)")
    if not valid:
        raise InputError(f"{label}: no valid {'groups' if grouped else 'pairs'} (bad rows: {dict(bad)})")
    return fmt, scan.rows, bad, groups.summary(label) if grouped else None
