"""What runs is what the user wrote: values a DeepSpeed config and the flags can both give (run/user_values.py).

Per two-place value, in phase one (in-process, milliseconds): given in the flags only, in
the DeepSpeed config only, in both alike (each runs, and is the setting every report reads,
and the value DeepSpeed is handed), and in both differently (one line naming both).  One
one-rank launch then reads several of them back from what the engine ran (metrics.jsonl)
and compares them with run_config.json, plan_summary.json and the plan line.
"""

from __future__ import annotations

import json

import pytest

from ds_packdpo.config import parse_train_args
from ds_packdpo.errors import InputError
from ds_packdpo.run.assemble import with_ds_values

from launching import SMALL_RUN, rank_module, read_metrics, run
import specs

DP = 2  # data-parallel ranks of the in-process cases


def resolve(flags: list[str], ds: dict, dp: int = DP):
    """(settings, the filled DeepSpeed config) of a run with these flags and this DeepSpeed config."""
    cfg = parse_train_args(flags)
    cfg, raw = with_ds_values(cfg, {"zero_optimization": {"stage": 3}, **ds}, "ds.json", dp)
    return cfg, specs.ds_config(cfg, raw, "ds.json", dp, 10)


def _params(ds: dict) -> dict:
    return ds["optimizer"]["params"]


