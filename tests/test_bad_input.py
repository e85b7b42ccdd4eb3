"""Bad input end to end, through the command line a user runs.

Every malformed dataset and impossible configuration must end with one line
``error: <where>: <why>``, exit code 2, no rank started and the output folder
untouched (even with --overwrite).  Most cases run in-process through
``ds_packdpo.cli.main(["train", ...])`` (the front command, with the launcher
replaced by a tripwire); a representative few run as real subprocesses, through
the front command and through the rank entry ``python -m ds_packdpo.train``.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import write_rows
from launching import BIN, rank_module, run
from test_checkpoint import fake_checkpoint
from test_data import BAD_ROWS, standard_rows, with_row

from ds_packdpo import cli


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory, demo_tokenizer) -> Path:
    folder = tmp_path_factory.mktemp("tokenizer")
    demo_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def out_dir(tmp_path) -> Path:
    """An existing run folder with one file: a failing command must leave it exactly so."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("earlier results")
    return out


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def base_flags(tmp_path: Path, out_dir: Path, tokenizer_dir: Path) -> list[str]:
    return ["--output-dir", str(out_dir), "--overwrite", "--cache-dir", str(tmp_path / "cache"),
            "--tokenizer", str(tokenizer_dir), "--max-length", "128", "--synthetic-pairs", "16", "--no-progress"]


def assert_one_line_error(code: int, stderr: str, *parts: str) -> str:
    assert code == 2, stderr[-2000:]
    assert "Traceback" not in stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("error: "), last
    for part in parts:
        assert part in last, f"{part!r} not in {last!r}"
    return last


@pytest.fixture
def train_front(tmp_path, out_dir, tokenizer_dir, no_launch, capsys):
    """``ds-packdpo train FLAGS`` in-process; asserts the one-line error, exit 2 and an untouched output folder."""
    def check(*flags: str, parts: tuple[str, ...]) -> str:
        before = snapshot(out_dir)
        code = cli.main(["train", *base_flags(tmp_path, out_dir, tokenizer_dir), *flags])
        message = assert_one_line_error(code, capsys.readouterr().err, *parts)
        assert snapshot(out_dir) == before
        return message

    return check


# ----------------------------------------------------------------------------- malformed datasets
@pytest.mark.parametrize("case", list(BAD_ROWS), ids=list(BAD_ROWS))
def test_every_row_defect(case, tmp_path, train_front):
    rows, index, bad, expected = BAD_ROWS[case]
    path = write_rows(with_row(rows, index, bad), tmp_path, "json")
    train_front("--dataset", str(path), parts=(f"{path} {expected}",))


def _truncated(tmp_path: Path) -> Path:
    text = json.dumps(standard_rows(5), indent=2)
    path = tmp_path / "truncated.json"
    path.write_text(text[: text.index('"bad answer 3"') + 5])
    return path


def _binary(tmp_path: Path, suffix: str) -> Path:
    path = tmp_path / f"garbage{suffix}"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    return path


BAD_FILES = {
    "empty file": (lambda d: _written(d / "empty.json", ""), "the file is empty"),
    "truncated JSON": (_truncated, "row 3: not valid JSON, truncated or malformed (Unterminated string starting "
                                   "at: line "),
    "wrong column names": (lambda d: _written(d / "cols.json", json.dumps([{"question": "q", "answer": "a"}])),
                           "columns found ['answer', 'question']; expected ['prompt', 'chosen', 'rejected']"),
    "binary garbage json": (lambda d: _binary(d, ".json"), "binary content (NUL bytes), not a JSON text file"),
    "binary garbage parquet": (lambda d: _binary(d, ".parquet"), "not a readable Parquet file"),
    "missing file": (lambda d: d / "nowhere.jsonl", "no such file or folder"),
}


