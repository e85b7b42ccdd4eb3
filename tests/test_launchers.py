"""The scripts of launch/: what each hands to its launcher, and real jobs started through them.

Three real launches (slow start-up), each checking several things: a two-node job simulated
on this machine (launch/multinode.sh, a hostfile of two 1-slot hosts, one launcher per node
with --no_ssh), the same job under mpirun (launch/mpirun.sh), and one bf16 job through
launch/local.sh with an offloaded reference and DeepSpeed's csv monitor.
"""

from __future__ import annotations

import contextlib
import csv
import importlib.util
import json
import math
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
from launching import REPO, SMALL_RUN, cpu_env, free_port, launch_script, read_metrics, run, run_together
import specs

from ds_packdpo import cli
from ds_packdpo.config import parse_train_args
from ds_packdpo.run.engines import load_ds_config, reference_ds_config
from ds_packdpo.run.launch_group import LaunchOutcome

LN2 = math.log(2.0)
COMPARED = ("loss", "grad_norm", "rewards/margins")
# A user string that a shell would expand if any script evaluated it.
HOSTILE = "$(touch pwned) `touch pwned` ; *"


def train_flags(tmp: Path, out: Path, *extra: str) -> list[str]:
    return ["--output-dir", str(out), "--cache-dir", str(tmp / "cache"), *SMALL_RUN, *extra]


# ---------------------------------------------------------------- what the scripts hand to their launcher
FAKE_TOOLS = {
    # deepspeed and mpirun only print what they were handed (deepspeed: and the environment file it would read)
    "deepspeed": "env_file = os.environ.get('DS_ENV_FILE')\n"
                 "print(json.dumps({'argv': sys.argv[1:], 'MASTER_ADDR': os.environ.get('MASTER_ADDR'), "
                 "'MASTER_PORT': os.environ.get('MASTER_PORT'), 'FROM_OPTION': os.environ.get('FROM_OPTION'), "
                 "'DS_ENV_FILE': env_file, 'env_file': open(env_file).read() if env_file else None}))",
    "mpirun": "print(json.dumps({'argv': sys.argv[1:], 'MASTER_ADDR': os.environ.get('MASTER_ADDR'), "
              "'MASTER_PORT': os.environ.get('MASTER_PORT')}))",
    # Slurm: the node list is comma-separated host names, node N's address "10.0.0.N" (NodeAddr); `show job` says
    # whether the job was pre-empted (FAKE_PREEMPTED), `requeue` prints what it would requeue
    "scontrol": "args = sys.argv[1:]\n"
                "if args[:2] == ['show', 'hostnames']: print('\\n'.join(args[2].split(',')))\n"
                "elif args[:2] == ['show', 'node']: print(f'NodeName={args[2]} Arch=x86_64\\n   NodeAddr=10.0.0.'"
                " f'{args[2][-1]} NodeHostName={args[2]}')\n"
                "elif args[:2] == ['show', 'job']: print(f'JobId={args[2]}\\n   PreemptEligibleTime=2026-01-01T00:00:00'"
                " f' PreemptTime={os.environ.get(\"FAKE_PREEMPTED\", \"None\")}')\n"
                "elif args[0] == 'requeue': print(json.dumps({'requeued': args[1]}))\n"
                "else: sys.exit(f'scontrol stand-in: {args}')",
    # srun runs its command once per task (SLURM_NNODES x SLURM_NTASKS_PER_NODE), one after the other, each with the
    # variables Slurm gives a task; its status is the largest of theirs
    "srun": "cmd = sys.argv[next(i for i, a in enumerate(sys.argv) if i and not a.startswith('--')):]\n"
            "nodes, per_node = int(os.environ['SLURM_NNODES']), int(os.environ['SLURM_NTASKS_PER_NODE'])\n"
            "sys.exit(max(subprocess.call(cmd, env={**os.environ, 'SLURM_PROCID': str(task), 'SLURM_LOCALID':"
            " str(task % per_node), 'SLURM_NODEID': str(task // per_node), 'SLURM_NTASKS': str(nodes * per_node)})\n"
            "             for task in range(nodes * per_node)))",
}