# name -> (flags, DeepSpeed config fragment, flags that differ, the setting(s) -> value, where DeepSpeed reads it)
CASES = {
    "optimizer type": (["--optimizer", "SGD"], {"optimizer": {"type": "SGD"}}, ["--optimizer", "Adam"],
                       {"optimizer": "SGD"}, lambda ds: ds["optimizer"]["type"]),
    "lr": (["--lr", "1e-4"], {"optimizer": {"params": {"lr": 1e-4}}}, ["--lr", "1e-3"], {"lr": 1e-4},
           lambda ds: (_params(ds)["lr"], ds["scheduler"]["params"]["warmup_max_lr"])),
    "betas": (["--adam-beta1", "0.8", "--adam-beta2", "0.9"], {"optimizer": {"params": {"betas": [0.8, 0.9]}}},
              ["--adam-beta2", "0.99"], {"adam_beta1": 0.8, "adam_beta2": 0.9}, lambda ds: _params(ds)["betas"]),
    "eps": (["--adam-epsilon", "1e-6"], {"optimizer": {"params": {"eps": 1e-6}}}, ["--adam-epsilon", "1e-5"],
            {"adam_epsilon": 1e-6}, lambda ds: _params(ds)["eps"]),
    "weight decay": (["--weight-decay", "0.05"], {"optimizer": {"params": {"weight_decay": 0.05}}},
                     ["--weight-decay", "0.1"], {"weight_decay": 0.05}, lambda ds: _params(ds)["weight_decay"]),
    "gradient clipping": (["--max-grad-norm", "0.5"], {"gradient_clipping": 0.5}, ["--max-grad-norm", "2"],
                          {"max_grad_norm": 0.5}, lambda ds: ds["gradient_clipping"]),
    "scheduler type": (["--lr-scheduler", "cosine"], {"scheduler": {"type": "WarmupCosineLR"}},
                       ["--lr-scheduler", "constant"], {"lr_scheduler": "cosine"}, lambda ds: ds["scheduler"]["type"]),
    "warm-up": (["--warmup-steps", "3"], {"scheduler": {"params": {"warmup_num_steps": 3}}}, ["--warmup-steps", "4"],
                {"warmup_steps": 3}, lambda ds: ds["scheduler"]["params"]["warmup_num_steps"]),
    "peak of the schedule": (["--lr", "2e-4"], {"scheduler": {"params": {"warmup_max_lr": 2e-4}}}, ["--lr", "1e-4"],
                             {"lr": 2e-4}, lambda ds: ds["scheduler"]["params"]["warmup_max_lr"]),
    "floor of the schedule": (["--lr-scheduler", "cosine", "--min-lr-ratio", "0.1"],
                              {"scheduler": {"type": "WarmupCosineLR",
                                             "params": {"cos_min_ratio": 0.1, "warmup_min_ratio": 0.1}}},
                              ["--min-lr-ratio", "0.2"], {"min_lr_ratio": 0.1},
                              lambda ds: (ds["scheduler"]["params"]["cos_min_ratio"],
                                          ds["scheduler"]["params"]["warmup_min_ratio"])),
    "precision": (["--dtype", "bf16"], {"bf16": {"enabled": True}}, ["--dtype", "fp32"], {"dtype": "bf16"},
                  lambda ds: ds["bf16"]["enabled"]),
    "global batch": (["--global-batch-pairs", "8"], {"train_batch_size": 8}, ["--global-batch-pairs", "16"],
                     {"global_batch_pairs": 8}, None),
    "micro batch": (["--micro-batch-pairs", "2"], {"train_micro_batch_size_per_gpu": 2}, ["--micro-batch-pairs", "3"],
                    {"micro_batch_pairs": 2}, None),
    # ZeRO's communication (run/engines.ZeroSpec): a config that leaves a key out gets the flag's value
    **{f"zero {key}": ([f"--{flag}", "200000000"], {"zero_optimization": {"stage": 3, key: 2e8}},
                       [f"--{flag}", "1000"], {flag.replace("-", "_"): 200_000_000},
                       lambda ds, key=key: ds["zero_optimization"][key])
       for key, flag in (("stage3_prefetch_bucket_size", "zero-prefetch-bucket-size"),
                         ("stage3_param_persistence_threshold", "zero-param-persistence-threshold"),
                         ("reduce_bucket_size", "zero-reduce-bucket-size"))},
    "zero overlap_comm": (["--no-zero-overlap-comm"], {"zero_optimization": {"stage": 3, "overlap_comm": False}},
                          ["--zero-overlap-comm"], {"zero_overlap_comm": False},
                          lambda ds: ds["zero_optimization"]["overlap_comm"]),
}
# What DeepSpeed is handed, per case (the batch keys: one planned row per forward, whatever the pairs).
EXPECTED_IN_DS = {"optimizer type": "SGD", "lr": (1e-4, 1e-4), "betas": [0.8, 0.9], "eps": 1e-6,
                  "weight decay": 0.05, "gradient clipping": 0.5, "scheduler type": "WarmupCosineLR", "warm-up": 3,
                  "peak of the schedule": 2e-4, "floor of the schedule": (0.1, 0.1), "precision": True,
                  "zero stage3_prefetch_bucket_size": 200_000_000, "zero stage3_param_persistence_threshold": 200_000_000,
                  "zero reduce_bucket_size": 200_000_000, "zero overlap_comm": False}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
@pytest.mark.parametrize("places", ["flags", "ds config", "both alike"])
def test_a_value_written_once_or_twice_alike_runs(case, places):
    flags, ds, _, settings, read = CASES[case]
    cfg, filled = resolve([] if places == "ds config" else flags, {} if places == "flags" else ds)
    for name, value in settings.items():
        assert getattr(cfg, name) == value, name
        assert cfg.is_given(name)
    if read is not None:
        assert read(filled) == EXPECTED_IN_DS[case]
    assert (filled["train_batch_size"], filled["train_micro_batch_size_per_gpu"],
            filled["gradient_accumulation_steps"]) == (DP, 1, 1)


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_a_value_written_differently_twice_is_one_error_naming_both(case):
    flags, ds, other, settings, _ = CASES[case]
    with pytest.raises(InputError) as error:
        resolve(other, ds)
    message = str(error.value)
    named = other[-2] if len(other) > 1 else other[0]  # a value's flag, or a boolean's spelling
    assert "\n" not in message and "ds.json" in message and named in message, message