def _written(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize("case", list(BAD_FILES), ids=list(BAD_FILES))
def test_bad_dataset_files(case, tmp_path, train_front):
    make, expected = BAD_FILES[case]
    path = make(tmp_path)
    train_front("--dataset", str(path), parts=(str(path), expected))


# ----------------------------------------------------------------------------- impossible configurations
def _config_file(tmp_path: Path, settings: dict | str, suffix: str = "json") -> str:
    path = tmp_path / f"settings.{suffix}"
    path.write_text(settings if isinstance(settings, str) else json.dumps(settings))
    return str(path)


def _ds_config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "ds.json"
    path.write_text(text)
    return str(path)


def _incompatible_checkpoint(tmp_path: Path) -> str:
    tag = fake_checkpoint(tmp_path / "ckpt" / "global_step3", 2, 2, plan_fingerprint="0" * 32, dtype="fp32",
                          position={"epoch": 0, "epoch_step": 3, "global_step": 3}, bad_steps=0, output_dir="x")
    return str(tag)


BAD_CONFIGS = {
    "unknown key": (lambda d: ["--config", _config_file(d, {"max_lenght": 64})],
                    "unknown key 'max_lenght'; did you mean 'max_length'?"),
    "wrong type": (lambda d: ["--config", _config_file(d, {"max_length": "long"})],
                   "key 'max_length' must be int, got str 'long'"),
    "config not JSON": (lambda d: ["--config", _config_file(d, "{max_length: 64")], "not valid JSON"),
    "renamed key": (lambda d: ["--config", _config_file(d, "num_proc: 2\n", "yaml")],
                    "settings.yaml: key 'num_proc' is now 'tokenize_procs' (tokenization processes; --num-procs is the "
                    "ranks a front command starts)"),
    "unknown key in YAML": (lambda d: ["--config", _config_file(d, "max_lenght: 64\n", "yaml")],
                            "settings.yaml: unknown key 'max_lenght'; did you mean 'max_length'?"),
    "wrong type in YAML": (lambda d: ["--config", _config_file(d, "max_length: [64]\n", "yaml")],
                           "settings.yaml: key 'max_length' must be int, got list [64]"),
    "config not YAML": (lambda d: ["--config", _config_file(d, "max_length: [64\n", "yml")],
                        "settings.yml: not valid YAML (while parsing a flow sequence"),
    "YAML list, not settings": (lambda d: ["--config", _config_file(d, "- 1\n", "yaml")],
                                "settings.yaml: expected a YAML mapping of settings, got list"),
    "DeepSpeed YAML config": (lambda d: ["--ds-config", _config_file(d, "zero_optimization: {stage: 7}\n", "yaml")],
                              "settings.yaml: 'zero_optimization.stage': Input should be 0, 1, 2, 3"),
    "exclusive batch settings": (lambda d: ["--global-batch-pairs", "8", "--tokens-per-step", "4096"],
                                 "--global-batch-pairs and --tokens-per-step are exclusive"),
    "DeepSpeed batch contradicts": (
        lambda d: ["--global-batch-pairs", "8", "--ds-config",
                   _ds_config(d, json.dumps({"train_batch_size": 16, "zero_optimization": {"stage": 3}}))],
        "ds.json: 'train_batch_size': 16 and --global-batch-pairs 8 differ; give it in one place"),
    "DeepSpeed config not JSON": (lambda d: ["--ds-config", _ds_config(d, "{ not json")], "not valid JSON"),
    "missing model folder": (lambda d: ["--model", str(d / "no_model")],
                             "no_model: not a local HF model folder (no such folder, and not a hub model id)"),
    "row budget below max length": (lambda d: ["--max-tokens-per-row", "64"], "--max-tokens-per-row"),
    "resume from a missing checkpoint": (lambda d: ["--resume", str(d / "no_ckpt")], "no such checkpoint folder"),
    "resume from an incompatible checkpoint": (lambda d: ["--resume", _incompatible_checkpoint(d)],
                                               "global_step3: the checkpoint was written for other data or plan"),
    "resume from a partial checkpoint": (
        lambda d: ["--resume", str(fake_checkpoint(d / "ckpt" / "global_step6", 2, 1))],
        "global_step6: incomplete checkpoint (missing rng_rank1.pt"),
    "limit without saving": (lambda d: ["--save-total-limit", "2"], "--save-total-limit needs --save-steps"),
    "lr nan": (lambda d: ["--lr", "nan"], "--lr must be a finite number, got nan"),
    "lr inf": (lambda d: ["--lr", "inf"], "--lr must be a finite number, got inf"),
    "lr nan in the config file": (lambda d: ["--config", _config_file(d, '{"lr": NaN}')],
                                  "--lr must be a finite number, got nan"),
    "negative weight decay": (lambda d: ["--weight-decay", "-1"], "--weight-decay must be >= 0, got -1.0"),
    "negative max grad norm": (lambda d: ["--max-grad-norm", "-1"], "--max-grad-norm must be >= 0, got -1.0"),
    "negative warm-up": (lambda d: ["--warmup-steps", "-3"], "--warmup-steps must be >= 0, got -3"),
    "zero ranks": (lambda d: ["--num-procs", "0"], "--num-procs must be in [1, 65536], got 0"),
    "DeepSpeed stage 7": (lambda d: ["--ds-config", _ds_config(d, json.dumps({"zero_optimization": {"stage": 7}}))],
                          "ds.json: 'zero_optimization.stage': Input should be 0, 1, 2, 3"),
    # found by the cross-feature audit: refused only once the policy engine existed (after the process group)
    "reference offload without ZeRO-3": (lambda d: ["--ref-offload", "--sync-ref-model", "--ds-config", "zero2"],
                                         "--ref-offload needs a ZeRO-3 DeepSpeed config"),
    "reference whole and offloaded": (lambda d: ["--ref-whole", "--ref-offload"],
                                      "--ref-whole with --ref-offload: the one keeps the reference's weights on every "
                                      "GPU, the other on the CPU; drop one of them"),
    "reference whole and mixed (TR-DPO)": (lambda d: ["--ref-whole", "--sync-ref-model"],
                                           "--ref-whole with --sync-ref-model: TR-DPO mixes each rank's partition"),
    "reference whole without a reference model (LoRA)": (lambda d: ["--ref-whole", "--lora-r", "4"],
                                                         "--ref-whole with --lora-r: the reference is the policy with "
                                                         "its adapters off"),
    "DeepSpeed unknown ZeRO key": (
        lambda d: ["--ds-config", _ds_config(d, json.dumps({"zero_optimization": {"stage": 3, "overlap_com": True}}))],
        "'zero_optimization.overlap_com': Extra inputs are not permitted, got True"),
    "DeepSpeed unknown optimizer": (
        lambda d: ["--ds-config", _ds_config(d, json.dumps({"optimizer": {"type": "AdamQ", "params": {"lr": 1e-3}}}))],
        "'optimizer.type': 'AdamQ' is neither a DeepSpeed nor a torch.optim optimizer"),
    "DeepSpeed unknown scheduler": (
        lambda d: ["--ds-config", _ds_config(d, json.dumps({"scheduler": {"type": "WarmupLRR", "params": {}}}))],
        "'scheduler.type': 'WarmupLRR' is not one ds_packdpo runs (WarmupLR (--lr-scheduler constant)"),
    "model folder without config.json": (
        lambda d: ["--model", str(_folder(d / "not_a_model"))],
        "not_a_model: not a local HF model folder (no config.json in the folder)"),
    "impossible model config": (lambda d: ["--model-config", _model_config(d, hidden_size=-4)],
                                "cannot build a model from it (Trying to create tensor with negative dimension -4"),
    "model config transformers refuses": (lambda d: ["--model-config", _model_config(d, hidden_size=66)],
                                          "model.json: unreadable model config"),
    "precomputed reference without its fingerprint": (lambda d: ["--ref-logps", str(_written(d / "ref.jsonl", ""))],
                                                      "ref.jsonl: no fingerprint file ref.jsonl.meta.json beside it"),
    "export over the model it trains from": (  # round two from round one's export: the model was replaced
        lambda d: ["--export-on-end", "--model", str(_hf_model(d / "out" / "hf_model"))],
        "hf_model: would replace"),
    "checkpoints inside the export folder": (  # was refused by the export, once the whole run had trained
        lambda d: ["--export-on-end", "--save-dir", str(d / "out" / "hf_model" / "checkpoints")],
        "out/hf_model, which --export-on-end replaces with the model exported from it; save elsewhere"),
    # the LR schedule and held-out evaluation
    "warm-up steps and ratio": (lambda d: ["--warmup-steps", "2", "--warmup-ratio", "0.1"],
                                "--warmup-steps and --warmup-ratio are exclusive; give one"),
    "warm-up ratio of 1": (lambda d: ["--warmup-ratio", "1"], "--warmup-ratio must be in [0, 1), got 1.0"),
    "floor of a constant LR": (lambda d: ["--lr-scheduler", "constant", "--min-lr-ratio", "0.1"],
                               "--min-lr-ratio 0.1 has no effect with --lr-scheduler constant"),
    "DeepSpeed scheduler contradicts the flags": (
        lambda d: ["--warmup-steps", "2", "--ds-config", _ds_config(d, json.dumps({"scheduler": {
            "type": "WarmupDecayLR", "params": {"warmup_num_steps": 100}}}))],
        "'scheduler.params.warmup_num_steps': 100 and --warmup-steps 2 differ; give it in one place"),
    "eval steps without a held-out set": (lambda d: ["--eval-steps", "5"],
                                          "--eval-steps needs a held-out set: --eval-dataset or --eval-fraction"),
    "eval fraction of 1": (lambda d: ["--eval-fraction", "1"], "--eval-fraction must be in (0, 1), got 1.0"),
    "eval fraction that holds out no pair": (lambda d: ["--eval-fraction", "0.0001"],
                                             "--eval-fraction 0.0001: holds out no pair of the 16 pairs of synthetic"),
    "eval dataset and fraction": (lambda d: ["--eval-fraction", "0.2", "--eval-dataset", str(d / "e.json")],
                                  "--eval-dataset and --eval-fraction are exclusive"),
    "eval dataset with a precomputed reference": (
        lambda d: ["--eval-dataset", str(d / "e.json"), "--ref-logps", str(d / "ref.jsonl")],
        "the file holds the reference log-probs of --dataset only"),
    "missing eval dataset": (lambda d: ["--eval-dataset", str(d / "nowhere.jsonl")],
                             "nowhere.jsonl: no such file or folder"),
}


def _hf_model(path: Path) -> Path:
    from ds_packdpo.model.build import tiny_config

    tiny_config(vocab_size=4096).save_pretrained(path)
    return path


def _folder(path: Path) -> Path:
    path.mkdir()
    return path


def _model_config(folder: Path, **overrides) -> str:
    from ds_packdpo.model.build import tiny_config

    config = {**tiny_config(vocab_size=4096).to_dict(), **overrides}
    (folder / "model.json").write_text(json.dumps(config))
    return str(folder / "model.json")


@pytest.mark.parametrize("case", list(BAD_CONFIGS), ids=list(BAD_CONFIGS))
def test_impossible_configurations(case, tmp_path, train_front):
    make, expected = BAD_CONFIGS[case]
    train_front(*make(tmp_path), parts=(expected,))


def test_eval_needs_the_trained_model_and_its_reference(tmp_path, no_launch, capsys):
    """``ds-packdpo eval`` without --model, or without the model it was trained from: refused before any launch."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert cli.main(["eval", "--synthetic-pairs", "16"]) == 2
    assert_one_line_error(2, capsys.readouterr().err, "eval: --model is required")
    assert cli.main(["eval", "--model", str(model)]) == 2
    assert_one_line_error(2, capsys.readouterr().err, "eval: --ref-model (the model the policy was trained from) or "
                          "--ref-logps is required")


def test_export_refuses_missing_checkpoint_and_full_folder(tmp_path, out_dir, capsys):
    assert cli.main(["export", "--checkpoint", str(tmp_path / "none"), "--out", str(tmp_path / "hf")]) == 2
    assert_one_line_error(2, capsys.readouterr().err, f"--checkpoint {tmp_path / 'none'}: no such checkpoint folder")
    tag = fake_checkpoint(tmp_path / "ckpt" / "global_step3", 1, 1)
    before = snapshot(out_dir)
    assert cli.main(["export", "--checkpoint", str(tag), "--out", str(out_dir)]) == 2
    assert_one_line_error(2, capsys.readouterr().err, f"--out {out_dir}: folder is not empty")
    assert snapshot(out_dir) == before
    assert not (tmp_path / "hf").exists()


# ----------------------------------------------------------------------------- real subprocesses
@pytest.mark.parametrize("entry", ["front", "rank"])
def test_real_command_lines(entry, tmp_path, out_dir, tokenizer_dir):
    """The same failures from real processes: the front command starts no rank, the rank entry no process group."""
    before = snapshot(out_dir)
    flags = base_flags(tmp_path, out_dir, tokenizer_dir)
    if entry == "front":
        cases = [(["--dataset", str(_truncated(tmp_path))], "row 3: not valid JSON, truncated or malformed"),
                 (["--resume", _incompatible_checkpoint(tmp_path)], "written for other data or plan settings")]
        command = [str(BIN / "ds-packdpo"), "train"]
    else:
        cases = [(["--dataset", str(_binary(tmp_path, ".json"))], "binary content"),
                 (["--config", _config_file(tmp_path, {"bogus": 1})], "unknown key 'bogus'")]
        command = rank_module("ds_packdpo.train")
    for extra, expected in cases:
        proc = run([*command, *flags, *extra], timeout=300, check=False)
        assert_one_line_error(proc.returncode, proc.stderr, expected)
        assert "launch.py" not in proc.stderr and "init_distributed" not in proc.stderr
    assert snapshot(out_dir) == before


def test_precomputed_reference_of_another_dataset_is_refused_before_launch(tmp_path, out_dir, tokenizer_dir,
                                                                           train_front):
    """--ref-logps is checked in the front command's phase one (not first in every rank after the launch)."""
    from ds_packdpo.config import parse_train_args
    from ds_packdpo.run.reference import meta_path, reference_fingerprint
    from ds_packdpo.run.assemble import prepare

    ref = _written(tmp_path / "ref.jsonl", "")
    setup = prepare(parse_train_args(base_flags(tmp_path, out_dir, tokenizer_dir)), world_size=2)
    stored = {**reference_fingerprint(setup), "dataset": "0" * 32}  # this run's, but of other data
    meta_path(ref).write_text(json.dumps({"fingerprint": stored, "info": {}}))
    train_front("--ref-logps", str(ref), parts=(f"--ref-logps {ref}: computed for a different dataset than this run",))


# ----------------------------------------------------------------------------- output paths of prepare and pack-stats
def data_flags(tmp_path: Path, tokenizer_dir: Path) -> list[str]:
    return ["--cache-dir", str(tmp_path / "cache"), "--tokenizer", str(tokenizer_dir), "--max-length", "128",
            "--synthetic-pairs", "16"]


@pytest.mark.parametrize("command, flag", [("prepare", "--out"), ("pack-stats", "--plan-out")])
def test_output_file_that_is_a_folder(command, flag, tmp_path, out_dir, tokenizer_dir, capsys):
    before = snapshot(out_dir)
    code = cli.main([command, *data_flags(tmp_path, tokenizer_dir), flag, str(out_dir)])
    assert_one_line_error(code, capsys.readouterr().err, f"{flag} {out_dir}: is a folder; give the file to write")
    assert snapshot(out_dir) == before


@pytest.mark.parametrize("command, flag", [("prepare", "--out"), ("pack-stats", "--plan-out"),
                                           ("precompute-ref", "--out"), ("train", "--metrics-out")])
def test_an_output_written_over_the_dataset_it_reads_is_refused(command, flag, tmp_path, tokenizer_dir, no_launch,
                                                               capsys):
    """``prepare --out`` or ``precompute-ref --out`` of the dataset's own file with --overwrite, ``pack-stats
    --plan-out`` of it (replaced without --overwrite: the plan is derived data) replaced the user's data with what was
    derived from it; the metrics file of a training run likewise."""
    dataset = write_rows(standard_rows(16), tmp_path, "jsonl")
    before = dataset.read_bytes()
    code = cli.main([command, *data_flags(tmp_path, tokenizer_dir)[:-2], "--dataset", str(dataset), "--overwrite",
                     *(["--output-dir", str(tmp_path / "run")] if command == "train" else []), flag, str(dataset)])
    assert_one_line_error(code, capsys.readouterr().err,
                          f"{flag} {dataset}: would replace {dataset}, which this command reads; write elsewhere")
    assert dataset.read_bytes() == before


def test_prepare_replaces_an_existing_file_only_with_overwrite(tmp_path, tokenizer_dir, capsys):
    out = _written(tmp_path / "pairs.jsonl", "earlier pairs\n")
    code = cli.main(["prepare", *data_flags(tmp_path, tokenizer_dir), "--out", str(out)])
    assert_one_line_error(code, capsys.readouterr().err, f"--out {out}: file exists (pass --overwrite to replace it)")
    assert out.read_text() == "earlier pairs\n"
    assert cli.main(["prepare", *data_flags(tmp_path, tokenizer_dir), "--out", str(out), "--overwrite"]) == 0
    assert json.loads(capsys.readouterr().out)["output"] == str(out)
    assert len(out.read_text().splitlines()) == 16 and "pair_id" in out.read_text()


# ----------------------------------------------------------------------------- wording
def test_unknown_command_is_named(capsys):
    assert cli.main(["trian", "--max-steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[0] == "ds-packdpo: unknown command 'trian'"
    assert "usage: ds-packdpo {train, prepare" in err and "eval" in err


def test_check_blames_the_missing_model_folder_not_the_tokenizer(tmp_path, capsys):
    missing = tmp_path / "no_model"
    code = cli.main(["check", "--model", str(missing)])
    assert_one_line_error(code, capsys.readouterr().err, f"--model {missing}: not a local HF model folder (no such folder, and not a hub model id)")


def test_export_names_the_unreadable_shard(tmp_path, out_dir, demo_tokenizer, capsys):
    """A damaged ZeRO shard (placeholder bytes, not a torch archive) that its manifest vouches for (damaged before the
    save read it back): its file named, not an UnpicklingError."""
    from ds_packdpo.model.build import tiny_config
    from ds_packdpo.run.manifest import write_manifest

    tag = fake_checkpoint(tmp_path / "ckpt" / "global_step3", 1, 1, dtype="fp32",
                          position={"epoch": 0, "epoch_step": 3, "global_step": 3})
    tiny_config(vocab_size=len(demo_tokenizer)).save_pretrained(tag / "hf")
    demo_tokenizer.save_pretrained(tag / "hf")
    (tag / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(b"x")
    write_manifest(tag)
    before = snapshot(out_dir)
    code = cli.main(["export", "--checkpoint", str(tag), "--out", str(out_dir), "--overwrite"])
    assert_one_line_error(code, capsys.readouterr().err,
                          f"--checkpoint {tag}: zero_pp_rank_0_mp_rank_00_model_states.pt: not a torch.save archive (")
    assert snapshot(out_dir) == before


def test_train_phase_one_warns_when_ranks_idle(tmp_path, out_dir, tokenizer_dir, capsys):
    """Not an error, but said before the launch: 1 pair per step on 2 ranks leaves one rank idle."""
    from ds_packdpo.config import parse_train_args
    from ds_packdpo.run.assemble import prepare

    prepare(parse_train_args([*base_flags(tmp_path, out_dir, tokenizer_dir), "--global-batch-pairs", "1"]),
            world_size=2)
    assert re.search("^warning: 1 pairs per step for 2 data-parallel ranks: 1 ranks get no pair .* at most 50% of the "
                     "ranks' compute", capsys.readouterr().err, re.M)


@pytest.mark.parametrize("command", ["train", "prepare", "bench"])
def test_a_typo_or_an_abbreviation_is_one_line_naming_the_flag(command, no_launch, capsys):
    """A mistyped flag answers in one line with the closest flag, not the whole usage; an abbreviation of a long flag
    (argparse's default accepts --max-len as --max-length) is refused the same way."""
    for typed in ("--max-lenght", "--max-len"):
        with pytest.raises(SystemExit) as exit_:
            cli.main([command, typed, "64"])
        assert_one_line_error(exit_.value.code, capsys.readouterr().err,
                              f"unrecognized arguments: {typed} 64; {typed}: did you mean --max-length?")
    with pytest.raises(SystemExit) as exit_:  # a renamed flag: refused, pointing at its new name
        cli.main([command, "--num-proc", "2"])
    assert_one_line_error(exit_.value.code, capsys.readouterr().err, "--num-proc is now --tokenize-procs (tokenization "
                          "processes; --num-procs is the ranks a front command starts)")


def test_a_missing_relative_model_folder_is_said_at_once(tmp_path, out_dir, tokenizer_dir, no_launch, capsys,
                                                         monkeypatch):
    """``--model mymodle`` (a bare name that is no folder here and not in the hub cache) and ``runs/my-modle`` (an
    org/name whose org is a folder here) are not tried on the hub."""
    monkeypatch.chdir(tmp_path)
    began = time.perf_counter()
    code = cli.main(["train", *base_flags(tmp_path, out_dir, tokenizer_dir), "--model", "mymodle"])
    assert_one_line_error(code, capsys.readouterr().err,
                          f"--model mymodle: no such folder (relative to {tmp_path}), and not a hub id of the form "
                          f"org/name")
    assert time.perf_counter() - began < 5
    code = cli.main(["prepare", "--tokenizer", "mytokeniser", "--synthetic-pairs", "4"])
    assert_one_line_error(code, capsys.readouterr().err, "--tokenizer mytokeniser: no such folder (relative to ")
    (tmp_path / "runs").mkdir()
    code = cli.main(["train", *base_flags(tmp_path, out_dir, tokenizer_dir), "--model", "runs/my-modle"])
    assert_one_line_error(code, capsys.readouterr().err,
                          "--model runs/my-modle: no such folder (runs is a folder here, my-modle is not in it)")
    assert time.perf_counter() - began < 5


@pytest.mark.parametrize("flags, expected", [
    (["--ld-alpha", "1.5"], "--ld-alpha must be in [0, 1] (the weight of the tokens past the shorter completion's"),
    (["--ld-alpha", "-0.1"], "--ld-alpha must be in [0, 1]"),
    (["--loss", "simpo", "--use-weighting"], "--loss simpo: --ld-alpha and --use-weighting are TRL DPOTrainer"),
    (["--loss", "simpo", "--ld-alpha", "0.5"], "--loss simpo: --ld-alpha and --use-weighting are TRL DPOTrainer"),
])
def test_token_weighting_refusals(flags, expected, train_front):
    """LD-DPO and WPO settings TRL refuses (or SimPO has no form of): one line before any launch."""
    train_front(*flags, parts=(expected,))


def test_precomputed_reference_of_another_ld_alpha_is_refused_before_launch(tmp_path, out_dir, tokenizer_dir,
                                                                            train_front):
    """The stored sums are LD-weighted: a file written with --ld-alpha 0.5 serves no run with another or none."""
    from ds_packdpo.config import parse_train_args
    from ds_packdpo.run.reference import meta_path, reference_fingerprint
    from ds_packdpo.run.assemble import prepare

    ref = _written(tmp_path / "ref.jsonl", "")
    setup = prepare(parse_train_args([*base_flags(tmp_path, out_dir, tokenizer_dir), "--ld-alpha", "0.5"]),
                    world_size=2)
    stored = reference_fingerprint(setup)
    assert stored["ld_alpha"] == 0.5
    meta_path(ref).write_text(json.dumps({"fingerprint": stored, "info": {}}))
    for flags, run_value in ((["--ld-alpha", "0.3"], "0.3"), ([], "none")):  # the values said (they were not)
        train_front("--ref-logps", str(ref), *flags,
                    parts=(f"--ref-logps {ref}: computed for a different ld_alpha than this run (ld_alpha: file 0.5, "
                           f"this run {run_value}; run 'ds-packdpo precompute-ref'",))


def test_outputs_meet_inputs_through_home_and_links(tmp_path, monkeypatch):
    """A recipe's ``~/pairs.jsonl`` is the file the loader reads, so an --out naming it is refused; an output that is
    a link is replaced itself (atomic_write), not its target, so it may point at an input."""
    from ds_packdpo.config import TrainConfig
    from ds_packdpo.errors import InputError
    from ds_packdpo.files import check_output_file

    monkeypatch.setenv("HOME", str(tmp_path))
    dataset = write_rows(standard_rows(4), tmp_path, "jsonl", name="pairs")
    reads = TrainConfig(dataset="~/pairs.jsonl").local_inputs()
    with pytest.raises(InputError, match="would replace ~/pairs.jsonl"):
        check_output_file(dataset, "--out", overwrite=True, reads=reads)
    (tmp_path / "link.jsonl").symlink_to(dataset)
    check_output_file(tmp_path / "link.jsonl", "--out", overwrite=True, reads=reads)


def test_eval_runs_where_its_unused_output_folder_cannot_be_made(tmp_path, monkeypatch, no_launch, tokenizer_dir):
    """eval and precompute-ref set --output-dir aside (refused typed): its default runs/train, which they never make,
    was still checked, so they failed in a folder they cannot write in, with no flag to get past it."""
    from ds_packdpo.evaluate import parse_eval_args

    model = str(_hf_model(tmp_path / "model"))
    monkeypatch.chdir("/proc")
    cfg = parse_eval_args(["--model", model, "--ref-model", model, "--tokenizer", str(tokenizer_dir),
                           "--synthetic-pairs", "16", "--cache-dir", str(tmp_path / "cache")])
    assert cfg.output_dir == "runs/train"