@pytest.fixture
def fake_tools(tmp_path):
    """A PATH with stand-ins for the launchers (see FAKE_TOOLS); returns a function running a launch script."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in FAKE_TOOLS.items():
        tool = bin_dir / name
        tool.write_text(f"#!{sys.executable}\nimport json, os, subprocess, sys\n{body}\n")
        tool.chmod(0o755)

    def call(script: str, *args: str, **env: str) -> subprocess.CompletedProcess:
        base = {k: v for k, v in cpu_env().items()
                if k not in ("MASTER_ADDR", "MASTER_PORT", "NUM_GPUS", "HOSTFILE", "NODE_RANK", "NO_SSH", "NP")
                and not k.startswith("SLURM_")}
        base["PATH"] = f"{bin_dir}{os.pathsep}{base['PATH']}"
        return subprocess.run(launch_script(script, *args), cwd=tmp_path, env={**base, **env}, capture_output=True,
                              text=True, timeout=60)

    return call


def handed(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def assert_free_port(port: str) -> None:
    assert port != "29500"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", int(port)))  # nobody holds it


def test_scripts_pass_user_strings_unchanged(fake_tools, tmp_path):
    user = ["--dataset", "my prefs.json", "--run-name", HOSTILE]
    got = handed(fake_tools("local.sh", *user, NUM_GPUS="4"))["argv"]
    port = got[got.index("--master_port") + 1]
    assert got == ["--master_port", port, "--num_gpus", "4", "--module", "ds_packdpo.train", *user]
    assert_free_port(port)

    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1 slots=8\nnode2 slots=8\n")
    got = handed(fake_tools("multinode.sh", "--exclude", "node2:7", "--master_addr", "node1", "--", *user,
                            HOSTFILE=str(hostfile)))["argv"]
    assert got == ["--hostfile", str(hostfile), "--master_port", "29500", "--exclude", "node2:7", "--master_addr",
                   "node1", "--module", "ds_packdpo.train", *user]
    got = handed(fake_tools("multinode.sh", "--hostfile", str(hostfile), "--no_ssh", "--node_rank", "1",
                            "--master_addr", "10.0.0.1", "--master_port", "29600", *user))["argv"]
    assert got == ["--hostfile", str(hostfile), "--master_port", "29600", "--master_addr", "10.0.0.1",
                   "--no_ssh", "--node_rank", "1", "--module", "ds_packdpo.train", *user]

    mpi = handed(fake_tools("mpirun.sh", "-n", "2", "--", *user))
    assert mpi["argv"][:4] == ["-n", "2", "--bind-to", "none"]
    assert mpi["argv"][-len(user) - 5:] == ["python", "-m", "mpi4py", "-m", "ds_packdpo.train", *user]
    assert ("--allow-run-as-root" in mpi["argv"]) == (os.getuid() == 0)
    assert mpi["MASTER_ADDR"] == "127.0.0.1"  # one node: loopback, on a free port, both exported to the ranks
    assert_free_port(mpi["MASTER_PORT"])
    assert {"MASTER_ADDR", "MASTER_PORT", "PATH", "PYTHONPATH"} <= {
        mpi["argv"][i + 1] for i, a in enumerate(mpi["argv"]) if a == "-x"}
    assert not (tmp_path / "pwned").exists()


def test_slurm_job_runs_one_rank_per_task(fake_tools, tmp_path):
    """launch/slurm.sbatch: srun starts every rank itself, its rank, local rank and world size those of its task, the
    rendezvous at the first node's address; a pre-empted job whose ranks stopped (exit 7) requeues itself, any other
    stop ends the job with the ranks' status."""
    rank_bin = tmp_path / "rank_bin"  # `python` as srun's tasks run it: prints what it was handed, exits FAKE_EXIT
    rank_bin.mkdir()
    (rank_bin / "python").write_text(f"#!{sys.executable}\nimport json, os, sys\nprint(json.dumps({{'argv': sys.argv[1:],"
                                     " **{k: os.environ.get(k) for k in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', "
                                     "'MASTER_ADDR', 'MASTER_PORT')}}))\nsys.exit(int(os.environ.get('FAKE_EXIT', 0)))\n")
    (rank_bin / "python").chmod(0o755)
    user = ["--dataset", "my prefs.json", "--run-name", HOSTILE]
    job = {"SLURM_SUBMIT_DIR": str(REPO), "SLURM_JOB_ID": "123456", "SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "2",
           "SLURM_JOB_NODELIST": "gpu-1,gpu-2",
           "PATH": os.pathsep.join((str(rank_bin), str(tmp_path / "bin"), cpu_env()["PATH"]))}  # then the stand-ins

    def submit(**env: str) -> tuple[int, list[dict]]:
        proc = fake_tools("slurm.sbatch", *user, **job, **env)
        assert proc.returncode in (0, 7), proc.stderr
        return proc.returncode, [json.loads(line) for line in proc.stdout.splitlines()]

    code, printed = submit()
    assert code == 0 and len(printed) == 4
    for rank, handed_to in enumerate(printed):
        assert handed_to == {"argv": ["-u", "-m", "ds_packdpo.train", *user], "RANK": str(rank),
                             "LOCAL_RANK": str(rank % 2), "WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1",
                             "MASTER_PORT": "23456"}
    assert not (tmp_path / "pwned").exists()

    code, printed = submit(FAKE_EXIT="7")  # stopped by a signal, not pre-empted: the job ends with the ranks' 7
    assert code == 7 and len(printed) == 4
    code, printed = submit(FAKE_EXIT="7", FAKE_PREEMPTED="2026-01-01T00:00:09")  # pre-empted: requeued, then 7
    assert code == 7 and printed[4:] == [{"requeued": "123456"}]
    code, printed = submit(FAKE_PREEMPTED="2026-01-01T00:00:09")  # pre-empted after the last step: done, no requeue
    assert code == 0 and len(printed) == 4