def test_a_default_never_contradicts_the_file():
    """The issue's report: the file's lr 1e-4 and weight decay run under the default schedule (the flags' defaults
    1e-6 and 0.0 neither win nor clash); a whole WarmupDecayLR section is taken as the flags it stands for."""
    cfg, filled = resolve([], {"optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
                               "scheduler": {"type": "WarmupDecayLR",
                                             "params": {"warmup_num_steps": 4, "warmup_max_lr": 1e-4,
                                                        "warmup_min_lr": 1e-5, "warmup_type": "linear"}}})
    assert (cfg.lr, cfg.weight_decay, cfg.lr_scheduler, cfg.warmup_steps) == (1e-4, 0.01, "linear", 4)
    assert cfg.min_lr_ratio * cfg.lr == pytest.approx(1e-5, rel=1e-12)
    assert filled["scheduler"]["params"]["warmup_min_lr"] == pytest.approx(1e-5, rel=1e-12)
    assert specs.schedule(cfg, 10).describe() == "linear lr 0.0001 to 1e-05 over 10 steps, warm-up 4 steps"
    # the command: --lr 1e-3 against the file's 1e-4 is refused, not trained at 1e-4
    with pytest.raises(InputError, match=r"'optimizer.params.lr': 0.0001 and --lr 0.001 differ"):
        resolve(["--lr", "1e-3", "--lr-scheduler", "constant"], {"optimizer": {"params": {"lr": 1e-4}}})


def test_zero_settings_default_to_the_hidden_size_rule_and_the_builtin_configs_auto():
    """Without --zero-* flags the built-in config's "auto" buckets follow the hidden size and overlap_comm is on;
    the built-in configs write "auto" (not a value of the user's), so --no-zero-overlap-comm is taken, not refused;
    a config's value of the wrong kind is one line."""
    builtin = {"zero_optimization": {"stage": 3, "overlap_comm": "auto", "reduce_bucket_size": "auto",
                                     "stage3_prefetch_bucket_size": "auto",
                                     "stage3_param_persistence_threshold": "auto"}}
    _, filled = resolve([], builtin)
    zero = filled["zero_optimization"]
    assert (zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"], zero["stage3_param_persistence_threshold"],
            zero["overlap_comm"]) == (64 * 64, int(0.9 * 64 * 64), 640, True)
    _, filled = resolve(["--no-zero-overlap-comm", "--zero-param-persistence-threshold", "0"], builtin)
    assert filled["zero_optimization"]["overlap_comm"] is False
    assert filled["zero_optimization"]["stage3_param_persistence_threshold"] == 0
    for value, message in (("yes", "'zero_optimization.overlap_comm' must be true, false"),
                           (1.5, "'zero_optimization.reduce_bucket_size' must be a whole number >= 0")):
        key = "overlap_comm" if value == "yes" else "reduce_bucket_size"
        with pytest.raises(InputError, match=message):
            resolve([], {"zero_optimization": {"stage": 3, key: value}})


def test_accumulation_steps_count_pairs():
    """gradient_accumulation_steps: the global batch is micro x accumulation x data-parallel ranks (the HF habit)."""
    cfg, _ = resolve([], {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3})
    assert (cfg.micro_batch_pairs, cfg.global_batch_pairs) == (2, 2 * 3 * DP)
    cfg, _ = resolve([], {"train_batch_size": 24, "gradient_accumulation_steps": 3})
    assert (cfg.micro_batch_pairs, cfg.global_batch_pairs) == (4, 24)
    with pytest.raises(InputError, match="'train_batch_size': 20 is not micro-batch 2 x"):
        resolve([], {"train_batch_size": 20, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3})
    with pytest.raises(InputError, match="--tokens-per-step 4096 closes steps by tokens; give one"):
        resolve(["--tokens-per-step", "4096"], {"train_batch_size": 8})


