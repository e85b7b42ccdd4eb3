"""Rows with one prompt and several scored or ranked responses (data/multi_response.py).

Each layout is read into the same pairs, each --pairs-from rule gives exactly the pairs
written out by hand (ties dropped and counted), the pairs tokenize exactly as the same
pairs written as ordinary rows, bad rows are refused in one line naming file, row and
key, and the real multi_response_demo.jsonl gives the counts its README states and
plans through train's phase one.
"""

from __future__ import annotations

import json
from collections import Counter
from itertools import combinations
from pathlib import Path

import numpy as np
import pytest
from conftest import write_rows
from test_bad_input import assert_one_line_error

from ds_packdpo import cli
from ds_packdpo.config import parse_train_args
from ds_packdpo.console import SAID_ENV
from ds_packdpo.data.heldout import split_by_content, split_warning
from ds_packdpo.data.multi_response import pair_indices
from ds_packdpo.data.prepare import DataConfig, prepare_pairs
from ds_packdpo.data.run_plan import run_plan
from ds_packdpo.data.synthetic import synthetic_multi_response_rows
from ds_packdpo.errors import InputError
from ds_packdpo.run.assemble import prepare

MULTI_DEMO_PATH = Path(__file__).resolve().parents[2] / "shared/data/multi_response_demo.jsonl"

# One group with ties at the top (b, d) and in the middle (a, e); index order a b c d e.
TEXTS = ["answer a", "answer b", "answer c", "answer d", "answer e"]
SCORES = [3.0, 5.0, 1.0, 5.0, 3.0]
RANKS = [2, 1, 3, 1, 2]  # the same order as SCORES, as ranks (1 = best)
EXPECTED = {  # (chosen, rejected) indices, ties dropped
    "best-vs-worst": ([(1, 2)], 0),
    "best-vs-rest": ([(1, 0), (1, 2), (1, 4)], 1),  # b against d is a tie
    "all": ([(1, 0), (0, 2), (3, 0), (1, 2), (1, 4), (3, 2), (4, 2), (3, 4)], 2),  # a-e and b-d tie
}


@pytest.mark.parametrize("rule", list(EXPECTED))
def test_each_rule_gives_exactly_its_pairs_and_counts_ties(rule):
    assert pair_indices(SCORES, rule) == EXPECTED[rule]
    all_tied = {"best-vs-worst": 1, "best-vs-rest": 2, "all": 3}[rule]
    assert pair_indices([2.0, 2.0, 2.0], rule) == ([], all_tied)


def _prompt(conversational: bool, text: str = "the question"):
    return [{"role": "user", "content": text}] if conversational else text


def _response(conversational: bool, text: str):
    return [{"role": "assistant", "content": text}] if conversational else text


LAYOUTS = ("completions overall_score", "completions score", "completions rank", "answers rank", "scored",
           "scored int", "ranked ranks")


def in_layout(name: str, prompt, responses: list, scores: list[float]) -> dict:
    """One group as a row of layout ``name`` (ranks: 1 for the best score, equal scores equal ranks)."""
    ranks = [sorted(set(scores), reverse=True).index(s) + 1 for s in scores]
    if name.startswith("completions"):
        key = name.split()[1]
        values = ranks if key == "rank" else scores
        return {"prompt": prompt, "completions": [{"model": f"m{j}", "response": r, key: v}
                                                  for j, (r, v) in enumerate(zip(responses, values))]}
    if name == "answers rank":  # Nectar's layout, its ranks as floats
        return {"prompt": prompt, "answers": [{"answer": r, "model": f"m{j}", "rank": float(v)}
                                              for j, (r, v) in enumerate(zip(responses, ranks))], "turns": 1}
    if name == "ranked ranks":
        return {"prompt": prompt, "responses": responses, "ranks": ranks}
    return {"prompt": prompt, "responses": responses,
            "scores": [int(s) for s in scores] if name == "scored int" else scores}


def _pair_rows(prompt, responses, pairs) -> list[dict]:
    return [{"prompt": prompt, "chosen": responses[c], "rejected": responses[r]} for c, r in pairs]


def _ids(prepared) -> list[tuple]:
    columns = prepared.dataset.select_columns(["prompt_ids", "chosen_ids", "rejected_ids"]).to_list()
    return [(c["prompt_ids"], c["chosen_ids"], c["rejected_ids"]) for c in columns]


