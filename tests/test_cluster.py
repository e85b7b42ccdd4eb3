"""Real cluster launches on this machine (tests/cluster.py): DeepSpeed's PDSH runner over ssh and a node that dies in
it, then a Slurm job warned before its time limit, pre-empted, cancelled with a signal, and requeued.

`make cluster-test` installs the tools (as root) and runs these (`pytest -m cluster`); they are not in the default
selection (pyproject's addopts), and without the tools or root each is skipped with one line saying what is missing.
Few launches, each checking several things: the uninterrupted run they are compared with (one node, 2 ranks), two
pdsh launches, five runs of three Slurm jobs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from cluster import SSH_PORT, Loopback, Slurm, SshNodes, loopback_namespace, tool, wait_until
from fault_hooks import WAIT_FOR_STOP_ENV
from launching import BIN, REPO, cpu_env, ranks_module, read_metrics, run
from test_checkpoint import assert_same_steps

from ds_packdpo import cli
from ds_packdpo.run.checkpoint import LATEST
from ds_packdpo.run.hooks import HOOKS_ENV
from ds_packdpo.run.process_group import ROLL_CALL_S

pytestmark = [pytest.mark.cluster, pytest.mark.multirank]

# 6 steps of 8 pairs on 2 ranks, a checkpoint every 3 steps: every run below is compared with the uninterrupted one.
TRAIN = ["--synthetic-pairs", "48", "--global-batch-pairs", "8", "--max-length", "96", "--lr", "1e-3", "--dtype", "fp32",
         "--no-progress", "--max-steps", "6", "--save-steps", "3"]
# A rank SIGKILLed on the second node ends the job within this (measured: see test_pdsh_over_ssh_and_a_node_that_dies).
NODE_DEATH_BOUND_S = 30
# The tasks of launch/slurm.sbatch sized for this machine (its #SBATCH lines are a GPU cluster's).
SLURM_SIZE = ["--ntasks-per-node=1", "--gpus-per-node=0", "--cpus-per-task=1"]
JOB_TIMEOUT_S = 300


def train_flags(tmp: Path, out: Path, *extra: str) -> list[str]:
    return ["--output-dir", str(out), "--cache-dir", str(tmp / "cache"), *TRAIN, *extra]


@pytest.fixture(scope="module")
def loopback():
    with loopback_namespace() as net:
        yield net  # then every daemon, session, job step and rank in the namespace ends, also after a failure


@pytest.fixture(scope="module")
def ssh_nodes(loopback):
    return SshNodes(loopback, loopback.state)


@pytest.fixture(scope="module")
def slurm(loopback):
    return Slurm(loopback, loopback.state)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[dict]:
    """The 6 steps on one node, 2 ranks: what every cluster run must reproduce."""
    tmp = tmp_path_factory.mktemp("one_node")
    run(ranks_module(2, "ds_packdpo.train", *train_flags(tmp, tmp / "run")))
    return read_metrics(tmp / "run" / "metrics.jsonl")


def tail(path: Path, chars: int = 4000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else f"(no {path})"


# ---------------------------------------------------------------- the cluster itself
def running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended but not yet waited for by its parent, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_servers_listen_on_the_loopback_only_and_end_when_a_test_fails():
    """Every server of the cluster (sshd, slurmctld, both slurmd; munged on a unix socket) listens inside a namespace
    whose only interface is the loopback; a test that fails while they run ends every process of the namespace and
    removes the state folder (what the fixtures above rely on)."""
    seen = {}
    with pytest.raises(RuntimeError, match="a failing test"):
        with loopback_namespace() as net:
            nodes = SshNodes(net, net.state)
            Slurm(net, net.state)
            links = net.run([tool("ip"), "-o", "link", "show"]).stdout
            assert [line.split(": ")[1] for line in links.splitlines()] == ["lo"], links
            listening = net.run([tool("ss"), "-H", "-l", "-t", "-n", "-p"]).stdout  # state recv send local peer users
            servers = {}
            for line in listening.splitlines():
                local, users = line.split()[3], line.split()[-1]
                servers.setdefault(re.search(r'"([^"]+)"', users).group(1), set()).add(local.rsplit(":", 1)[0])
            assert set(servers) == {"sshd", "slurmctld", "slurmd"}, listening
            assert servers["sshd"] == {"127.0.0.1", "127.0.0.2"}, listening  # its ListenAddress lines
            # Slurm's daemons bind every address of the namespace: there is only the loopback
            assert all(address in ("0.0.0.0", "*", "[::]") or address.startswith("127.")
                       for addresses in servers.values() for address in addresses), listening
            seen.update(pids=net.processes(), state=net.state, made_privsep=nodes.made_privsep)
            raise RuntimeError("a failing test")
    assert len(seen["pids"]) >= 5  # sshd, munged, slurmctld, 2 slurmd
    assert not [pid for pid in seen["pids"] if running(pid)]
    assert not seen["state"].exists()
    assert seen["made_privsep"] is False or not Path("/run/sshd").exists()  # sshd's folder, when made for it


# ---------------------------------------------------------------- pdsh over ssh
def launch_multinode(net: Loopback, nodes: SshNodes, workdir: Path, log: Path, *args: str,
                     **env: str) -> subprocess.Popen:
    """launch/multinode.sh from ``workdir`` inside the namespace, this cluster's ssh first on PATH, through
    DeepSpeed's PDSH runner (no --no_ssh): one ssh session per node of ``workdir/hostfile``."""
    job_env = cpu_env(**env)
    job_env["PATH"] = f"{nodes.bin_dir}{os.pathsep}{job_env['PATH']}"
    cmd = [REPO / "launch" / "multinode.sh", "--hostfile", "hostfile", "--master_addr", "127.0.0.1",
           "--ssh_port", SSH_PORT, *args]
    with open(log, "w") as handle:
        return subprocess.Popen(net.command(cmd), cwd=workdir, env=job_env, stdout=handle, stderr=subprocess.STDOUT,
                                start_new_session=True)