@pytest.mark.parametrize("ds, message", [
    ({"scheduler": {"type": "OneCycle"}}, "'scheduler.type': 'OneCycle' is not one ds_packdpo runs"),
    ({"scheduler": {"params": {"total_num_steps": 100}}}, "the run's steps come from the plan"),
    ({"scheduler": {"params": {"warmup_type": "log"}}}, "the warm-up is linear"),
    ({"scheduler": {"params": {"warmup_num_steps": 3}}}, "and --warmup-ratio 0.1 both set the warm-up"),
    ({"optimizer": {"params": {"betas": [0.9]}}}, "'optimizer.params.betas' must be two numbers"),
    ({"optimizer": {"params": {"lr": 1e-3}}, "scheduler": {"params": {"warmup_max_lr": 1e-4}}},
     "'scheduler.params.warmup_max_lr': 0.0001 and 'optimizer.params.lr' differ"),
    ({"fp16": {"enabled": True}}, "fp16 is not supported"),
    ({"optimizer": {"type": 7}}, "'optimizer.type' must be a name, got 7"),
    ({"optimizer": {"params": {"lr": 0}}, "scheduler": {"params": {"warmup_min_lr": 0}}},
     "which must be > 0, got 0"),
    ({"optimizer": {"params": {"weight_decay": -1}}}, "--weight-decay must be >= 0, got -1 (after taking"),
])
def test_what_no_flag_can_say_is_refused(ds, message):
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve(["--warmup-ratio", "0.1"] if "warmup_num_steps" in json.dumps(ds) else [], ds)


def test_adam_flags_with_another_optimizer_are_refused(tmp_path):
    from ds_packdpo.run.assemble import prepare

    cfg = parse_train_args(["--optimizer", "SGD", "--adam-beta1", "0.8", "--output-dir", str(tmp_path / "o")])
    with pytest.raises(InputError, match="--adam-beta1 with --optimizer SGD: they configure Adam and AdamW only"):
        prepare(cfg, world_size=1)
    _, filled = resolve(["--optimizer", "SGD"], {})  # the built-in configs' Adam keys are dropped for SGD
    assert filled["optimizer"] == {"type": "SGD", "params": {"lr": 1e-6, "weight_decay": 0.0}}