@pytest.mark.parametrize("conversational", [True, False], ids=["conversational", "plain"])
def test_every_layout_tokenizes_as_the_same_pairs_written_as_ordinary_rows(conversational, demo_tokenizer, cache_dir):
    """Per layout and rule: the pairs' ids are those of the expected pairs given as standard/conversational rows; the
    second group's pair follows the first group's, numbered on."""
    responses = [_response(conversational, t) for t in TEXTS]
    other = (_prompt(conversational, "second question"), [_response(conversational, t) for t in ("low", "high")],
             [1.0, 2.0])
    for rule, (pairs, ties) in EXPECTED.items():
        ordinary = _pair_rows(_prompt(conversational), responses, pairs) + _pair_rows(*other[:2], [(1, 0)])
        want = _ids(prepare_pairs(DataConfig("pairs", cache_dir=cache_dir), demo_tokenizer, rows=ordinary))
        for name in LAYOUTS:
            # responses as plain strings (conversational: the reader makes them assistant messages) for the first
            # group, as the pairs hold them (message lists) for the second
            rows = [in_layout(name, _prompt(conversational), TEXTS, SCORES), in_layout(name, *other)]
            prepared = prepare_pairs(DataConfig("groups", pairs_from=rule, cache_dir=cache_dir), demo_tokenizer,
                                     rows=rows)
            assert _ids(prepared) == want, (name, rule)
            assert prepared.summary["format"] == name.split()[0].replace("answers", "completions")
            assert prepared.dataset["pair_id"] == list(range(len(want)))
            groups = prepared.summary["multi_response"]
            assert (groups["groups"], groups["pairs_made"], groups["ties_dropped"]) == (2, len(want), ties), name
            assert groups["responses_per_group"] == {"mean": 3.5, "min": 2, "max": 5}


def test_ranked_by_order_makes_the_best_first(demo_tokenizer, cache_dir):
    """--format ranked without ranks: responses best first, so 'all' is every two responses, earlier one chosen."""
    rows = [{"prompt": "q", "responses": TEXTS}]
    prepared = prepare_pairs(DataConfig("ranked", format="ranked", pairs_from="all", cache_dir=cache_dir),
                             demo_tokenizer, rows=rows)
    want = prepare_pairs(DataConfig("pairs", cache_dir=cache_dir), demo_tokenizer,
                         rows=_pair_rows("q", TEXTS, list(combinations(range(5), 2))))
    assert _ids(prepared) == _ids(want)
    assert prepared.summary["multi_response"]["ties_dropped"] == 0
    worst = prepare_pairs(DataConfig("ranked", format="ranked", cache_dir=cache_dir), demo_tokenizer, rows=rows)
    assert _ids(worst) == _ids(want)[3:4]  # best-vs-worst: a against e
    first = prepare_pairs(DataConfig("ranked", format="ranked", pairs_from="all", max_pairs=3, cache_dir=cache_dir),
                          demo_tokenizer, rows=rows)
    assert _ids(first) == _ids(want)[:3] and first.summary["beyond_max_pairs"] == 7  # --max-pairs counts pairs
    with pytest.raises(InputError, match="pairs_from 'best-vs-all' is not one of best-vs-worst, best-vs-rest, all"):
        DataConfig("ranked", pairs_from="best-vs-all")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory, demo_tokenizer) -> Path:
    folder = tmp_path_factory.mktemp("tokenizer")
    demo_tokenizer.save_pretrained(folder)
    return folder


GOOD = {"prompt": "q", "responses": ["x", "y"], "scores": [1, 2]}
BAD_GROUPS = {  # name -> (row 1 of the file, the rest of the one-line message after "row 1: ")
    "scores too short": ({"prompt": "q", "responses": ["x", "y", "z"], "scores": [1, 2]},
                         "field 'scores' holds 2 values for 3 responses"),
    "score not a number": ({"prompt": "q", "responses": ["x", "y"], "scores": [1, "high"]},
                           "scores[1] must be a finite number, got a string"),
    "score a boolean": ({"prompt": "q", "responses": ["x", "y"], "scores": [True, 2]},
                        "scores[0] must be a finite number, got a boolean"),
    "score NaN": ({"prompt": "q", "responses": ["x", "y"], "scores": [float("nan"), 2]},
                  "scores[0] must be a finite number, got nan"),
    "one response": ({"prompt": "q", "responses": ["x"], "scores": [1]},
                     "field 'responses' holds 1 response(s); a group needs 2 or more"),
    "empty response": ({"prompt": "q", "responses": ["x", " "], "scores": [1, 2]}, "responses[1] is an empty response"),
    "response a list in plain data": ({"prompt": "q", "responses": ["x", ["y"]], "scores": [1, 2]},
                                      "responses[1] must be a string, got a list"),
    "responses not a list": ({"prompt": "q", "responses": "x", "scores": [1]},
                             "field 'responses' must be a list, got a string"),
    "prompt of another kind": ({"prompt": [{"role": "user", "content": "q"}], "responses": ["x", "y"],
                                "scores": [1, 2]}, "field 'prompt' must be a string (as the first row's), got a list"),
    "scores missing": ({"prompt": "q", "responses": ["x", "y"]}, "field 'scores' is missing"),
}


