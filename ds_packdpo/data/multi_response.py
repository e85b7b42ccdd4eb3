"""Rows with one prompt and several scored or ranked responses, turned into ordinary preference pairs.

Preference data often holds a group of responses per prompt (UltraFeedback rates 4,
Nectar ranks 7, on-policy sampling scores 4-16).  Three layouts are read, each with a
plain (string) or conversational (message list) prompt:

* ``completions``: ``completions`` is a list of objects, each with the ``response``
  and a score (``overall_score`` as UltraFeedback, or ``score``) or a ``rank``; or,
  as Nectar, ``answers``, each with the ``answer`` and its ``rank``;
* ``scored``: ``responses`` (a list) and ``scores`` (one number per response);
* ``ranked``: ``responses`` ordered best first, or with ``ranks`` (one per response).

Every layout becomes (prompt, responses, scores) with higher scores better (a rank r
scores -r), and ``--pairs-from`` makes pairs from the scores: ``best-vs-worst`` (one
pair, the binarised default), ``best-vs-rest`` (the best against each other response)
or ``all`` (every two responses).  A candidate pair whose two scores are equal is a tie:
dropped and counted.  The pairs then train as ordinary pairs (grouped rows that compute
each prompt and response once come later).  No torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import combinations

import numpy as np

from ..errors import InputError
from .raw_rows import ColumnScan
from .rows import BadRow, completion_messages, field_value, kind_of, message_list

MULTI_RESPONSE_FORMATS = ("completions", "scored", "ranked")
PAIRS_FROM = ("best-vs-worst", "best-vs-rest", "all")
RESPONSES, SCORES, RANKS = "responses", "scores", "ranks"
# a column of completion objects -> their text key: UltraFeedback's, Nectar's
OBJECT_LISTS = {"completions": "response", "answers": "answer"}
SCORE_KEYS = ("overall_score", "score", "rank")  # per completion object; the first one a row's first object has
TOKENS_SAVED_NOTE = ("see pack-stats: with --prompt-groups (the default) rows hold each prompt group once; "
                     "prefix_shared_tokens - real_tokens are the tokens that saves over prefix sharing alone")


def _object_list(columns) -> str:
    """The column of completion objects among ``columns`` (``completions`` when there is none)."""
    return next((column for column in OBJECT_LISTS if column in columns), "completions")


def columns_for(prompt_column: str, fmt: str, columns=()) -> list[str]:
    """The columns ``fmt`` needs in a dataset of ``columns`` (``ranked`` may also have ``ranks``)."""
    needed = {"completions": [_object_list(columns)], "scored": [RESPONSES, SCORES], "ranked": [RESPONSES]}
    return [prompt_column, *needed[fmt]]


def detect_layout(columns: set[str], prompt_column: str, label: str) -> str | None:
    """The multi-response format these columns hold, or None; refuses responses with nothing to order them by."""
    if prompt_column not in columns:
        return None
    if any(column in columns for column in OBJECT_LISTS):
        return "completions"
    if RESPONSES in columns:
        if SCORES in columns:
            return "scored"
        if RANKS in columns:
            return "ranked"
        raise InputError(f"{label}: column '{RESPONSES}' has no '{SCORES}' or '{RANKS}' beside it; pass --format "
                         "ranked if each row's responses are ordered best first")
    return None


@dataclass(frozen=True)
class Group:
    """One row read: its prompt, its responses (as the pairs will hold them) and their scores (higher is better)."""

    prompt: str | list[dict]
    responses: list
    scores: list[float]


def _number(value, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        shown = repr(value) if isinstance(value, float) else kind_of(value)
        raise BadRow("bad_score", f"{key} must be a finite number, got {shown}")
    return float(value)


def _list(row: dict, key: str) -> list:
    value = field_value(row, key)
    if not isinstance(value, list):
        raise BadRow("malformed_responses", f"field '{key}' must be a list, got {kind_of(value)}")
    return value


@dataclass(frozen=True)
class GroupLayout:
    """How the rows of one dataset hold their groups: the format, the prompt column, whether prompts are
    conversational (from the first row, as for pairs), for ``ranked`` whether a ``ranks`` column orders them, and for
    ``completions`` the column of completion objects."""

    fmt: str
    prompt_column: str
    conversational: bool
    has_ranks: bool
    object_list: str

    @classmethod
    def of(cls, fmt: str, prompt_column: str, scan: ColumnScan) -> GroupLayout:
        """The layout of the rows ``scan`` saw (their keys, each key's first non-null value)."""
        has_ranks = fmt == "ranked" and RANKS in scan.columns
        return cls(fmt, prompt_column, isinstance(scan.first.get(prompt_column), list), has_ranks,
                   _object_list(scan.columns))

    def _prompt(self, row: dict):
        key = self.prompt_column
        value = field_value(row, key)
        if self.conversational:
            return message_list(value, key)
        if not isinstance(value, str):
            detail = f"field '{key}' must be a string (as the first row's), got {kind_of(value)}"
            raise BadRow("non_string_field", detail)
        return value

    def _response(self, value, key: str):
        """A response as the pairs hold it: a string, or assistant messages when prompts are conversational."""
        if isinstance(value, str):
            if not value.strip():
                raise BadRow("empty_completion", f"{key} is an empty response")
            return [{"role": "assistant", "content": value}] if self.conversational else value
        if self.conversational and isinstance(value, list):
            return completion_messages(message_list(value, key), key)
        expected = "a string or a list of assistant messages" if self.conversational else "a string"
        raise BadRow("non_string_field", f"{key} must be {expected}, got {kind_of(value)}")

    def _scored_list(self, row: dict, key: str, count: int) -> list[float]:
        values = _list(row, key)
        if len(values) != count:
            raise BadRow("length_mismatch", f"field '{key}' holds {len(values)} values for {count} responses")
        return [_number(value, f"{key}[{j}]") for j, value in enumerate(values)]

    def _completions(self, row: dict) -> tuple[list, list[float]]:
        items, text_key = _list(row, self.object_list), OBJECT_LISTS[self.object_list]
        first = items[0] if items and isinstance(items[0], dict) else {}
        score_key = next((key for key in SCORE_KEYS if key in first), SCORE_KEYS[0])
        responses, scores = [], []
        for j, item in enumerate(items):
            where = f"{self.object_list}[{j}]"
            if not isinstance(item, dict):
                raise BadRow("malformed_responses", f"{where} must be an object with '{text_key}' and a score, "
                             f"got {kind_of(item)}")
            if item.get(text_key) is None:
                raise BadRow("missing_field", f"{where}.{text_key} is missing or null")
            if item.get(score_key) is None:
                raise BadRow("missing_field", f"{where}.{score_key} is missing or null (every completion of a row is "
                             f"scored by the key of its first: one of {', '.join(SCORE_KEYS)})")
            responses.append(self._response(item[text_key], f"{where}.{text_key}"))
            score = _number(item[score_key], f"{where}.{score_key}")
            scores.append(-score if score_key == "rank" else score)
        return responses, scores

    def read(self, row: dict) -> Group:
        """The row's group; raises BadRow naming the key."""
        prompt = self._prompt(row)
        if self.fmt == "completions":
            responses, scores = self._completions(row)
        else:
            values = _list(row, RESPONSES)
            responses = [self._response(value, f"{RESPONSES}[{j}]") for j, value in enumerate(values)]
            if self.fmt == "scored":
                scores = self._scored_list(row, SCORES, len(values))
            elif self.has_ranks:
                scores = [-rank for rank in self._scored_list(row, RANKS, len(values))]
            else:  # ordered best first
                scores = [-float(j) for j in range(len(values))]
        if len(responses) < 2:
            key = self.object_list if self.fmt == "completions" else RESPONSES
            detail = f"field '{key}' holds {len(responses)} response(s); a group needs 2 or more"
            raise BadRow("too_few_responses", detail)
        return Group(prompt, responses, scores)


def pair_indices(scores: list[float], rule: str) -> tuple[list[tuple[int, int]], int]:
    """(chosen, rejected) response indices of ``rule`` for one group, and the ties it dropped.

    The best and the worst are the first response of the highest and of the lowest score;
    ``all`` takes every two responses in their order, the higher-scored one chosen.
    """
    best, worst = int(np.argmax(scores)), int(np.argmin(scores))
    if rule == "best-vs-worst":
        candidates = [(best, worst)]
    elif rule == "best-vs-rest":
        candidates = [(best, j) for j in range(len(scores)) if j != best]
    else:
        candidates = [(i, j) if scores[i] > scores[j] else (j, i) for i, j in combinations(range(len(scores)), 2)]
    pairs = [(c, r) for c, r in candidates if scores[c] > scores[r]]
    return pairs, len(candidates) - len(pairs)


class GroupPairs:
    """Pairs made group by group as the rows stream in (ids numbered in order), and the summary of the groups once
    all are in; ``rule`` is one of PAIRS_FROM (DataConfig checks it)."""

    def __init__(self, rule: str):
        self.rule = rule
        self.made = self.ties = self.without_pairs = 0
        self.sizes: list[int] = []

    def pairs(self, group: Group) -> list[dict]:
        """The ordinary pairs (pair_id, prompt, chosen, rejected) of one group."""
        indices, tied = pair_indices(group.scores, self.rule)
        self.ties += tied
        self.without_pairs += not indices
        self.sizes.append(len(group.responses))
        pairs = [{"pair_id": self.made + n, "prompt": group.prompt, "chosen": group.responses[c],
                  "rejected": group.responses[r]} for n, (c, r) in enumerate(indices)]
        self.made += len(pairs)
        return pairs

    def summary(self, label: str) -> dict:
        if not self.made:
            raise InputError(f"{label}: no pair: every response of every group ties with the one it is paired with "
                             f"under --pairs-from {self.rule} ({self.ties} ties dropped)")
        sizes = np.asarray(self.sizes)
        return {
            "pairs_from": self.rule,
            "groups": len(self.sizes),
            "responses_per_group": {"mean": round(float(sizes.mean()), 2), "min": int(sizes.min()),
                                    "max": int(sizes.max())},
            "pairs_made": self.made,
            "ties_dropped": self.ties,
            "groups_without_pairs": self.without_pairs,
            "tokens_saved": TOKENS_SAVED_NOTE,
        }
