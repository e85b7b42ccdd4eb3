"""The bench and its report: one real 2-rank bench launch checked for consistency, the report schema,
the merge of two bench folders, the plots, and the FLOP formula."""

from __future__ import annotations

import json
import os
import shutil
import statistics
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ds_packdpo import bench
from ds_packdpo import cli
from ds_packdpo.errors import InputError
from ds_packdpo.config import parse_train_args, to_dict
from ds_packdpo.data.plan import Row, RowLayout, StepPlan
from ds_packdpo.model.flops import FlopModel, ThroughputMeter, row_attention_sq, step_flops
from ds_packdpo.model.build import build_model, tiny_config
from ds_packdpo.model.lora import LoraSettings, add_adapters
from ds_packdpo.comparisons import GROUPS_OFF, short_headline
from ds_packdpo.report import (PLOTS, REPORT_SCHEMA, RUN_SCHEMA, build_report, check_report, merge_reports,
                               read_report, render_markdown, write_merged)
from ds_packdpo.report_plots import merged_figure, number_label, rank_load_figure, tokens_per_s_figure
from ds_packdpo.run.layout import ParallelLayout

from launching import ranks_module, run

DOCS = Path(__file__).resolve().parent.parent / "docs"


# ---- FLOP formula -------------------------------------------------------------------------------

def test_step_flops_formula_by_hand():
    model = FlopModel(matmul_params=1000, layers=2, attn_width=8, with_reference=True)
    # policy 6*N*T + 12*l*d*S, reference 2*N*T + 4*l*d*S
    assert step_flops(model, computed_tokens=10, attention_sq=50) == 6 * 1000 * 10 + 12 * 2 * 8 * 50 + 2 * 1000 * 10 + 4 * 2 * 8 * 50
    no_ref = FlopModel(matmul_params=1000, layers=2, attn_width=8, with_reference=False)
    assert step_flops(no_ref, 10, 50) == 6 * 1000 * 10 + 12 * 2 * 8 * 50


def test_attention_term_is_sum_of_squares_packed_and_rows_times_width_squared_padded():
    chosen, rejected = [3, 10, 4], [5, 2, 7]
    assert row_attention_sq((0, 2), chosen, rejected, RowLayout.PACKED) == 3**2 + 4**2 + 5**2 + 7**2
    assert row_attention_sq((0, 2), chosen, rejected, RowLayout.PADDED) == 4 * 7**2  # 4 rows padded to 7
    assert row_attention_sq((), chosen, rejected, RowLayout.PACKED) == 1  # the dummy row
    # prefix sharing: (P + C)^2 for prompt + chosen, R (P + R) for the rejected queries against prompt + rejected keys
    prompt = [2, 1, 3]
    assert row_attention_sq((0, 2), chosen, rejected, RowLayout.PREFIX_SHARED, prompt) == 3**2 + 3 * 5 + 4**2 + 4 * 7
    assert row_attention_sq((0, 2), chosen, rejected, RowLayout.PADDED, prompt) == 4 * 7**2


def test_throughput_figures_mfu_only_with_a_peak():
    model = FlopModel(matmul_params=1, layers=1, attn_width=1, with_reference=False)
    meter = ThroughputMeter(model, [1], [1], RowLayout.PACKED, world_size=2, peak_tflops=4.0)
    assert meter.figures(flops=8e12, seconds=2.0) == {"model_tflops_per_s": 4.0, "mfu": 0.5}
    meter.peak_tflops = None
    assert meter.figures(flops=8e12, seconds=2.0) == {"model_tflops_per_s": 4.0, "mfu": None}


def one_run_report(loss: str, model_flops: float, prepass_flops: float) -> dict:
    """A report of one measured configuration with these FLOPs (the other figures 1)."""
    run_ = {key: 1 for key in RUN_SCHEMA} | {
        "name": "packed", "attn": "sdpa_varlen", "overrides": {}, "step_time_s": {"median": 1.0, "p90": 1.0},
        "mfu": None, "steps": [], "model_flops": model_flops, "prepass_flops": prepass_flops, "rounds": [],
        "spread": 0.0}
    settings = {"dtype": "fp32", "loss": loss, "max_length": 64, "row_budget": 256, "global_batch_pairs": 8,
                "micro_batch_pairs": 2, "ds_config": "zero3", "bench_warmup_steps": 1, "max_steps": 2}
    environment = dict.fromkeys(("device_type", "device_name", "hostname", "torch_threads", "torch", "deepspeed",
                                 "transformers"), "x")
    model = dict.fromkeys(("architecture", "source", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                           "vocab_size"), 1)
    return build_report("cmd", {"world_size": 1, "dp_size": 1, "sp_size": 1}, "synthetic", model, environment,
                        settings, {"packed": run_})


def test_rank_real_tokens_count_pair_sides_where_groups_are_spread():
    """A step's rank_real_tokens add up to its real tokens when prompt groups are spread over ranks: a pair whose two
    sides lie on two ranks gives each its side (counted by pair, every rank holding a side would count both)."""
    from ds_packdpo.data.plan import PlanConfig, iter_plan
    from ds_packdpo.data.prompt_groups import PairGroups

    first, second = np.triu_indices(6, 1)  # every pair of 6 responses, 3 prompts for 4 ranks: a group is split
    group = np.repeat(np.arange(3), first.size)
    prompt = np.full(group.size, 30)
    response = np.random.default_rng(0).integers(20, 200, (3, 6))
    chosen, rejected = prompt + response[group, np.tile(first, 3)], prompt + response[group, np.tile(second, 3)]
    cfg = PlanConfig(max_tokens_per_row=4000, dp_size=4, global_batch_pairs=group.size, layout=RowLayout.PROMPT_GROUPS)
    plan = next(iter_plan(chosen, rejected, cfg, 1, prompt_lengths=prompt,
                          groups=PairGroups(group, group * 6 + np.tile(first, 3), group * 6 + np.tile(second, 3))))
    share = plan.side_rows() // plan.rows_per_rank
    assert (share[:, 0] != share[:, 1]).any()  # pairs across ranks
    per_rank = bench.rank_real_tokens(plan, (chosen, rejected))
    assert len(per_rank) == 4 and sum(per_rank) == int((chosen + rejected).sum())