@pytest.mark.parametrize("case", list(BAD_GROUPS), ids=list(BAD_GROUPS))
def test_bad_group_is_refused_in_one_line(case, tmp_path, tokenizer_dir, capsys):
    bad, expected = BAD_GROUPS[case]
    path = write_rows([GOOD, bad, GOOD], tmp_path, "jsonl")
    code = cli.main(["prepare", "--dataset", str(path), "--tokenizer", str(tokenizer_dir),
                     "--cache-dir", str(tmp_path / "cache")])
    assert_one_line_error(code, capsys.readouterr().err, f"{path} row 1 (line 2): {expected}")


@pytest.mark.parametrize("rows, expected", [
    ([{"prompt": "q", "completions": [{"response": "x", "overall_score": 1}, {"response": "y"}]}],
     "row 0: completions[1].overall_score is missing or null (every completion of a row is scored by the key of "
     "its first: one of overall_score, score, rank)"),
    ([{"prompt": "q", "completions": [{"response": "x", "rank": 1}, {"text": "y", "rank": 2}]}],
     "row 0: completions[1].response is missing or null"),
    ([{"prompt": "q", "answers": [{"answer": "x", "rank": 1}, {"response": "y", "rank": 2}]}],
     "row 0: answers[1].answer is missing or null"),
    ([{"prompt": "q", "completions": [{"response": "x", "rank": 1}, "y"]}],
     "row 0: completions[1] must be an object with 'response' and a score, got a string"),
    ([{"prompt": "q", "responses": ["x", "y"]}],
     "column 'responses' has no 'scores' or 'ranks' beside it; pass --format ranked if each row's responses are "
     "ordered best first"),
    ([{"prompt": "q", "responses": ["x", "y"], "scores": [1, 1]}],
     "no pair: every response of every group ties with the one it is paired with under --pairs-from best-vs-worst "
     "(1 ties dropped)"),
], ids=["completion without its score", "completion without its response", "answer without its text", "completion not an object", "responses with no order", "only ties"])
def test_refusals_of_layout_and_ties(rows, expected, tmp_path, tokenizer_dir, capsys):
    path = write_rows(rows, tmp_path, "json")
    code = cli.main(["prepare", "--dataset", str(path), "--tokenizer", str(tokenizer_dir),
                     "--cache-dir", str(tmp_path / "cache")])
    assert_one_line_error(code, capsys.readouterr().err, f"{path}", expected)


def test_forced_format_names_the_columns_of_its_layout(demo_tokenizer, cache_dir):
    """--format completions reads Nectar's answers too; a format whose columns are absent names them."""
    rows = [in_layout("answers rank", "q", TEXTS, SCORES)]
    forced = prepare_pairs(DataConfig("nectar", format="completions", cache_dir=cache_dir), demo_tokenizer, rows=rows)
    detected = prepare_pairs(DataConfig("nectar", cache_dir=cache_dir), demo_tokenizer, rows=rows)
    assert _ids(forced) == _ids(detected) and len(_ids(forced)) == 1
    with pytest.raises(InputError, match=r"nectar: format 'scored' needs columns \['prompt', 'responses', 'scores'\], "
                                         r"missing \['responses', 'scores'\]"):
        prepare_pairs(DataConfig("nectar", format="scored", cache_dir=cache_dir), demo_tokenizer, rows=rows)
    with pytest.raises(InputError, match=r"format 'completions' needs columns \['prompt', 'completions'\]"):
        prepare_pairs(DataConfig("plain", format="completions", cache_dir=cache_dir), demo_tokenizer,
                      rows=[{"prompt": "q", "responses": TEXTS}])


def test_skip_mode_counts_bad_groups(demo_tokenizer, cache_dir):
    rows = [GOOD, BAD_GROUPS["one response"][0], BAD_GROUPS["score NaN"][0], GOOD]
    prepared = prepare_pairs(DataConfig("groups", on_bad_row="skip", cache_dir=cache_dir), demo_tokenizer, rows=rows)
    assert prepared.summary["dropped"] == {"bad_score": 1, "too_few_responses": 1}
    assert prepared.summary["multi_response"]["groups"] == 2 and prepared.summary["kept"] == 2


