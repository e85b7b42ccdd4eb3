"""TR-DPO (--sync-ref-model, run/reference_sync.py): the shard-wise mix against the whole-tensor one, what each flag
changes, one trajectory over layouts, an exact kill-resume, and the refusals before any rank starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from launching import SMALL_RUN, cpu_env, rank_module, ranks_module, ranks_script, read_metrics, run
import specs
from test_bad_input import out_dir, snapshot, tokenizer_dir, train_front  # noqa: F401 (fixtures)
from test_bad_input import assert_one_line_error
from test_checkpoint import assert_same_steps, fake_checkpoint
from transformers import AutoModelForCausalLM

from ds_packdpo import cli
from ds_packdpo.config import parse_train_args
from ds_packdpo.errors import InputError
from ds_packdpo.model.build import build_model, tiny_config
from ds_packdpo.run.assemble import ref_sync
from ds_packdpo.run.checkpoint import LATEST, STATE_FILE
from ds_packdpo.run.layout import ParallelLayout
from ds_packdpo.run.manifest import read_manifest
from ds_packdpo.run.reference_sync import ReferenceSync, RefSync

SYNC_EVERY_STEP = ("--sync-ref-model", "--ref-model-sync-steps", "1", "--ref-model-mixup-alpha", "0.5")
COMPARED = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen")


def flags(tmp_path: Path, out: str, *extra: str) -> list[str]:
    return ["--output-dir", str(tmp_path / out), "--cache-dir", str(tmp_path / "cache"), *SMALL_RUN, *extra]


@pytest.fixture(scope="module")
def sync_every_two_steps(tmp_path_factory) -> dict:
    """tests/trdpo_check.py's report: 3 steps on 2 ranks syncing with alpha 1 every 2 steps (steps 1 and 2 against
    the initial reference, as a run without TR-DPO), then its mixes of the trained engines."""
    tmp = tmp_path_factory.mktemp("trdpo_check")
    out = tmp / "check.json"
    run(ranks_script(2, "tests/trdpo_check.py", str(out), *flags(tmp, "run", "--sync-ref-model",
                                                                 "--ref-model-sync-steps", "2",
                                                                 "--ref-model-mixup-alpha", "1")))
    return json.loads(out.read_text())


@pytest.mark.multirank
def test_mix_of_partitions_equals_the_whole_tensor_mix(sync_every_two_steps, capsys):
    """2 ranks, ZeRO-3: after 3 trained steps with alpha 1 every 2 steps, each rank's partitions mixed with alpha
    0.3 equal the mix of the gathered whole tensors (exact in fp32; TRL's own arithmetic within an ulp), the policy
    untouched; a mix with alpha 1 makes the reference's log-probs the policy's, exactly.  The trained steps show
    both flags: the reference equals the policy after step 2 (rewards of step 3 exactly 0), not after step 1."""
    report = sync_every_two_steps
    history = report["history"]
    assert [r["step"] for r in history] == [1, 2, 3]
    for step, record in enumerate(history, start=1):
        zero = record["rewards/chosen"] == 0.0 and record["rewards/rejected"] == 0.0
        assert zero is (step != 2), (step, record["rewards/chosen"], record["rewards/rejected"])
    assert history[2]["loss"] == history[0]["loss"] == pytest.approx(0.693147, abs=1e-6)
    assert report["partitioned"] and report["persistent"] > 0  # both kinds of ZeRO-3 parameters were mixed
    assert report["before_max_diff"] > 1e-5  # the policy had moved from the reference
    assert report["mix_max_diff"] == 0.0
    assert report["trl_max_diff"] < 1e-6
    assert report["policy_unchanged"]
    assert report["alpha1_weights_equal"] and report["alpha1_logps_max_diff"] == 0.0
    with capsys.disabled():
        print(f"\nTR-DPO 2 ranks ZeRO-3: shard-wise vs whole-tensor mix max diff {report['mix_max_diff']}, vs TRL's "
              f"SyncRefModelCallback arithmetic {report['trl_max_diff']:.3g} ({report['parameters']} parameters, "
              f"{report['persistent']} persistent)")


@pytest.mark.multirank
def test_trajectory_over_layouts_and_exact_kill_resume(tmp_path, capsys, sync_every_two_steps, two_rank_run):
    """Syncing every step with alpha 0.5: 1 rank and 2 ranks (ZeRO-3) give one trajectory, which leaves the fixed
    reference's at step 2; a 2-rank run killed as step 3 begins (checkpoint at step 2, holding each rank's reference
    partitions) and resumed equals the uninterrupted run exactly.  A run without TR-DPO saves no reference (the
    2-rank run of conftest.py)."""
    fixed_tag = two_rank_run / "checkpoints" / "global_step3"
    assert "ref_sync" not in json.loads((fixed_tag / STATE_FILE).read_text())
    assert not list(fixed_tag.glob("reference_rank*"))
    # the fixed reference's steps 1 and 2 at 2 ranks: those of the run syncing after step 2 (its flags otherwise these)
    fixed = sync_every_two_steps["history"]
    run(rank_module("ds_packdpo.train", *flags(tmp_path, "w1", *SYNC_EVERY_STEP)))
    one_rank = read_metrics(tmp_path / "w1" / "metrics.jsonl")
    run(ranks_module(2, "ds_packdpo.train", *flags(tmp_path, "straight", *SYNC_EVERY_STEP, "--save-steps", "2")))
    straight = read_metrics(tmp_path / "straight" / "metrics.jsonl")
    for ref, got in zip(one_rank, straight, strict=True):
        for key in COMPARED:
            assert got[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), (got["step"], key, got[key], ref[key])
    assert straight[0]["loss"] == pytest.approx(fixed[0]["loss"], rel=1e-12)  # nothing synced before step 1
    assert straight[1]["rewards/chosen"] != pytest.approx(fixed[1]["rewards/chosen"], rel=1e-2)

    killed = tmp_path / "killed"
    proc = run(ranks_module(2, "ds_packdpo.train", *flags(tmp_path, "killed", *SYNC_EVERY_STEP, "--save-steps", "2")),
               check=False, env=cpu_env(DS_PACKDPO_FAULT_KILL="1:3"))
    assert proc.returncode != 0
    tag = killed / "checkpoints" / "global_step2"
    assert (killed / "checkpoints" / LATEST).read_text() == "global_step2"
    assert json.loads((tag / STATE_FILE).read_text())["ref_sync"] == {"alpha": 0.5, "every": 1}
    assert {"reference_rank0.safetensors", "reference_rank1.safetensors"} <= set(read_manifest(tag)["files"])
    run(ranks_module(2, "ds_packdpo.train", *flags(tmp_path, "killed", *SYNC_EVERY_STEP, "--save-steps", "2",
                                                   "--resume", "auto")))
    resumed = read_metrics(killed / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3]
    largest = assert_same_steps(resumed, straight, range(1, 4))
    assert largest == 0.0
    with capsys.disabled():
        print(f"\nTR-DPO: 1 vs 2 ranks largest relative difference "
              f"{max(abs(g[k] - r[k]) / max(abs(r[k]), 1e-6) for r, g in zip(one_rank, straight) for k in COMPARED):.3g}"
              f"; killed and resumed vs uninterrupted largest difference {largest}")


def test_resume_keeps_the_sync_settings_and_the_layout(tmp_path):
    """Phase one: a TR-DPO checkpoint resumed without --sync-ref-model (or with other settings), or a fixed
    reference's resumed with it, is refused; so is a TR-DPO checkpoint at another layout (its reference is saved as
    that layout's partitions)."""
    run_flags = ["--output-dir", str(tmp_path / "out"), "--dtype", "fp32"]

    def resume(record, world_size: int, *extra: str):
        tag_dir = tmp_path / f"{json.dumps(record)}{world_size}".replace(" ", "").replace('"', "") / "global_step4"
        if not tag_dir.exists():
            state = {} if record is None else {"ref_sync": record}
            fake_checkpoint(tag_dir, 2, 2, dtype="fp32", bad_steps=0, **state,
                            plan_fingerprint=specs.fingerprint(parse_train_args(run_flags), "data"),
                            position={"epoch": 0, "epoch_step": 4, "global_step": 4})
            for rank in range(2):  # after the manifest: it lists the fake files, these are only looked for
                (tag_dir / f"reference_rank{rank}.safetensors").write_bytes(b"")
        cfg = parse_train_args([*run_flags, "--resume", str(tag_dir), *extra])
        return specs.resume(cfg, "data", ParallelLayout(world_size=world_size, zero_stage=3))

    synced = RefSync(0.6, 512).record()
    assert resume(synced, 2, "--sync-ref-model").global_step == 4
    with pytest.raises(InputError, match=r"written with --sync-ref-model alpha 0.6 every 512 steps, this run has a "
                                         r"fixed reference \(no --sync-ref-model\)"):
        resume(synced, 2)
    with pytest.raises(InputError, match="this run has --sync-ref-model alpha 0.6 every 4 steps"):
        resume(synced, 2, "--sync-ref-model", "--ref-model-sync-steps", "4")
    with pytest.raises(InputError, match="written with a fixed reference"):
        resume(None, 2, "--sync-ref-model")
    with pytest.raises(InputError, match="TR-DPO reference is saved as the partitions of 2 ranks"):
        resume(synced, 1, "--sync-ref-model", "--allow-new-layout")