def test_aot_pre_pass_flops_are_counted_apart_and_the_report_says_so():
    """--loss aot/aot_unpaired run one more policy forward per row, without gradients (the whole step's sort needs
    every log-prob first).  A step of one micro-batch would not repeat it, so it is not model FLOPs (nor MFU), like
    activation checkpointing's recomputation; the bench counts it apart and report.md says what MFU leaves out (it
    said nothing: a tiny-model aot bench's MFU left out 25% more FLOPs than it counted, unstated)."""
    assert parse_train_args(["--loss", "aot"]).loss_config().needs_policy_prepass
    assert parse_train_args(["--loss", "sigmoid,aot_unpaired"]).loss_config().needs_policy_prepass
    assert not parse_train_args(["--loss", "sft"]).loss_config().needs_policy_prepass  # a token count, no forward
    assert not parse_train_args([]).loss_config().needs_policy_prepass
    model = FlopModel(matmul_params=1000, layers=2, attn_width=8, with_reference=True)
    plan = StepPlan(0, 0, (0, 1), ((Row(pairs=(0, 1), tokens=14, computed_tokens=14),),))
    meter = ThroughputMeter(model, [3, 4], [2, 5], RowLayout.PACKED, world_size=1, peak_tflops=None, policy_prepass=True)
    # one policy forward of the step's computed tokens: 2 N T + 4 l d S, S = 3^2 + 4^2 + 2^2 + 5^2
    assert meter.prepass_flops(plan) == 2 * 1000 * 14 + 4 * 2 * 8 * (9 + 16 + 4 + 25)
    assert meter.step_flops(plan) == step_flops(model, 14, 54)  # the model FLOPs are unchanged
    meter.policy_prepass = False
    assert meter.prepass_flops(plan) == 0.0
    markdown = render_markdown(one_run_report("aot", model_flops=8e9, prepass_flops=2e9))
    assert "`--loss aot` runs a no-grad policy pre-pass" in markdown and "packed 25% on top of the model FLOPs" in markdown
    assert "loss `aot`" in markdown
    assert "pre-pass" not in render_markdown(one_run_report("sigmoid", model_flops=8e9, prepass_flops=0.0))


def test_the_report_names_the_settings_that_change_the_loss():
    """--use-weighting, --ld-alpha and --rpo-alpha change the loss (WPO one more reduction per chunk): report.md and a
    merged report said only '--loss sigmoid' of a bench run with them."""
    report = one_run_report("sigmoid", model_flops=8e9, prepass_flops=0.0)
    report["settings"].update(use_weighting=True, ld_alpha=0.5, rpo_alpha=0.0, loss_weights=None)
    assert "loss `sigmoid` with --ld-alpha 0.5, --use-weighting." in render_markdown(report)
    report["settings"].update(loss="sigmoid,sft", loss_weights="1,0.3", use_weighting=False, ld_alpha=None)
    assert "loss `sigmoid,sft` weighted 1,0.3." in render_markdown(report)


def test_a_schema_3_report_still_merges(tmp_path):
    """Reports compared across clusters outlive a schema change: schema 4 added only ``prepass_flops``, so a schema-3
    folder (docs/bench_prefix_report.json, benched before it) is read, its pre-pass FLOPs 0 for a loss without the
    pre-pass and unknown (null, said in report.md) for one with it; older schemas are refused in one line."""
    old = json.loads((DOCS / "bench_prefix_report.json").read_text())
    assert old["schema_version"] == 3 and "prepass_flops" not in old["runs"]["packed"]
    folder = tmp_path / "old"
    folder.mkdir()
    (folder / "report.json").write_text(json.dumps(old))
    assert {run["prepass_flops"] for run in read_report(folder)["runs"].values()} == {0.0}
    entries = merge_reports([str(folder)])["entries"]
    assert len(entries) == len(old["runs"]) and entries[0]["loss"] == f"`{old['settings']['loss']}`"
    old["settings"]["loss"] = "sigmoid,aot"
    upgraded = check_report(json.loads(json.dumps(old)), "old/report.json")
    assert {run["prepass_flops"] for run in upgraded["runs"].values()} == {None}
    assert "pre-pass whose FLOPs this schema-3 report did not record" in render_markdown(upgraded)
    with pytest.raises(InputError, match="schema_version 2 .this version reads 3 to 8"):
        check_report(json.loads((DOCS / "bench_report.json").read_text()), "docs/bench_report.json")


def test_prompt_groups_speedup_is_reported_and_read_from_older_folders():
    """The bench measured packed-no-prompt-groups but its report left the ratio to the reader (computed by hand for
    docs/packing.md).  It is now a report key with its token ideal, and a schema-3/4 folder that ran both
    configurations gets it from its runs; without that configuration it is null and report.md says nothing of it."""
    old = json.loads((DOCS / "bench_prefix_report.json").read_text())
    assert check_report(json.loads(json.dumps(old)), "old")["prompt_groups_speedup"] is None
    assert "prompt groups" not in render_markdown(check_report(json.loads(json.dumps(old)), "old"))
    ungrouped = dict(old["runs"]["packed-no-prefix-sharing"], name=GROUPS_OFF)
    old["runs"][GROUPS_OFF] = ungrouped
    upgraded = check_report(old, "old")
    packed = old["runs"]["packed"]
    assert upgraded["prompt_groups_speedup"] == pytest.approx(packed["pairs_per_s"] / ungrouped["pairs_per_s"])
    assert upgraded["prompt_groups_ideal_speedup"] == pytest.approx(ungrouped["computed_tokens"]
                                                                    / packed["computed_tokens"])
    assert upgraded["prompt_groups_speedup"] > 1
    assert (f"**prompt groups (packed / {GROUPS_OFF} pairs/s): {upgraded['prompt_groups_speedup']:.3g}x**, token "
            f"ideal {upgraded['prompt_groups_ideal_speedup']:.3g}x" in render_markdown(upgraded))
    fresh = build_report("cmd", {"world_size": 1, "dp_size": 1, "sp_size": 1}, old["dataset"], old["model"],
                         old["environment"], old["settings"], old["runs"])
    assert fresh["schema_version"] == 8 and fresh["prompt_groups_speedup"] == upgraded["prompt_groups_speedup"]
    assert upgraded["runs"]["packed"]["lockstep_utilization"] is None  # not recorded before schema 8
    assert upgraded["runs"]["packed"]["prompt_copy_tokens"] is None