def _strict_pairs_by_hand(path: Path) -> dict[str, int]:
    """The demo file's pair counts per rule, straight from its scores."""
    counts = dict.fromkeys(EXPECTED, 0)
    for line in path.read_text().splitlines():
        scores = [c["overall_score"] for c in json.loads(line)["completions"]]
        best = scores.index(max(scores))
        counts["all"] += sum(a != b for a, b in combinations(scores, 2))
        counts["best-vs-rest"] += sum(s < scores[best] for s in scores)
        counts["best-vs-worst"] += max(scores) > min(scores)
    return counts


def test_multi_response_demo_counts_through_prepare(tmp_path, tokenizer_dir, capsys):
    """The README's 693 pairs with a strict score difference; each rule's pairs made, ties dropped, and the cache
    keyed by --pairs-from (the same cache folder gives each rule its own pairs)."""
    by_hand = _strict_pairs_by_hand(MULTI_DEMO_PATH)
    assert by_hand["all"] == 693
    for rule, ties in (("all", 960 - 693), ("best-vs-rest", 480 - by_hand["best-vs-rest"]),
                       ("best-vs-worst", 160 - by_hand["best-vs-worst"])):
        for _ in range(2):  # the second call is read from the cache
            code = cli.main(["prepare", "--dataset", str(MULTI_DEMO_PATH), "--tokenizer", str(tokenizer_dir),
                             "--cache-dir", str(tmp_path / "cache"), "--pairs-from", rule, "--max-length", "4096"])
            assert code == 0
            summary = json.loads(capsys.readouterr().out)
            groups = summary["multi_response"]
            assert (summary["format"], summary["rows"], summary["kept"], summary["dropped"]) == (
                "completions", 160, by_hand[rule], {})
            assert groups["pairs_made"] == by_hand[rule] and groups["ties_dropped"] == ties, rule
            assert groups["groups"] == 160 and groups["responses_per_group"] == {"mean": 4.0, "min": 4, "max": 4}
            assert groups["pairs_from"] == rule and groups["tokens_saved"].startswith("see pack-stats")


def test_phase_one_plans_every_pair_of_the_demo_once(tmp_path, tokenizer_dir):
    """train's phase one on the demo with --pairs-from all on 2 ranks: 693 pairs, each planned exactly once, both its
    responses computed by the rows."""

    setup = prepare(parse_train_args(["--dataset", str(MULTI_DEMO_PATH), "--pairs-from", "all", "--tokenizer",
                                      str(tokenizer_dir), "--cache-dir", str(tmp_path / "cache"), "--output-dir",
                                      str(tmp_path / "out"), "--max-length", "512", "--global-batch-pairs", "64"]),
                    world_size=2)
    assert len(setup.prepared.chosen_lengths) == 693
    assert setup.prepared.summary["multi_response"]["pairs_made"] == 693
    steps = list(run_plan(setup.prepared, setup.spec.plan.config, 1))
    assert sorted(pair for step in steps for pair in step.pairs) == list(range(693))
    assert all((step.side_rows() >= 0).all() for step in steps)  # the rows compute both sides of every pair


def test_synthetic_multi_response_rows(demo_tokenizer, cache_dir):
    """2-8 responses per prompt (every size drawn), heavy-tailed lengths, scores 1-5 with ties; deterministic; the
    completions and scored layouts give the same pairs, and ranked ones prefer the higher score."""
    rows = synthetic_multi_response_rows(256, seed=3, layout="scored")
    assert rows == synthetic_multi_response_rows(256, seed=3, layout="scored")
    assert rows != synthetic_multi_response_rows(256, seed=4, layout="scored")
    sizes = [len(row["responses"]) for row in rows]
    assert set(sizes) == set(range(2, 9))
    words = np.array([len(r.split()) for row in rows for r in row["responses"]])
    assert np.percentile(words, 99) > 3 * np.median(words)
    assert {s for row in rows for s in row["scores"]} == {1.0, 2.0, 3.0, 4.0, 5.0}
    assert any(len(set(row["scores"])) < len(row["scores"]) for row in rows)
    few = dict(num_prompts=24, seed=1)
    prepared = {layout: prepare_pairs(DataConfig(layout, pairs_from="all", cache_dir=cache_dir), demo_tokenizer,
                                      rows=synthetic_multi_response_rows(**few, layout=layout))
                for layout in ("completions", "scored")}
    assert _ids(prepared["completions"]) == _ids(prepared["scored"])
    assert prepared["scored"].summary["multi_response"]["ties_dropped"] > 0
    plain = synthetic_multi_response_rows(**few, layout="ranked", conversational=False)
    scored = synthetic_multi_response_rows(**few, layout="scored", conversational=False)
    for ranked_row, scored_row in zip(plain, scored):
        order = sorted(range(len(scored_row["scores"])), key=lambda j: -scored_row["scores"][j])
        assert ranked_row["responses"] == [scored_row["responses"][j] for j in order]