def save_tiny_model(folder: Path, tokenizer, **overrides) -> str:
    AutoModelForCausalLM.from_config(tiny_config(vocab_size=len(tokenizer), **overrides)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


BAD_SYNC = {
    "alpha without the flag": (lambda d: ["--ref-model-mixup-alpha", "0.3"],
                               "--ref-model-mixup-alpha without --sync-ref-model has no effect"),
    "steps without the flag": (lambda d: ["--ref-model-sync-steps", "4"],
                               "--ref-model-sync-steps without --sync-ref-model has no effect"),
    "alpha above 1": (lambda d: ["--sync-ref-model", "--ref-model-mixup-alpha", "1.5"],
                      "--ref-model-mixup-alpha must be in [0, 1], got 1.5"),
    "alpha below 0": (lambda d: ["--sync-ref-model", "--ref-model-mixup-alpha", "-0.1"],
                      "--ref-model-mixup-alpha must be in [0, 1], got -0.1"),
    "no steps": (lambda d: ["--sync-ref-model", "--ref-model-sync-steps", "0"],
                 "--ref-model-sync-steps must be >= 1, got 0"),
    "LoRA": (lambda d: ["--sync-ref-model", "--lora-r", "4"], "--sync-ref-model with --lora-r"),
    "precomputed reference": (lambda d: ["--sync-ref-model", "--ref-logps", str(d / "ref.jsonl")],
                              "--sync-ref-model with --ref-logps"),
    "reference-free loss": (lambda d: ["--sync-ref-model", "--loss", "simpo"],
                            "--sync-ref-model with --loss simpo: SimPO is reference-free"),
    "parameters on NVMe": (lambda d: ["--sync-ref-model", "--ds-config", _zero3_config(d, offload_param={
        "device": "nvme", "nvme_path": str(d)})], "--sync-ref-model with parameters offloaded to NVMe"),
    "hierarchical partitions": (lambda d: ["--sync-ref-model", "--ds-config", _zero3_config(
        d, zero_hpz_partition_size=2)], "--sync-ref-model with 'zero_optimization.zero_hpz_partition_size': 2"),
}


def _zero3_config(folder: Path, **zero) -> str:
    path = folder / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, **zero}}))
    return str(path)