def test_a_bench_that_dies_keeps_the_configurations_it_measured(tmp_path, monkeypatch, capsys):
    """A bench that ends early (its padded configuration out of memory, a CUDA fault: the first H200 bench lost all
    its figures so) leaves the report of the configurations it measured, naming the one it died in and those not
    measured, and that folder merges; the rank that failed says which configuration, round and error, in the line
    the front process reads (bench_front.py).  Ranks stood in for: phase one and each round's steps are patched."""
    old = check_report(json.loads((DOCS / "bench_prefix_report.json").read_text()), "old")
    measured = {name: dict(run, prepass_flops=0.0, lockstep_utilization=0.9, prompt_copy_tokens=0)
                for name, run in old["runs"].items()}
    names = [*measured, "padded"]
    layout = SimpleNamespace(rank=0, as_dict=lambda: {"world_size": 1, "dp_size": 1, "sp_size": 1})
    cfg = parse_train_args(["--dtype", "fp32"])
    spec = SimpleNamespace(layout=layout, device_type="cpu", settings=to_dict(cfg), model=SimpleNamespace(dtype="fp32"),
                           data=SimpleNamespace(tokenization=SimpleNamespace(dataset="synthetic")),
                           plan=cfg.plan_spec(ParallelLayout(world_size=1), cfg.row_layout),
                           outputs=SimpleNamespace(overwrite=cfg.overwrite))
    first = SimpleNamespace(spec=spec, vocab_size=old["model"]["vocab_size"])
    monkeypatch.setattr(bench, "check_configurations",
                        lambda cfg, settings: bench.BenchPlan(cfg, first, dict.fromkeys(names, "set-up")))
    monkeypatch.setattr(bench, "model_summary", lambda model, setup: old["model"])
    monkeypatch.setattr(bench, "environment", lambda device, threads: old["environment"])

    def measure(name, setup, warmup):
        if name not in measured:
            raise RuntimeError("CUDA error: out of memory")
        return bench.RoundResult(measured[name]["steps"], [0], "rss", [1], None)

    monkeypatch.setattr(bench, "measure_round", measure)
    monkeypatch.setattr(bench, "summarize", lambda name, setup, rounds, positions: measured[name])
    out = tmp_path / "bench"
    settings = bench.BenchSettings(out=str(out), configurations=names, bench_rounds=1)
    with pytest.raises(RuntimeError, match="out of memory"):
        bench.run_bench(cfg, settings, ["--configurations", ",".join(names)])
    printed = capsys.readouterr()
    assert "bench: measuring padded (round 1 of 1, configuration 3 of 3)" in printed.out
    assert "bench: padded failed in round 1 on rank 0: RuntimeError: CUDA error: out of memory [at " in printed.err
    report = read_report(out)
    assert list(report["runs"]) == list(measured) and report["unmeasured"] == ["padded"]
    assert report["prefix_sharing_speedup"] == pytest.approx(old["prefix_sharing_speedup"])
    assert ("**Incomplete: the bench ended while measuring `padded` in round 1 of 1 (2 of 3 configuration rounds "
            "measured); not measured at all: padded.**" in (out / "report.md").read_text())
    merged = merge_reports([str(out)])
    assert merged["incomplete"] == {str(out): ["padded"]} and len(merged["entries"]) == 2
    write_merged(merged, tmp_path / "merged")
    assert f"**{out} ended early: not measured padded.**" in (tmp_path / "merged" / "report.md").read_text()
    schema_5 = {key: value for key, value in report.items() if key != "unmeasured"}  # written whole or not at all
    assert check_report(dict(schema_5, schema_version=5), "five")["unmeasured"] == []


def test_a_merged_report_names_each_folders_model_and_dataset_and_says_when_they_differ(tmp_path):
    """Clusters compared side by side: the merged table named neither model nor dataset, so two folders of different
    work read as one comparison.  Each row now names its folder's model (name and shape), dataset and max length, and
    one line says whether the folders differ in model, dataset, max length or loss.  The same model and data file in
    other folders of another machine are the same work; a schema-3 folder merges with a schema-4 one."""
    old = json.loads((DOCS / "bench_prefix_report.json").read_text())

    def folder(name: str, report: dict) -> str:
        path = tmp_path / name
        path.mkdir()
        (path / "report.json").write_text(json.dumps(report))
        return str(path)

    moved = json.loads(json.dumps(old)) | {"schema_version": 4, "dataset": "/data/elsewhere/dpo_en_demo.json"}
    moved["model"]["source"] = "/scratch/models/bench_model_vocab4096.json"
    for run_ in moved["runs"].values():
        run_["prepass_flops"] = 0.0
    same = merge_reports([folder("schema3", old), folder("moved", moved)])
    assert same["differs_in"] == []
    entry = same["entries"][0]
    assert entry["model"] == ("bench_model_vocab4096.json (llama, 4 layers x 256, 4/2 heads, ffn 1,024, vocab 4,096)")
    assert (entry["dataset_name"], entry["max_length"]) == ("dpo_en_demo.json", 2048)
    write_merged(same, tmp_path / "same")
    markdown = (tmp_path / "same" / "report.md").read_text()
    assert "Every folder ran the same model, dataset, max length, loss: their figures compare." in markdown
    assert "| source | configuration | model | dataset | max length | loss |" in markdown
    assert markdown.count("| bench_model_vocab4096.json (llama, 4 layers x 256") == 2 * len(old["runs"])

    other = json.loads(json.dumps(moved)) | {"dataset": "synthetic"}
    other["model"].update(source="Qwen/Qwen2.5-0.5B", hidden_size=896)
    other["settings"].update(max_length=512)
    differ = merge_reports([folder("schema3-again", old), folder("other", other)])
    assert differ["differs_in"] == ["model", "dataset", "max length"]
    write_merged(differ, tmp_path / "differ")
    markdown = (tmp_path / "differ" / "report.md").read_text()
    assert ("**Not comparable: the folders differ in model, dataset, max length; their tokens/s, step times and MFU "
            "measure different work.**") in markdown
    assert ("| Qwen/Qwen2.5-0.5B (llama, 4 layers x 896, 4/2 heads, ffn 1,024, vocab 4,096) | synthetic | 512 |"
            in markdown)
    other["settings"].update(max_length=2048, loss="ipo")
    other["model"], other["dataset"] = moved["model"], old["dataset"]
    assert merge_reports([str(tmp_path / "schema3"), folder("ipo", other)])["differs_in"] == ["loss"]