def test_multinode_hands_the_job_environment_to_other_nodes(fake_tools, tmp_path):
    """launch/multinode.sh with ssh: DeepSpeed's environment file holds what the ranks on other nodes need of this
    shell, then the user's .deepspeed_env files (home, then here: DeepSpeed's order), then --export, and nothing of it
    is left on disk; with --no_ssh each node's launcher passes its own environment, --export included."""
    home, tmp = tmp_path / "home", tmp_path / "tmp"
    home.mkdir()
    tmp.mkdir()
    (home / ".deepspeed_env").write_text("FROM_HOME=1\nSHARED=home")  # no newline at its end
    (tmp_path / ".deepspeed_env").write_text("SHARED=here\n")
    (tmp_path / "hosts").write_text("node1 slots=1\nnode2 slots=1\n")
    env = {"HOME": str(home), "TMPDIR": str(tmp), "EXISTING": "from this shell", "HF_HOME": "/data/hf",
           "LD_LIBRARY_PATH": "", "TORCH_EXTENSIONS_DIR": "/venv/ext"}
    got = handed(fake_tools("multinode.sh", "--hostfile", "hosts", "--export", "FROM_OPTION=two words", "--export",
                            "EXISTING", "--", "--max-steps", "1", **env))
    assert got["argv"][-4:] == ["--module", "ds_packdpo.train", "--max-steps", "1"]
    assert re.fullmatch(r"/dev/fd/\d+", got["DS_ENV_FILE"]) and not list(tmp.iterdir())  # read, then gone
    path = cpu_env()["PATH"]
    assert got["env_file"] == (f"PATH={tmp_path / 'bin'}{os.pathsep}{path}\nDS_ACCELERATOR=cpu\nHF_HOME=/data/hf\n"
                               "TORCH_EXTENSIONS_DIR=/venv/ext\nFROM_HOME=1\nSHARED=home\nSHARED=here\n"
                               "FROM_OPTION=two words\nEXISTING=from this shell\n")
    assert got["FROM_OPTION"] == "two words"  # this node's ranks too

    got = handed(fake_tools("multinode.sh", "--hostfile", "hosts", "--no_ssh", "--node_rank", "1", "--master_addr",
                            "node1", "--export", "FROM_OPTION=x", **env))
    assert got["DS_ENV_FILE"] is None and got["FROM_OPTION"] == "x"