@pytest.mark.parametrize("case", list(BAD_SYNC), ids=list(BAD_SYNC))
def test_sync_settings_refused(case, tmp_path, train_front):  # noqa: F811 (the fixture)
    (tmp_path / "ref.jsonl").write_text("")
    make, expected = BAD_SYNC[case]
    train_front(*make(tmp_path), parts=(expected,))


def test_sync_needs_a_reference_of_the_policys_architecture(tmp_path, train_front, demo_tokenizer):  # noqa: F811
    """A --ref-model with other parameters cannot be mixed into: refused in phase one, naming the first that
    differs; one of the policy's architecture passes phase one (the tripwire launcher is reached)."""
    policy = save_tiny_model(tmp_path / "policy", demo_tokenizer)
    other = save_tiny_model(tmp_path / "other", demo_tokenizer, intermediate_size=96)
    train_front("--model", policy, "--ref-model", other, "--sync-ref-model", "--tokenizer", policy,
                parts=(f"--sync-ref-model with --ref-model {other}: the reference must have the policy's "
                       "architecture to be mixed into (its model.layers.0.mlp.gate_proj.weight is [96, 64], the "
                       "policy's [256, 64])",))


def test_only_train_mixes_the_reference(tmp_path, no_launch, capsys, demo_tokenizer):
    """bench, eval and precompute-ref run a fixed reference: --sync-ref-model is refused there in phase one (eval and
    precompute-ref train nothing: command_settings.py)."""
    model = save_tiny_model(tmp_path / "model", demo_tokenizer)
    for argv, why in ((["bench", "--out", str(tmp_path / "bench")], "bench runs a fixed reference"),
                      (["eval", "--model", model, "--ref-model", model], "eval runs forward only"),
                      (["precompute-ref", "--out", str(tmp_path / "ref.jsonl")], "precompute-ref runs the reference")):
        assert cli.main([*argv, "--synthetic-pairs", "16", "--cache-dir", str(tmp_path / "cache"),
                         "--sync-ref-model"]) == 2
        assert_one_line_error(2, capsys.readouterr().err, f"--sync-ref-model: {why}")
        assert not (tmp_path / "bench").exists() and not (tmp_path / "ref.jsonl").exists()