def schema_table(schema: dict) -> str:
    """A schema as docs/benchmarks.md tables it: key, type, meaning."""
    names = {int: "int", float: "number", str: "string", dict: "object", list: "array", bool: "bool",
             type(None): "null"}
    rows = ["| key | type | meaning |", "|---|---|---|"]
    for key, (kind, meaning) in schema.items():
        kinds = list(dict.fromkeys(names[k] for k in (kind if isinstance(kind, tuple) else (kind,))))
        kinds = ["number", *kinds[2:]] if kinds[:2] == ["int", "number"] else kinds
        rows.append(f"| `{key}` | {' or '.join(kinds)} | {meaning.replace('|', chr(92) + '|')} |")
    return "\n".join(rows) + "\n"


def test_the_docs_table_every_report_key():
    """docs/benchmarks.md's tables of report.json and of a run are the schemas' keys, types and meanings."""
    text = (DOCS / "benchmarks.md").read_text()
    assert schema_table(REPORT_SCHEMA) in text and schema_table(RUN_SCHEMA) in text


def test_flop_model_counts_every_weight_but_the_input_embedding():
    model = build_model(None, "tiny", 300, torch.float32, "sdpa", seed=0)
    flop_model = FlopModel.of(model, with_reference=False)
    total = sum(p.numel() for p in model.parameters())
    config = tiny_config(vocab_size=300)
    assert flop_model.matmul_params == total - 300 * config.hidden_size
    assert (flop_model.layers, flop_model.attn_width) == (config.num_hidden_layers, config.hidden_size)


# ---- one real bench launch ----------------------------------------------------------------------

BENCH_RUN = ["--synthetic-pairs", "48", "--max-length", "64", "--global-batch-pairs", "8", "--micro-batch-pairs", "2",
             "--max-steps", "2", "--bench-warmup-steps", "1", "--bench-rounds", "1", "--no-progress"]


def launch_bench(root, name: str, configurations: str, *flags: str):
    """A 2-rank bench of the 'tiny' model given as a config.json file, as the bench's own model is: a file is read
    (and checked) in phase one, then built under ZeRO-3."""
    out = root / name
    model_config = root / "tiny_config.json"
    tiny_config(vocab_size=1024).to_json_file(str(model_config))  # the embedded data's tokenizer has 1024 tokens
    run(ranks_module(2, "ds_packdpo.bench", *BENCH_RUN, "--model-config", str(model_config), "--cache-dir",
                         str(root / f"cache_{name}"), "--configurations", configurations, "--out", str(out), *flags),
        timeout=600)
    return out


@pytest.fixture(scope="module")
def bench_folder(tmp_path_factory):
    return launch_bench(tmp_path_factory.mktemp("bench"), "tiny",
                        "packed,padded,packed-plain-logps,packed-precomputed-ref,packed-lora,packed-no-prefix-sharing")


@pytest.fixture(scope="module")
def bench_folder_sp2(tmp_path_factory):
    """The same bench with both ranks sharing every row (one data-parallel replica): the steps' pairs are the same."""
    return launch_bench(tmp_path_factory.mktemp("bench"), "sp2", "packed,packed-precomputed-ref,packed-lora",
                        "--sequence-parallel-size", "2")