@pytest.mark.parametrize("script, args, message", [
    ("multinode.sh", ["--hostfile", "HOSTS", "--export", "A=$(touch pwned)"], "the other nodes' shell would expand"),
    ("multinode.sh", ["--hostfile", "HOSTS", "--export", "NOT_SET_ANYWHERE"], "not set in this shell"),
    ("multinode.sh", ["--hostfile", "HOSTS", "--export", "1A=x"], "'1A' is not a variable name"),
    ("multinode.sh", ["--", "--max-steps", "1"], "--hostfile (or HOSTFILE) is required"),
    ("multinode.sh", ["--hostfile", "HOSTS", "--no_ssh", "--master_addr", "n1"], "--no_ssh needs --node_rank"),
    ("multinode.sh", ["--hostfile", "HOSTS", "--no_ssh", "--node_rank", "0"], "--no_ssh needs --master_addr"),
    ("multinode.sh", ["--hostfile", "HOSTS", "--include", "n1", "--exclude", "n2"], "mutually exclusive"),
    ("mpirun.sh", ["--hostfile", "/nonexistent/hosts"], "no such file"),
])
def test_scripts_refuse_incomplete_settings(fake_tools, tmp_path, script, args, message):
    (tmp_path / "HOSTS").write_text("n1 slots=1\nn2 slots=1\n")
    proc = fake_tools(script, *args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert proc.stdout == ""  # the launcher never started


def test_train_outside_a_launcher_picks_a_free_port(monkeypatch):
    """`ds-packdpo train` starts the deepspeed launcher itself: on a free port unless told one."""
    commands = []
    monkeypatch.setattr(cli, "run_launcher", lambda cmd, env, grace_s, on_line=None: commands.append(cmd) or LaunchOutcome(0))
    for key in cli.LAUNCHED_ENV:
        monkeypatch.delenv(key, raising=False)
    assert cli.main(["train", "--max-steps", "1"]) == 0
    assert cli.main(["train", "--master-port", "29611", "--max-steps", "1"]) == 0
    ports = [cmd[cmd.index("--master_port") + 1] for cmd in commands]
    assert_free_port(ports[0])
    assert ports[1] == "29611"


def test_reference_config_offloads_parameters_and_has_no_monitor(tmp_path):
    raw, source = load_ds_config("zero3")
    raw["csv_monitor"] = {"enabled": True, "output_path": "auto", "job_name": "csv"}
    cfg = parse_train_args(["--output-dir", str(tmp_path / "run"), "--dtype", "bf16", "--ref-offload"])
    policy = specs.ds_config(cfg, raw, source, 2, total_steps=10)
    assert policy["csv_monitor"]["output_path"] == str(tmp_path / "run")  # "auto": under the run's folder
    assert policy["bf16"] == {"enabled": True}
    reference = reference_ds_config(policy, offload=True)
    assert reference["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert not {"optimizer", "scheduler", "csv_monitor"} & set(reference)
    # --ref-whole: every reference parameter persistent (DeepSpeed reads the keys so), the policy's config untouched;
    # under ZeRO-2 the reference is a plain whole module already: nothing to change
    whole = DeepSpeedZeroConfig(**reference_ds_config(policy, offload=False, whole=True)["zero_optimization"])
    assert whole.param_persistence_threshold == whole.model_persistence_threshold == sys.maxsize
    assert policy["zero_optimization"].get("stage3_param_persistence_threshold") != sys.maxsize
    zero2, _ = load_ds_config("zero2")
    assert reference_ds_config(zero2, offload=False, whole=True) == reference_ds_config(zero2, offload=False)


# ---------------------------------------------------------------- real jobs
@pytest.fixture(scope="module")
def two_node_run(tmp_path_factory) -> list[dict]:
    """Two launcher processes, one per simulated node (both this machine), forming one world of 2."""
    tmp = tmp_path_factory.mktemp("two_nodes")
    hostfile = tmp / "hostfile"
    hostfile.write_text("# two 1-slot nodes; with --no_ssh the names only order the ranks\n"
                        "localhost slots=1\n127.0.0.1 slots=1\n")
    port = free_port()
    out = tmp / "out"
    run_together([launch_script("multinode.sh", "--hostfile", hostfile, "--no_ssh", "--node_rank", rank,
                                "--master_addr", "127.0.0.1", "--master_port", port, "--", *train_flags(tmp, out))
                  for rank in (0, 1)])
    return read_metrics(out / "metrics.jsonl")


def assert_world_of_two_learning(records: list[dict]) -> None:
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert r["pairs"] == 12
        # the plan dealt the step's tokens to 2 ranks, each pair's prompt once (prefix sharing)
        assert r["tokens"] - r["prompt_tokens_shared"] == 2 * r["mean_rank_tokens"] and r["prompt_tokens_shared"] > 0
        assert all(math.isfinite(r[k]) for k in COMPARED) and r["grad_norm"] > 0
    assert records[0]["loss"] == pytest.approx(LN2, abs=1e-6)  # policy == reference at step 1
    assert records[0]["loss"] > records[1]["loss"] > records[2]["loss"]


@pytest.mark.multirank
def test_two_nodes_and_mpirun_train_identically(two_node_run, tmp_path):
    out = tmp_path / "mpirun"
    with socket.socket() as default_port:
        # Hold DeepSpeed's default port: the ranks must meet on the one launch/mpirun.sh chose and exported.
        with contextlib.suppress(OSError):  # someone else holds it already: the same test
            default_port.bind(("", 29500))
            default_port.listen()
        run(launch_script("mpirun.sh", "-n", 2, "--", *train_flags(tmp_path, out)))
    mpi_run = read_metrics(out / "metrics.jsonl")
    assert_world_of_two_learning(two_node_run)
    assert_world_of_two_learning(mpi_run)
    for nodes, mpi in zip(two_node_run, mpi_run, strict=True):
        assert nodes["tokens"] == mpi["tokens"]
        for key in COMPARED:
            assert mpi[key] == pytest.approx(nodes[key], rel=1e-6, abs=1e-9), (nodes["step"], key)


@pytest.mark.multirank
def test_bf16_offloaded_reference_and_monitors(two_node_run, tmp_path):
    """One 2-rank bf16 job via launch/local.sh: ZeRO-3 reference offload, csv (and tensorboard) monitors."""
    ds = json.loads((REPO / "ds_configs" / "zero3.json").read_text())
    ds["csv_monitor"] = {"enabled": True, "output_path": "auto", "job_name": "csv"}
    tensorboard = importlib.util.find_spec("tensorboard") is not None
    if tensorboard:
        ds["tensorboard"] = {"enabled": True, "output_path": "auto", "job_name": "tb"}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    out = tmp_path / "bf16"
    run(launch_script("local.sh", *train_flags(tmp_path, out, "--dtype", "bf16", "--ref-offload",
                                               "--ds-config", str(tmp_path / "ds.json"))),
        env=cpu_env(NUM_GPUS="2"))
    records = read_metrics(out / "metrics.jsonl")

    # Trains: finite, loss falls; at step 1 the offloaded reference gives exactly the policy's log-probs.
    assert_world_of_two_learning(records)
    # Really bf16: near the fp32 trajectory of the same steps, but not equal to it.
    for low, full in zip(records, two_node_run, strict=True):
        assert low["tokens"] == full["tokens"]
        assert low["loss"] == pytest.approx(full["loss"], rel=1e-2)
        assert low["grad_norm"] == pytest.approx(full["grad_norm"], rel=5e-2)
    assert records[0]["grad_norm"] != pytest.approx(two_node_run[0]["grad_norm"], rel=1e-5)

    # DeepSpeed's csv monitor holds the per-step figures of metrics.jsonl (one file per figure), indexed like
    # DeepSpeed's own lr event of the same optimizer step (one index for every event, as wandb needs).
    def monitored(name: str) -> list[tuple[int, float]]:
        with open(out / "csv" / f"{name.replace('/', '_')}.csv") as handle:
            rows = list(csv.reader(handle))
        assert rows[0] == ["step", name.split("/")[-1]]
        return [(int(index), float(value)) for index, value in rows[1:]]

    deepspeed_lr = monitored("Train/Samples/lr")
    assert [step for _, step in monitored("Train/step")] == [r["step"] for r in records]
    for key in ("loss", "grad_norm", "learning_rate", "rewards/margins", "rewards/accuracies", "logps/chosen", "tokens"):
        assert monitored(f"Train/{key}") == [(index, r[key]) for (index, _), r in zip(deepspeed_lr, records,
                                                                                      strict=True)], key
    if tensorboard:
        assert list((out / "tb").glob("events.out.tfevents.*"))