def test_sync_settings_are_a_unit():
    """The settings' record (a checkpoint's) and the schedule: due after every N-th step only."""
    sync = ref_sync(parse_train_args(["--sync-ref-model", "--ref-model-sync-steps", "3"]))
    assert [s for s in range(1, 10) if sync.due(s)] == [3, 6, 9]
    assert sync.record() == {"alpha": 0.6, "every": 3}  # TRL's default alpha
    assert ref_sync(parse_train_args([])) is None


def test_whole_modules_mix_save_and_load(tmp_path):
    """ZeRO 0-2 (and one process): the reference is a whole module, mixed as it is on schedule, saved by rank 0 and
    loaded back exactly; modules with other parameters are refused."""
    policy, reference = (build_model(None, "tiny", 128, torch.float32, "sdpa", seed=seed) for seed in (0, 1))
    before = {name: p.detach().clone() for name, p in reference.named_parameters()}
    sync = ReferenceSync(RefSync(0.3, 2), policy, reference)
    assert not sync.after_step(1)
    assert all(torch.equal(p, before[n]) for n, p in reference.named_parameters())
    assert sync.after_step(2)
    pol = dict(policy.named_parameters())
    for name, param in reference.named_parameters():
        assert torch.equal(param, before[name] * 0.7 + pol[name] * 0.3), name
    mixed = {name: p.detach().clone() for name, p in reference.named_parameters()}
    assert sync.save(tmp_path, rank=1) is None  # whole copies: rank 0's alone
    assert sync.save(tmp_path, rank=0).name == "reference_rank0.safetensors"
    with torch.no_grad():
        for param in reference.parameters():
            param.zero_()
    sync.load(tmp_path, rank=1)
    assert all(torch.equal(p, mixed[n]) for n, p in reference.named_parameters())
    other = AutoModelForCausalLM.from_config(tiny_config(vocab_size=128, layers=1))
    with pytest.raises(RuntimeError, match="the policy's and the reference's parameters differ"):
        ReferenceSync(RefSync(0.3, 2), policy, other)