def test_eval_fraction_holds_out_whole_groups(tmp_path, demo_tokenizer):
    """--eval-fraction on pairs made from groups: every prompt's pairs fall on one side (none of a held-out group's
    responses trains in another pair), about the fraction of the groups is held out."""
    prepared = prepare_pairs(DataConfig(str(MULTI_DEMO_PATH), pairs_from="all", max_length=4096,
                                        cache_dir=str(tmp_path / "cache")), demo_tokenizer)
    train, held_out = split_by_content(prepared, 0.25)
    prompts = [{tuple(ids) for ids in part.dataset["prompt_ids"]} for part in (train, held_out)]
    assert not prompts[0] & prompts[1]
    assert len(prompts[0]) + len(prompts[1]) == 152  # the groups with a pair
    assert 0.15 < len(prompts[1]) / 152 < 0.35


def test_eval_fraction_says_when_truncation_merged_prompts_of_several_rows(tmp_path, tokenizer_dir, capsys,
                                                                          monkeypatch):
    """A prompt keeps its end and gives way to the longest completion: --max-length 512 cuts most of the demo's
    prompts to the same chat-template tail, so rows' groups merge and --eval-fraction 0.1, which holds out each
    prompt's pairs together, held out more than half the pairs, silently.  Phase one now says it in one warning
    line, with the counts taken here from the two parts; without truncation the split is within its noise and
    nothing is said."""
    monkeypatch.delenv(SAID_ENV, raising=False)

    def phase_one(max_length: str):
        setup = prepare(parse_train_args(["--dataset", str(MULTI_DEMO_PATH), "--pairs-from", "all", "--tokenizer",
                                          str(tokenizer_dir), "--cache-dir", str(tmp_path / "cache"), "--output-dir",
                                          str(tmp_path / "out"), "--max-length", max_length, "--eval-fraction", "0.1",
                                          "--global-batch-pairs", "16"]), world_size=2)
        parts = [part.dataset["prompt_ids"] for part in (setup.prepared, setup.held_out.pairs)]
        lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: --eval-fraction")]
        return parts, lines, setup.prepared.summary

    (train, held), lines, summary = phase_one("512")
    total = len(train) + len(held)
    prompts = Counter(tuple(ids) for part in (train, held) for ids in part)
    assert len(held) / total > 0.5 and max(prompts.values()) > 6  # one row of 4 responses makes at most 6 pairs
    assert lines == [f"warning: --eval-fraction 0.1 held out {len(held)} of {total} pairs ({len(held) / total:.0%}, "
                     f"10% asked) of {MULTI_DEMO_PATH}: it holds out each prompt's pairs together, and after "
                     f"truncation ({summary['prompt_truncated']} of {total} prompts cut) the prompts of the 152 rows "
                     f"with pairs are {len(prompts)} distinct prompts, the largest shared by {max(prompts.values())} "
                     f"pairs (one row makes at most 6); a longer --max-length (and --max-prompt-length, if set) keeps "
                     f"more of each prompt, and them apart"]
    (train, held), lines, summary = phase_one("4096")
    assert lines == [] and 0.05 < len(held) / (len(train) + len(held)) < 0.25


def test_eval_fraction_within_its_noise_says_nothing_and_far_from_it_says_why():
    """Ordinary pairs are placed one by one, so a split within 3 standard deviations of the asked fraction says
    nothing; one far from it (here 70 copies of one pair among 100) says the asked and actual shares."""
    summary = {"dataset": "d.json", "prompt_truncated": 0}
    spread = np.linspace(0, 1, 100, endpoint=False)  # 10 of 100 below 0.1: as asked
    assert split_warning(summary, 0.1, 10, spread) is None
    assert split_warning(summary, 0.1, 17, spread) is None  # 7 over: within 3 x sqrt(0.1 x 0.9 x 100) = 9
    copies = np.concatenate([np.full(70, 0.05), spread[70:]])
    assert split_warning(summary, 0.1, 70, copies) == (
        "--eval-fraction 0.1 held out 70 of 100 pairs (70%, 10% asked) of d.json: it holds out "
        "identical pairs together (31 distinct pairs)")