# ----------------------------------------------------------------------------- what ran, read back
@pytest.mark.multirank
def test_reported_values_are_the_ones_that_ran(tmp_path):
    """One one-rank run whose precision, batch, optimizer, lr, betas, eps, weight decay, clipping and warm-up come
    from the user's DeepSpeed config and the flags: metrics.jsonl (the figures read from the engine) agrees with
    run_config.json, plan_summary.json and the plan line; --report-to csv writes DeepSpeed's csv monitor."""
    ds = {"zero_optimization": {"stage": 3}, "gradient_clipping": 0.25, "bf16": {"enabled": True},
          "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01, "betas": [0.8, 0.9]}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}}}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    out = tmp_path / "run"
    flags = [f for i, f in enumerate(SMALL_RUN) if f not in ("--global-batch-pairs", "--dtype")
             and SMALL_RUN[i - 1] not in ("--global-batch-pairs", "--dtype")]
    proc = run(rank_module("ds_packdpo.train", *flags, "--lr", "1e-4", "--adam-epsilon", "1e-6", "--output-dir",
                           str(out), "--cache-dir", str(tmp_path / "cache"), "--ds-config", str(tmp_path / "ds.json"),
                           "--report-to", "csv", "--run-name", "values"))
    records = read_metrics(out / "metrics.jsonl")
    settings = json.loads((out / "run_config.json").read_text())
    schedule = json.loads((out / "plan_summary.json").read_text())["schedule"]
    first = records[0]
    assert first["dtype"] == settings["dtype"] == "bf16"
    assert [r["pairs"] for r in records] == [8, 8, 8]  # 2 pairs a micro-batch x 4 accumulation steps x 1 rank
    assert (settings["global_batch_pairs"], settings["micro_batch_pairs"]) == (8, 2)
    assert (first["optimizer"], first["adam_betas"], first["adam_epsilon"]) == ("AdamW", [0.8, 0.9], 1e-6)
    assert (first["weight_decay"], first["max_grad_norm"]) == (0.01, 0.25)
    assert (settings["optimizer"], [settings["adam_beta1"], settings["adam_beta2"]], settings["adam_epsilon"]) == (
        "AdamW", [0.8, 0.9], 1e-6)
    assert (settings["weight_decay"], settings["max_grad_norm"], settings["lr"]) == (0.01, 0.25, 1e-4)
    assert (settings["lr_scheduler"], settings["warmup_steps"]) == ("constant", 4)
    assert schedule == {"kind": "constant", "peak": 1e-4, "warmup_steps": 4, "total_steps": 3, "min_lr_ratio": 0.0}
    assert [r["learning_rate"] for r in records] == pytest.approx([2.5e-5, 5e-5, 7.5e-5], rel=1e-12)
    assert "schedule: constant lr 0.0001 over 3 steps, warm-up 4 steps" in proc.stdout
    # --report-to csv: DeepSpeed's csv monitor, named after the run, holds the same per-step figures
    logged = (out / "values" / "Train_learning_rate.csv").read_text().splitlines()[1:]
    assert [float(line.split(",")[1]) for line in logged] == pytest.approx([r["learning_rate"] for r in records])
    # the run's own settings are accepted back by --config: the same run
    again = parse_train_args(["--config", str(out / "run_config.json")])
    assert {k: getattr(again, k) for k in settings} == settings


def test_report_to_is_deepspeeds_monitors_by_the_same_rule(tmp_path):
    """--report-to fills DeepSpeed's monitor sections (named after the run, under the output folder, in --project);
    a config's own monitor sections still run, and are --report-to's value; both written differently: one error."""
    out = str(tmp_path / "my-run")
    cfg, filled = resolve(["--report-to", "csv,wandb,tensorboard", "--project", "dpo", "--output-dir", out], {})
    assert filled["csv_monitor"] == {"enabled": True, "output_path": out, "job_name": "my-run"}
    assert filled["tensorboard"] == {"enabled": True, "output_path": out, "job_name": "my-run"}
    assert filled["wandb"] == {"enabled": True, "group": "my-run", "project": "dpo"}
    cfg, filled = resolve(["--run-name", "r1", "--output-dir", out], {"comet": {"enabled": True, "online": False}})
    assert cfg.report_to == "comet" and cfg.is_given("report_to")
    assert filled["comet"] == {"enabled": True, "online": False, "experiment_name": "r1"}
    cfg, _ = resolve(["--report-to", "comet"], {"comet": {"enabled": True}})  # alike
    with pytest.raises(InputError, match="'csv_monitor.enabled': True and --report-to wandb differ"):
        resolve(["--report-to", "wandb"], {"csv_monitor": {"enabled": True}})
    with pytest.raises(InputError, match="--report-to: mlflow is not one of tensorboard, wandb, csv, comet"):
        resolve(["--report-to", "csv,mlflow"], {})
    with pytest.raises(InputError, match="--project dpo names a wandb or comet project"):
        resolve(["--report-to", "csv", "--project", "dpo"], {})


def test_a_yaml_deepspeed_config_follows_the_rule(tmp_path):
    """--ds-config ds.yaml reads as its JSON twin (1e-4 a number, as JSON has it, not YAML 1.1's string)."""
    from ds_packdpo.run.engines import load_ds_config

    (tmp_path / "ds.yaml").write_text("zero_optimization:\n  stage: 3\noptimizer:\n  type: AdamW\n  params:\n"
                                      "    lr: 1e-4\n    betas: [0.8, 0.9]\ngradient_clipping: 0.5\n")
    raw, source = load_ds_config(str(tmp_path / "ds.yaml"))
    cfg, _ = with_ds_values(parse_train_args([]), raw, source, DP)
    assert (cfg.lr, cfg.adam_beta1, cfg.adam_beta2, cfg.max_grad_norm) == (1e-4, 0.8, 0.9, 0.5)