def ended(proc: subprocess.Popen, log: Path, timeout: float = JOB_TIMEOUT_S) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"the launch did not end within {timeout} s:\n{tail(log)}") from None


def test_pdsh_over_ssh_and_a_node_that_dies(loopback, ssh_nodes, uninterrupted, tmp_path, capsys):
    """launch/multinode.sh --hostfile (node1, node2) without --no_ssh: DeepSpeed's PDSH runner starts each node's rank
    through ssh.  The environment reaches every remote rank (.deepspeed_env, --export, the venv's PATH and extension
    folder: the remote login shell has none of them); rank 1 (node2) is SIGKILLed as its peers wait at step 4: the job
    ends within NODE_DEATH_BOUND_S, its survivor's one line names the dead rank, the step-3 checkpoint is intact, and
    the job relaunched with --resume auto continues from it: steps 1-6 equal the one-node run."""
    remote_path = ssh_nodes.ssh("node2", "echo $PATH")
    assert remote_path.returncode == 0 and str(BIN) not in remote_path.stdout, remote_path  # no venv over there

    workdir = tmp_path / "job"
    workdir.mkdir()
    (workdir / "hostfile").write_text("node1 slots=1\nnode2 slots=1\n")
    # DeepSpeed reads .deepspeed_env in the launch folder; gloo binds the interface it names (the namespace's only one)
    (workdir / ".deepspeed_env").write_text("GLOO_SOCKET_IFNAME=lo\nFROM_DEEPSPEED_ENV=read by deepspeed\n")
    probe = tmp_path / "probe"
    probe.mkdir()
    shutil.copy(REPO / "tests" / "rank_probe" / "sitecustomize.py", probe)
    out, log = tmp_path / "run", tmp_path / "killed.log"

    job = launch_multinode(loopback, ssh_nodes, workdir, log, "--export", "FROM_OPTION=two words",
                           "--export", HOOKS_ENV, "--export", f"{WAIT_FOR_STOP_ENV}=4", "--",
                           *train_flags(tmp_path, out),
                           PYTHONPATH=f"{probe}{os.pathsep}{cpu_env()['PYTHONPATH']}")
    # Both ranks wait as step 4 begins (the step-3 checkpoint complete): the second node's rank dies then.
    wait_until("both ranks at step 4", lambda: (out / "checkpoints" / LATEST).exists() or job.poll() is not None,
               JOB_TIMEOUT_S, 0.5)
    assert job.poll() is None, tail(log)
    seen = [json.loads((probe / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    os.kill(seen[1]["pid"], signal.SIGKILL)
    killed = time.monotonic()
    code = ended(job, log)
    seconds = time.monotonic() - killed
    output = log.read_text()

    # The environment of every rank, each started over ssh on its own node's address
    for rank, ranks_view in enumerate(seen):
        env = ranks_view["env"]
        assert env["SSH_CONNECTION"].split()[2:] == [f"127.0.0.{rank + 1}", str(SSH_PORT)], env["SSH_CONNECTION"]
        assert env["FROM_DEEPSPEED_ENV"] == "read by deepspeed" and env["GLOO_SOCKET_IFNAME"] == "lo"
        assert env["FROM_OPTION"] == "two words" and env[WAIT_FOR_STOP_ENV] == "4" and env[HOOKS_ENV] == "fault_hooks"
        assert Path(ranks_view["executable"]).parent == BIN  # DeepSpeed starts the launching node's interpreter
        assert ranks_view["ninja"] == str(BIN / "ninja")  # the venv's tools first on PATH
        assert env["TORCH_EXTENSIONS_DIR"] == cpu_env()["TORCH_EXTENSIONS_DIR"]  # its built extension, not ~/.cache
        assert env["DS_ACCELERATOR"] == "cpu"

    # The job ended within the bound; rank 0's one line names the dead rank (its host and pid); pdsh names the node
    host = socket.gethostname()  # both "nodes" are this machine
    assert code == 247, (code, output[-4000:])  # pdsh -S: the largest node status, node2's (256 - SIGKILL)
    assert seconds < NODE_DEATH_BOUND_S, (seconds, output[-4000:])
    named = re.findall(r"node1: error: rank 0: a collective failed after step 3: (.*?) longer than", output)
    assert named == [f"rank 1 ({host}, pid {seen[1]['pid']}) did not answer within {ROLL_CALL_S:g} s: it died or "
                     "stalled"], output[-4000:]
    assert re.search(r"pdsh@\S+: node2: ssh exited with exit code 247", output), output[-4000:]
    with capsys.disabled():
        print(f"\npdsh: rank 1 on node2 SIGKILLed, the job ended {seconds:.1f} s later (exit {code})")

    # The last checkpoint is intact, and the relaunch continues from it
    assert (out / "checkpoints" / LATEST).read_text() == "global_step3"
    assert cli.main(["verify-checkpoint", str(out / "checkpoints")]) == 0
    assert_same_steps(read_metrics(out / "metrics.jsonl"), uninterrupted, range(1, 4))
    log = tmp_path / "resumed.log"
    job = launch_multinode(loopback, ssh_nodes, workdir, log, "--", *train_flags(tmp_path, out, "--resume", "auto"))
    assert ended(job, log) == 0, tail(log)
    assert f"resuming from {out / 'checkpoints' / 'global_step3'} at step 3" in log.read_text()
    assert_same_steps(read_metrics(out / "metrics.jsonl"), uninterrupted, range(1, 7))


# ---------------------------------------------------------------- Slurm
def test_slurm_warning_preemption_cancel_and_requeue(loopback, slurm, uninterrupted, tmp_path, capsys):
    """`sbatch launch/slurm.sbatch` on two Slurm nodes, three jobs, each stopped at a step boundary with a checkpoint
    and exit 7 by one way a cluster stops a job: (A) the script's `#SBATCH --signal=TERM@300` warning, its time limit
    cut to 5 minutes as step 2 begins; `scontrol requeue` and the run continues from step 2 to the end; (B) a
    pre-emption by a job of a higher partition (PreemptMode=REQUEUE): the job requeues itself and continues from step
    3 once the pre-emptor is done; (C) `scancel --signal=TERM`.  Output and metrics land where the docs say; every
    resumed run's steps equal the uninterrupted run's."""
    submit = tmp_path / "submit"  # a folder laid out like the repository root, where the docs say to submit from
    submit.mkdir()
    (submit / "launch").symlink_to(REPO / "launch")
    base_env = slurm.env(**cpu_env(), GLOO_SOCKET_IFNAME="lo")

    def sbatch(out: Path, wait_at: int, *options: str) -> str:
        return slurm.command("sbatch", "--parsable", *SLURM_SIZE, *options, "launch/slurm.sbatch",
                             *train_flags(tmp_path, out, "--resume", "auto"),
                             env={**base_env, WAIT_FOR_STOP_ENV: str(wait_at)}, cwd=submit).strip()

    def waiting_at(out: Path, step: int, job_id: str) -> None:
        """The job's ranks wait as ``step`` begins (steps before it logged): a signal now stops them after it."""
        wait_until(f"job {job_id} at step {step}",
                   lambda: (out / "metrics.jsonl").exists() and len(read_metrics(out / "metrics.jsonl")) >= step - 1
                   or slurm.job(job_id)["JobState"] not in ("PENDING", "RUNNING"), JOB_TIMEOUT_S, 0.5)
        assert slurm.job(job_id)["JobState"] == "RUNNING", slurm.job(job_id)

    def stopped(job_id: str, step: int, out: Path) -> str:
        """The job's output holds its ranks' stop at ``step`` (and their exit 7); returns the output."""
        text = tail(submit / f"ds-packdpo-{job_id}.out", 100_000)
        assert (f"stopped: SIGTERM after step {step}, checkpoint saved; resume with --resume auto "
                f"(tag global_step{step})") in text, text[-4000:]
        assert re.search(r"srun: error: node\d: task \d: Exited with exit code 7", text), text[-4000:]
        assert cli.main(["verify-checkpoint", str(out / "checkpoints" / f"global_step{step}")]) == 0
        return text

    def completed(job_id: str, out: Path, resumed_at: int, restarts: str) -> None:
        job = slurm.wait(job_id, ("COMPLETED", "FAILED", "CANCELLED"), JOB_TIMEOUT_S)
        text = tail(submit / f"ds-packdpo-{job_id}.out", 100_000)
        assert (job["JobState"], job["ExitCode"], job["Restarts"]) == ("COMPLETED", "0:0", restarts), text[-4000:]
        assert f"resuming from {out / 'checkpoints' / f'global_step{resumed_at}'} at step {resumed_at}" in text
        assert f"done: {6 - resumed_at} steps (to step 6)" in text
        assert_same_steps(read_metrics(out / "metrics.jsonl"), uninterrupted, range(1, 7))

    # (A) the warning before the time limit; then requeued by hand
    out_a = tmp_path / "warned"
    job_a = sbatch(out_a, 2, "--time=60")
    waiting_at(out_a, 2, job_a)
    slurm.command("scontrol", "update", f"JobId={job_a}", "TimeLimit=5")  # 5 min left < the script's 300 s warning
    warned = time.monotonic()
    job = slurm.wait(job_a, ("FAILED", "COMPLETED", "CANCELLED"), JOB_TIMEOUT_S)
    warning_s = time.monotonic() - warned
    assert (job["JobState"], job["ExitCode"], job["Restarts"]) == ("FAILED", "7:0", "0"), job
    assert job["StdOut"] == str(submit / f"ds-packdpo-{job_a}.out")  # --output=%x-%j.out, in the submit folder
    assert "pre-empted" not in stopped(job_a, 2, out_a)  # not pre-empted: the job stays ended
    assert read_metrics(out_a / "metrics.jsonl")[-1]["step"] == 2  # the metrics in --output-dir, as in every launch
    slurm.command("scontrol", "requeue", job_a)
    slurm.command("scontrol", "update", f"JobId={job_a}", "TimeLimit=60")
    completed(job_a, out_a, 2, "1")

    # (B) pre-empted by a job of the higher partition: requeues itself, resumes once the pre-emptor is done
    out_b = tmp_path / "preempted"
    job_b = sbatch(out_b, 3)
    waiting_at(out_b, 3, job_b)
    urgent = slurm.command("sbatch", "--parsable", "--partition=urgent", "--nodes=2",
                           f"--output={tmp_path}/urgent.out", "--wrap", "sleep 1", cwd=tmp_path).strip()
    wait_until(f"job {job_b} requeued", lambda: slurm.job(job_b)["Restarts"] == "1", JOB_TIMEOUT_S, 0.5)
    text = stopped(job_b, 3, out_b)
    assert f"pre-empted: job {job_b} requeued; with --resume auto it continues from its last checkpoint" in text
    completed(job_b, out_b, 3, "1")
    assert slurm.job(urgent)["JobState"] == "COMPLETED"

    # (C) scancel --signal=TERM: the ranks save and the job ends, exit 7
    out_c = tmp_path / "cancelled"
    job_c = sbatch(out_c, 2)
    waiting_at(out_c, 2, job_c)
    slurm.command("scancel", "--signal=TERM", job_c)
    job = slurm.wait(job_c, ("FAILED", "COMPLETED", "CANCELLED"), JOB_TIMEOUT_S)
    assert (job["JobState"], job["ExitCode"], job["Restarts"]) == ("FAILED", "7:0", "0"), job
    stopped(job_c, 2, out_c)
    assert (out_c / "checkpoints" / LATEST).read_text() == "global_step2"
    with capsys.disabled():
        print(f"\nslurm: the time-limit warning stopped job {job_a} {warning_s:.1f} s after its limit was cut")