@pytest.mark.multirank
def test_bench_report_is_consistent(bench_folder):
    report = read_report(bench_folder)  # checks every documented key and its type
    packed, padded = report["runs"]["packed"], report["runs"]["padded"]
    assert (report["world_size"], report["dp_size"], report["sp_size"]) == (2, 2, 1) and report["dataset"] == "synthetic"
    assert packed["attn"] == padded["attn"] == "sdpa_varlen" and packed["packing"] and not padded["packing"]
    # every configuration trained the same thing: packed and padded agree to fp32 rounding, step by step
    assert report["same_trajectory"] is True and report["loss_max_rel_diff"] < 1e-5
    for other in report["runs"].values():
        assert other["sequence_parallel_size"] == 1
        if other["name"] == "packed-lora":
            continue  # trains adapters, not every weight: its own trajectory (test_lora_configuration)
        for step, want in zip(other["steps"], packed["steps"], strict=True):
            assert step["loss"] == pytest.approx(want["loss"], rel=1e-5)
            assert step["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
    # the same pairs in the same steps, laid out differently
    # (steps of whole prompt groups: the cut synthetic prompts repeat, so a step holds at least its 8 pairs)
    assert packed["real_tokens"] == padded["real_tokens"] and packed["pairs"] == padded["pairs"] >= 2 * 8
    assert [s["sequence_lengths"] for s in packed["steps"]] == [s["sequence_lengths"] for s in padded["steps"]]
    # packed shares each pair's prompt: it computes real tokens less the prompts, none of them padding
    assert 0 < packed["prompt_tokens_shared"] < packed["real_tokens"] // 2 and padded["prompt_tokens_shared"] == 0
    assert packed["computed_tokens"] == packed["real_tokens"] - packed["prompt_tokens_shared"]
    assert packed["utilization"] == 1.0
    assert padded["computed_tokens"] > padded["real_tokens"] and padded["utilization"] < 1.0
    for run_ in (packed, padded):
        steps = run_["steps"]
        total_time = sum(s["step_time_s"] for s in steps)
        assert run_["measured_steps"] == len(steps) == 2 and [s["step"] for s in steps] == [2, 3]
        assert run_["tokens_per_s"] == pytest.approx(run_["real_tokens"] / total_time)
        assert run_["pairs_per_s"] == pytest.approx(run_["pairs"] / total_time)
        assert run_["step_time_s"]["median"] == pytest.approx(statistics.median(s["step_time_s"] for s in steps))
        assert run_["step_time_s"]["min"] <= run_["step_time_s"]["median"] <= run_["step_time_s"]["p90"] <= run_["step_time_s"]["max"]
        for step in steps:
            laid_out = step["real_tokens"] - step["prompt_tokens_shared"]
            assert sum(step["rank_tokens"]) == laid_out and sum(step["rank_computed_tokens"]) == step["computed_tokens"]
            assert step["computed_tokens"] >= laid_out and len(step["rank_tokens"]) == 2
        assert run_["rank_load_max_over_mean"] >= 1.0 and len(run_["peak_mem_mb_per_rank"]) == 2
        assert 0 < run_["lockstep_utilization"] <= 1.0
        assert run_["prompt_copy_tokens"] == sum(s["prompt_copy_tokens"] for s in steps) >= 0
        assert run_["peak_mem_kind"] == "rss" and 50 < run_["peak_mem_mb"] < 20_000 and run_["mfu"] is None
        # one round (--bench-rounds 1): its figures are the run's
        assert len(run_["rounds"]) == 1 and run_["median_round"] == 1 and run_["spread"] == 0
        assert run_["rounds"][0]["tokens_per_s"] == run_["tokens_per_s"] and run_["rounds"][0]["position"] >= 1
        assert run_["rounds"][0]["loss"] == [step["loss"] for step in steps]
        for step in steps:  # the real tokens of each rank's pairs, which rank_load.png draws
            assert sum(step["rank_real_tokens"]) == step["real_tokens"] and len(step["rank_real_tokens"]) == 2
    assert report["rounds"] == 1 and report["order"] == [[1, name] for name in report["runs"]]
    environment = report["environment"]  # the ranks' threads: the rank launcher's, cores / ranks unless OMP_NUM_THREADS
    threads = torch.get_num_threads() if "OMP_NUM_THREADS" in os.environ else max(1, (os.cpu_count() or 1) // 2)
    assert environment["torch_threads_per_rank"] == [threads] * 2 and environment["local_ranks"] == 2
    assert report["failed"] == {} and report["unmeasured"] == []
    # every comparison whose two configurations ran, each the ratio of their figures beside its token ideal
    figures = {entry["name"]: entry for entry in report["comparisons"]}
    assert list(figures) == ["packing", "prefix sharing", "lean log-probs", "precomputed reference", "LoRA"]
    for entry in figures.values():
        top, bottom = report["runs"][entry["numerator"]], report["runs"][entry["denominator"]]
        assert entry["speedup"] == pytest.approx(top[entry["rate"]] / bottom[entry["rate"]])
        assert entry["ideal_speedup"] == pytest.approx(bottom["computed_tokens"] / top["computed_tokens"])
        assert entry["rounds"] == 1 and entry["round_speedup_min"] == pytest.approx(entry["speedup"])
    assert figures["lean log-probs"]["ideal_speedup"] == 1.0  # the same tokens: the gain is the work per token
    assert report["prefix_sharing_speedup_over_ideal"] == pytest.approx(figures["prefix sharing"]["speedup_over_ideal"])
    assert report["speedup"] == pytest.approx(packed["tokens_per_s"] / padded["tokens_per_s"])
    assert report["ideal_speedup"] == pytest.approx(padded["computed_tokens"] / packed["computed_tokens"])
    assert report["speedup_over_ideal"] == pytest.approx(report["speedup"] / report["ideal_speedup"])
    # the analytic FLOPs are the formula applied to the model the bench built
    model = report["model"]
    flop_model = FlopModel.of(build_model(None, "tiny", model["vocab_size"], torch.float32, "sdpa"), with_reference=True)
    unshared = report["runs"]["packed-no-prefix-sharing"]
    for step, shared_step in zip(unshared["steps"], packed["steps"]):
        assert step["attention_sq"] == sum(n * n for n in step["sequence_lengths"]) > shared_step["attention_sq"]
    for run_ in (packed, padded):
        for step in run_["steps"]:
            assert step["flops"] == pytest.approx(step_flops(flop_model, step["computed_tokens"], step["attention_sq"]))
        assert run_["model_tflops_per_s"] == pytest.approx(
            run_["model_flops"] / sum(s["step_time_s"] for s in run_["steps"]) / 1e12)
        assert run_["prepass_flops"] == 0 == sum(s["prepass_flops"] for s in run_["steps"])  # sigmoid: no pre-pass
    assert padded["prompt_copy_tokens"] == 0 == report["runs"]["packed-no-prefix-sharing"]["prompt_copy_tokens"]
    markdown = (bench_folder / "report.md").read_text()
    assert markdown.split("\n\n")[1].startswith("Speed-ups measured")  # report.md opens with them
    assert "- **packing (packed / padded tokens/s): " in markdown and "- **LoRA (packed-lora / packed pairs/s): " in markdown
    assert "| packed | sdpa_varlen |" in markdown and "| padded | sdpa_varlen |" in markdown
    assert "| lock-step | prompt copies |" in markdown
    oversubscribed = 2 * threads > environment["cpu_cores"]
    assert ("**Oversubscribed: 2 ranks x" in markdown) == oversubscribed
    cores = environment["cpu_cores"]  # ranks of torch's default threads, every core each: said in bold
    crowded = {**report, "environment": {**environment, "torch_threads_per_rank": [cores, cores]}}
    assert f"**Oversubscribed: 2 ranks x {cores} torch threads on {cores} cores" in render_markdown(crowded)
    assert f"{report['speedup']:.3g}" in markdown and "ds_packdpo.bench" in markdown
    assert "2 ranks (2 data-parallel x 1 sequence-parallel)" in markdown
    assert "the same trajectory up to rounding" in markdown
    assert not [p for p in bench_folder.parent.iterdir() if p.name.startswith(".")]  # no staging folder left


@pytest.mark.multirank
def test_plain_logps_and_precomputed_reference_configurations(bench_folder):
    """The issue-8 configurations measure the same steps; the precomputed one runs no reference forward.  So does
    packing without prefix sharing, whose every prompt runs twice: the report sets the speedup of sharing against
    its ideal."""
    report = read_report(bench_folder)
    runs = report["runs"]
    packed, plain, precomputed = runs["packed"], runs["packed-plain-logps"], runs["packed-precomputed-ref"]
    unshared = runs["packed-no-prefix-sharing"]
    assert plain["overrides"] == {"packing": True, "logps_impl": "plain"}
    assert unshared["overrides"] == {"packing": True, "prefix_sharing": False}
    for other in (plain, precomputed, unshared):
        assert [s["sequence_lengths"] for s in other["steps"]] == [s["sequence_lengths"] for s in packed["steps"]]
        assert other["real_tokens"] == packed["real_tokens"]
    for other in (plain, precomputed):
        assert other["computed_tokens"] == packed["computed_tokens"] < unshared["computed_tokens"]
    assert unshared["prompt_tokens_shared"] == 0 and unshared["computed_tokens"] == unshared["real_tokens"]
    assert report["prefix_sharing_speedup"] == pytest.approx(packed["pairs_per_s"] / unshared["pairs_per_s"])
    ideal = unshared["computed_tokens"] / packed["computed_tokens"]
    assert report["prefix_sharing_ideal_speedup"] == pytest.approx(ideal) and ideal > 1
    assert f"ideal {report['prefix_sharing_ideal_speedup']:.3g}" in (bench_folder / "report.md").read_text()
    without_reference = FlopModel.of(build_model(None, "tiny", report["model"]["vocab_size"], torch.float32, "sdpa"),
                                     with_reference=False)
    for step in precomputed["steps"]:
        assert step["flops"] == pytest.approx(step_flops(without_reference, step["computed_tokens"], step["attention_sq"]))
    assert precomputed["model_flops"] < packed["model_flops"] == pytest.approx(plain["model_flops"])
    reference_file = bench_folder.parent / "cache_tiny" / "bench_models" / "reference_logps.jsonl"
    assert len(reference_file.read_text().splitlines()) == 48  # every pair of the data, once


@pytest.mark.multirank
def test_bench_under_sequence_parallelism_trains_what_one_rank_per_row_trains(bench_folder, bench_folder_sp2):
    """S=2 on 2 ranks: each row split over both ranks, counted once; loss and grad norm equal the S=1 bench's, and
    the precomputed reference (precompute-ref run at S=2 inside the bench) equals the S=1 file."""
    single, shared = read_report(bench_folder), read_report(bench_folder_sp2)
    assert (shared["world_size"], shared["dp_size"], shared["sp_size"]) == (2, 1, 2)
    assert shared["same_trajectory"] is True
    for name in ("packed", "packed-precomputed-ref", "packed-lora"):
        got, want = shared["runs"][name], single["runs"][name]
        assert got["sequence_parallel_size"] == 2 and len(got["steps"][0]["rank_tokens"]) == 1  # one share
        assert got["pairs"] == want["pairs"] and got["real_tokens"] == want["real_tokens"]  # counted once, not twice
        for step, ref in zip(got["steps"], want["steps"], strict=True):
            assert step["step"] == ref["step"] and sorted(step["sequence_lengths"]) == sorted(ref["sequence_lengths"])
            assert step["loss"] == pytest.approx(ref["loss"], rel=1e-4), (name, step["step"])
            assert step["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4), (name, step["step"])
    markdown = (bench_folder_sp2 / "report.md").read_text()
    assert "2 ranks (1 data-parallel x 2 sequence-parallel)" in markdown

    def reference_file(folder):
        return [json.loads(line) for line in (folder.parent / f"cache_{folder.name}" / "bench_models" /
                                              "reference_logps.jsonl").read_text().splitlines()]

    s1, s2 = reference_file(bench_folder), reference_file(bench_folder_sp2)
    assert [r["pair_id"] for r in s1] == [r["pair_id"] for r in s2] and len(s1) == 48
    for a, b in zip(s1, s2):
        assert (a["chosen_tokens"], a["rejected_tokens"]) == (b["chosen_tokens"], b["rejected_tokens"])
        for key in ("chosen_logps", "rejected_logps"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-5), (a["pair_id"], key)


@pytest.mark.multirank
def test_lora_configuration(bench_folder):
    """packed-lora trains adapters on the frozen base, its reference the policy with its adapters off: the same
    pairs, a reference forward per row (in the FLOPs) and no reference engine; its loss starts at log 2 like the
    others' and then follows its own trajectory, which the report's trajectory check leaves out."""
    report = read_report(bench_folder)
    packed, lora = report["runs"]["packed"], report["runs"]["packed-lora"]
    assert lora["overrides"] == {"packing": True, "lora_r": 8}
    assert [s["sequence_lengths"] for s in lora["steps"]] == [s["sequence_lengths"] for s in packed["steps"]]
    assert lora["real_tokens"] == packed["real_tokens"]
    assert lora["computed_tokens"] == packed["computed_tokens"] < lora["real_tokens"]  # each prompt once here too
    assert all(s["grad_norm"] > 0 for s in lora["steps"])
    # the FLOPs count no weight gradient for the frozen base, and a reference forward per row
    base = build_model(None, "tiny", report["model"]["vocab_size"], torch.float32, "sdpa")
    flop_model = FlopModel.of(add_adapters(base, LoraSettings(8, 16.0, 0.0, "all-linear")), with_reference=True)
    assert 0 < flop_model.frozen_params < flop_model.matmul_params
    for step in lora["steps"]:
        assert step["flops"] == pytest.approx(step_flops(flop_model, step["computed_tokens"], step["attention_sq"]))
    assert [s["grad_norm"] for s in lora["steps"]] != pytest.approx([s["grad_norm"] for s in packed["steps"]], rel=1e-3)
    assert report["same_trajectory"] is True  # the other configurations still agree with packed


def test_bench_refuses_a_configuration_the_layout_cannot_run(tmp_path, capsys):
    """Padded micro-batches cannot be split over a sequence-parallel group: refused before any rank starts."""
    assert cli.main(["bench", *BENCH_RUN, "--model-config", "tiny", "--cache-dir", str(tmp_path / "cache"), "--sequence-parallel-size", "2",
                     "--configurations", "packed,padded", "--out", str(tmp_path / "b")]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: --configurations padded: --sequence-parallel-size 2 splits packed rows"), last
    assert not (tmp_path / "b").exists()


@pytest.mark.multirank
def test_plots_draw_the_reports_figures_and_say_what_they_draw(bench_folder, tmp_path):
    """rank_load.png drew computed tokens under the label "real" and titled uneven bars "utilization 1.00"; a value
    label of tokens_per_s.png sat under its legend and the computed bars had none.  Each plot is read back here: the
    bars drawn are report.json's figures (per rank: real tokens summing to the run's real tokens, computed to its
    computed tokens), the titles' figures are those of the bars, every bar carries its number, no label touches a
    legend, and the legends say what each series is (no "(2r)")."""
    report = read_report(bench_folder)
    runs, names = report["runs"], list(report["runs"])
    for name in PLOTS:
        data = (bench_folder / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name

    fig = tokens_per_s_figure(report)
    ax = fig.axes[0]
    heights = [bar.get_height() for bar in ax.patches]
    assert heights == pytest.approx([runs[n]["tokens_per_s"] for n in names]
                                    + [runs[n]["computed_tokens_per_s"] for n in names])
    assert [text.get_text() for text in ax.texts] == [number_label(height) for height in heights]
    title = ax.get_title().replace("\n", " ")
    assert all(short_headline(figures) in title for figures in report["comparisons"]) and report["comparisons"]
    legend = " ".join(text.get_text() for text in fig.legends[0].get_texts()).replace("\n", " ")
    assert "real tokens/s: the tokens of the pairs" in legend and "computed tokens/s: the tokens the model ran" in legend
    assert_labels_clear(fig)

    fig = rank_load_figure(report)
    for ax, name in zip(fig.axes, names):
        run_ = runs[name]
        shares = len(run_["steps"][0]["rank_tokens"])
        heights = [bar.get_height() for bar in ax.patches]
        real, not_padding, padding = heights[:shares], heights[shares:2 * shares], heights[2 * shares:]
        assert len(heights) == 3 * shares and sum(real) == run_["real_tokens"], name
        assert sum(not_padding) == run_["real_tokens"] - run_["prompt_tokens_shared"], name
        assert sum(not_padding) + sum(padding) == run_["computed_tokens"], name
        computed = [a + b for a, b in zip(not_padding, padding)]
        assert [text.get_text() for text in ax.texts] == [number_label(v) for v in real + computed]
        utilization, balance = sum(not_padding) / sum(computed), max(computed) / (sum(computed) / shares)
        assert utilization == pytest.approx(run_["utilization"])
        assert ax.get_title() == (f"{name}\nutilization {utilization:.3f} (not padding / computed)\ncomputed max/mean "
                                  f"over ranks {balance:.3f} (worst step {run_['rank_load_max_over_mean']:.3f})")
    packed = runs["packed"]
    assert packed["real_tokens"] > packed["computed_tokens"]  # each prompt once: the real bars stand above the others
    assert_labels_clear(fig)

    other = tmp_path / "other"
    shutil.copytree(bench_folder, other)
    fig = merged_figure(merge_reports([str(bench_folder), str(other)]))
    ax = fig.axes[0]
    assert [text.get_text() for text in ax.texts] == [number_label(bar.get_height()) for bar in ax.patches]
    assert all("2 ranks" in label.get_text() and "2r" not in label.get_text() for label in ax.get_xticklabels())
    assert [text.get_text().replace("\n", " ") for text in fig.legends[0].get_texts()] == [
        f"{folder} (x86_64, 2 ranks)" for folder in (bench_folder, other)]
    assert_labels_clear(fig)


def assert_labels_clear(fig) -> None:
    """No number label of a bar overlaps a legend, the axes' title or another label (the renderer's boxes)."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legends = [legend.get_window_extent(renderer) for legend in fig.legends]
    for ax in fig.axes:
        boxes = [text.get_window_extent(renderer) for text in ax.texts]
        title = ax.title.get_window_extent(renderer)
        for i, box in enumerate(boxes):
            assert not any(box.overlaps(legend) for legend in legends), ax.texts[i].get_text()
            assert not box.overlaps(title) and ax.bbox.contains(*box.min) and ax.bbox.contains(*box.max)
            assert not any(box.overlaps(other) for other in boxes[i + 1:]), ax.texts[i].get_text()


# ---- schema and merge ---------------------------------------------------------------------------

@pytest.mark.multirank
def test_schema_check_names_a_missing_or_mistyped_key(bench_folder, tmp_path):
    report = json.loads((bench_folder / "report.json").read_text())
    assert set(REPORT_SCHEMA) <= set(report) and all(set(RUN_SCHEMA) <= set(r) for r in report["runs"].values())
    broken = json.loads(json.dumps(report))
    del broken["runs"]["padded"]["tokens_per_s"]
    with pytest.raises(InputError, match="runs.padded.tokens_per_s"):
        check_report(broken, "x/report.json")
    broken = json.loads(json.dumps(report))
    broken["world_size"] = "2"
    with pytest.raises(InputError, match="'world_size' has type str"):
        check_report(broken, "x/report.json")


@pytest.mark.multirank
def test_merge_of_two_bench_folders(bench_folder, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(bench_folder, other)
    changed = json.loads((other / "report.json").read_text())
    changed["world_size"] = 4
    changed["runs"]["packed"]["tokens_per_s"] *= 2
    (other / "report.json").write_text(json.dumps(changed))
    out = tmp_path / "merged"
    assert cli.main(["report", str(bench_folder), str(other), "--out", str(out)]) == 0
    merged = json.loads((out / "merged.json").read_text())
    assert merged["entries"] == merge_reports([str(bench_folder), str(other)])["entries"]
    entries = {(e["source"], e["configuration"]): e for e in merged["entries"]}
    configurations = len(changed["runs"])
    assert configurations == 6 and len(entries) == 2 * configurations and entries[(str(other), "packed")]["world_size"] == 4
    assert entries[(str(other), "packed")]["sp_size"] == 1
    assert entries[(str(other), "packed")]["tokens_per_s"] == 2 * entries[(str(bench_folder), "packed")]["tokens_per_s"]
    assert all((out / "report.md").read_text().count(f"| {folder} | padded |") == 1 for folder in (bench_folder, other))
    assert (out / "tokens_per_s.png").read_bytes()[:4] == b"\x89PNG"
    assert cli.main(["report", str(bench_folder), "--out", str(out)]) == 2  # exists: needs --overwrite
    assert cli.main(["report", str(tmp_path / "nope"), "--out", str(tmp_path / "m2")]) == 2
    assert not (tmp_path / "m2").exists()
    write_merged(merge_reports([str(other)]), out, overwrite=True)
    assert len(json.loads((out / "merged.json").read_text())["entries"]) == configurations


def test_bench_flags_fail_before_any_rank_starts(tmp_path, capsys):
    assert cli.main(["bench", "--configurations", "packed,nope", "--out", str(tmp_path / "b")]) == 2
    assert "--configurations: unknown nope" in capsys.readouterr().err
    assert cli.main(["bench", "--bench-rounds", "0", "--out", str(tmp_path / "b")]) == 2
    assert "error: --bench-rounds must be in [1, 100], got 0" in capsys.readouterr().err
    assert bench.parse_bench_args(["--out", str(tmp_path / "b")])[1].bench_rounds == 3  # the default
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    assert cli.main(["bench", "--out", str(tmp_path / "full")]) == 2
    assert "pass --overwrite" in capsys.readouterr().err
    # one rank's own check, before any process group: too few steps in the data
    assert bench.main(["--synthetic-pairs", "16", "--global-batch-pairs", "8", "--max-steps", "2", "--epochs", "1",
                       "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "b")]) == 2
    assert "the data holds only 2 steps of 8 pairs in --epochs 1" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()


def test_bench_says_each_data_warning_once(tmp_path, capfd):
    """Phase one prepares the data once per configuration: the truncation warning was printed for each
    (4 lines for packed,packed-no-prefix-sharing,padded: the base set-up and each configuration), now once."""
    cfg, settings = bench.parse_bench_args(["--synthetic-pairs", "48", "--max-length", "64", "--global-batch-pairs", "8",
                                            "--max-steps", "2", "--bench-warmup-steps", "1", "--cache-dir",
                                            str(tmp_path / "cache"), "--out", str(tmp_path / "b")])
    plan = bench.check_configurations(cfg, settings, world_size=1)
    assert list(plan.setups) == ["packed", "packed-no-prefix-sharing", "padded"]
    assert capfd.readouterr().err.count("warning: synthetic: truncation (--max-length 64)") == 1


def test_bench_says_a_data_quality_warning_once(tmp_path, dpo_demo_rows, demo_tokenizer, dataset_writer, capfd):
    """prepare's data-quality warnings were said by the base set-up and again by each configuration's (4 lines on
    dpo_en_demo); now one `warning:` line (console.say_warning, the one path of every data warning)."""
    rows = dpo_demo_rows[:40]
    path = dataset_writer([*rows, rows[0], rows[1]], "json")
    demo_tokenizer.save_pretrained(tmp_path / "tokenizer")
    flags, settings = bench.parse_bench_args(["--dataset", str(path), "--tokenizer", str(tmp_path / "tokenizer"),
                                              "--max-length", "512", "--global-batch-pairs", "8", "--max-steps", "2",
                                              "--bench-warmup-steps", "1", "--cache-dir", str(tmp_path / "cache"),
                                              "--out", str(tmp_path / "b")])
    plan = bench.check_configurations(flags, settings, world_size=1)
    assert list(plan.setups) == ["packed", "packed-no-prefix-sharing", "padded"]
    said = capfd.readouterr().err.splitlines()
    assert sum(m.startswith(f"warning: {path}: 2 pairs repeat an earlier pair exactly") for m in said) == 1, said


@pytest.mark.parametrize("flags", [["--save-steps", "1"], ["--export-on-end"], ["--resume", "auto"],
                                   ["--report-to", "csv", "--metrics-out", "m.jsonl"]])
def test_bench_refuses_what_only_training_does(tmp_path, flags):
    """A bench ran --save-steps, --export-on-end, --resume, --report-to or --metrics-out without a word and without
    doing them (it runs DPOTrainer.train_step alone): refused in phase one, one line naming them."""
    with pytest.raises(InputError, match="bench measures training steps and writes only its report") as refused:
        bench.parse_bench_args(["--synthetic-pairs", "48", "--max-length", "64", "--global-batch-pairs", "8",
                                "--max-steps", "2", "--bench-warmup-steps", "1", "--cache-dir",
                                str(tmp_path / "cache"), "--out", str(tmp_path / "b"), *flags])
    assert all(flag in str(refused.value) for flag in flags if flag.startswith("--"))


def test_bench_sets_aside_what_only_training_does_when_a_recipe_holds_it(tmp_path, capfd):
    """A training recipe (examples/*.yaml hold save_steps, eval_fraction) given to bench with --config: the bench
    still runs it, without the settings only training acts on, and says so once; the same settings typed on the
    command line are refused, as above."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("save_steps: 5\neval_fraction: 0.2\nmax_length: 64\n")
    args = ["--config", str(recipe), "--synthetic-pairs", "48", "--global-batch-pairs", "8", "--max-steps", "2",
            "--bench-warmup-steps", "1", "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "b")]
    plan = bench.check_configurations(*bench.parse_bench_args(args), world_size=1)
    assert plan.flags.save_steps is None and plan.flags.eval_fraction is None and plan.flags.max_length == 64
    assert not {"save_steps", "eval_fraction"} & (plan.flags.given | plan.flags.from_file)
    err = capfd.readouterr().err
    assert err.count(f"warning: eval_fraction from --config {recipe}: bench measures training steps only") == 1
    assert err.count(f"warning: save_steps from --config {recipe}: bench measures training steps and writes only") == 1
    with pytest.raises(InputError, match="^--save-steps: bench measures training steps and writes only its report"):
        bench.check_configurations(*bench.parse_bench_args([*args, "--save-steps", "3"]), world_size=1)


@pytest.mark.parametrize("flag", ["--loss simpo", "--ref-offload", "--ref-whole"])
def test_bench_refuses_a_precomputed_reference_the_settings_cannot_take(tmp_path, flag):
    """train refuses --ref-logps with --loss simpo or --ref-offload; the bench's packed-precomputed-ref configuration
    (its file written after the others are measured) was accepted and measured as a run without a reference file
    ('--loss simpo --configurations packed,packed-precomputed-ref' ran through).  Refused in phase one."""
    cfg, settings = bench.parse_bench_args(["--synthetic-pairs", "48", "--max-length", "64", "--global-batch-pairs", "8",
                                            "--max-steps", "2", "--bench-warmup-steps", "1", "--cache-dir",
                                            str(tmp_path / "cache"), "--out", str(tmp_path / "b"), *flag.split(),
                                            "--configurations", "packed,packed-precomputed-ref"])
    with pytest.raises(InputError, match=f"--configurations packed-precomputed-ref: {flag.split()[0]}"):
        bench.check_configurations(cfg, settings, world_size=1)


def test_step_times_are_reduced_on_the_accelerator(monkeypatch):
    """The slowest rank's step times are all-reduced from the accelerator's device (NCCL has no CPU tensors: the
    H200 run's bench ended with 'No backend type associated with device type cpu')."""
    from ds_packdpo import bench

    seen = []

    class Accelerator:
        def current_device_name(self):
            return "meta"

    monkeypatch.setattr(bench, "get_accelerator", Accelerator)
    monkeypatch.setattr(bench.dist, "all_reduce", lambda tensor, op: seen.append((tensor.device.type, op)))
    with pytest.raises(NotImplementedError):  # a meta tensor has no values to read back: the reduce was reached
        bench.slowest_rank_seconds([1.0, 2.0])
    assert seen == [("meta", bench.dist.ReduceOp.MAX)]
