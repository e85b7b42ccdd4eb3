"""A cluster on this machine for the tests of real launches (tests/test_cluster.py, ``make cluster-test``).

Everything runs in a network namespace of its own whose only interface is the loopback
(127.0.0.1 and 127.0.0.2 on it): the OpenSSH server behind DeepSpeed's PDSH runner, munge,
slurmctld and two slurmd, and every rank they start.  So nothing a test starts can reach
or be reached from outside the loopback, whatever address a server binds.  Two "nodes":
``node1`` (127.0.0.1) and ``node2`` (127.0.0.2), names that only the cluster's ssh configuration and
slurm.conf know.  All state (keys, configurations, spool, logs) lives in one
temporary folder; nothing of the machine's is edited (``/run/sshd``, which sshd requires to
exist, is made when missing and removed afterwards).  ``close()`` ends every process in the
namespace -- daemons, ssh sessions, job steps, ranks -- also when a test failed.

Root is needed (a network namespace, sshd's privilege separation, slurmd); the tools come
from Debian's packages, which ``make cluster-test`` installs (``python tests/cluster.py install``).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

PACKAGES = "openssh-server pdsh slurm-wlm munge iproute2"
# The programs each part needs (Debian puts the daemons in /usr/sbin, often not on a user's PATH).
TOOLS = ("unshare", "nsenter", "ip", "ss", "sshd", "ssh", "ssh-keygen", "pdsh", "munged", "slurmctld", "slurmd", "sbatch",
         "scontrol", "scancel", "squeue", "sinfo")
# Set by `make cluster-test` as root: a missing tool fails the tests instead of skipping them.
REQUIRED_ENV = "DS_PACKDPO_CLUSTER_REQUIRED"
SBIN_PATH = os.pathsep.join((os.environ.get("PATH", ""), "/usr/sbin", "/sbin"))
SSH_PORT = 2222  # any port: the namespace is empty
NODES = {"node1": "127.0.0.1", "node2": "127.0.0.2"}  # for ssh and for Slurm alike


def tool(name: str) -> str:
    path = shutil.which(name, path=SBIN_PATH)
    assert path, name
    return path


def missing() -> str | None:
    """One line saying what the cluster tests lack on this machine and how to get it, or None."""
    lacking = " ".join(name for name in TOOLS if shutil.which(name, path=SBIN_PATH) is None)
    if os.geteuid() != 0:
        return f"cluster tests need root (a network namespace, sshd, slurmd){' and ' + lacking if lacking else ''}: " \
               f"run `make cluster-test` as root (it runs apt-get install -y {PACKAGES})"
    if lacking:
        return f"cluster tests need {lacking}: `make cluster-test` installs them (apt-get install -y {PACKAGES})"
    return None


def require_tools() -> None:
    """Skips the calling test with the one line of :func:`missing`; under ``make cluster-test`` as root, fails it."""
    line = missing()
    if line is not None:
        if os.environ.get(REQUIRED_ENV) == "1":
            pytest.fail(line, pytrace=False)
        pytest.skip(line)


def wait_until(what: str, check, timeout: float, interval: float = 0.2):
    """Polls ``check()`` until it returns something true (returned), or fails naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(interval)


class Loopback:
    """A network namespace with only the loopback up, 127.0.0.2 added to it; runs commands inside it."""

    def __init__(self, state: Path):
        self.state = state
        # 127.0.0.2 is the second node; an address other than 127.0.0.1 also makes glibc's getaddrinfo (AI_ADDRCONFIG,
        # which Slurm uses) answer for IPv4 at all.
        ip = tool("ip")
        self._holder = subprocess.Popen(
            [tool("unshare"), "--net", "--", "sh", "-c",
             f"{ip} link set lo up && {ip} addr add {NODES['node2']}/8 dev lo && echo up && exec sleep infinity"],
            stdout=subprocess.PIPE, start_new_session=True)
        assert self._holder.stdout.readline() == b"up\n", "the loopback namespace did not come up"
        self.namespace = os.readlink(f"/proc/{self._holder.pid}/ns/net")
        self._daemons: list[subprocess.Popen] = []
        self._at_close: list = []

    def at_close(self, undo) -> None:
        """``undo()`` runs in :meth:`close`, once the namespace's processes have ended (what a server changed outside
        the namespace, undone)."""
        self._at_close.append(undo)

    def command(self, cmd: list) -> list[str]:
        """``cmd`` run inside the namespace (nsenter execs it: the process started is ``cmd`` itself)."""
        return [tool("nsenter"), f"--net=/proc/{self._holder.pid}/ns/net", "--", *map(str, cmd)]

    def start(self, name: str, cmd: list, env: dict | None = None) -> subprocess.Popen:
        """A daemon in the foreground inside the namespace, its output in ``state/NAME.log``."""
        with open(self.state / f"{name}.log", "ab") as log:
            daemon = subprocess.Popen(self.command(cmd), stdout=log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        self._daemons.append(daemon)
        return daemon

    def log_tail(self, name: str, chars: int = 3000) -> str:
        """The end of a daemon's log (what :meth:`start` wrote)."""
        path = self.state / f"{name}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else f"(no {path})"

    def run(self, cmd: list, env: dict | None = None, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(cmd), env=env, capture_output=True, text=True, timeout=timeout, **kwargs)

    def processes(self) -> list[int]:
        """Every process in the namespace but its holder: what the cluster and its jobs started."""
        pids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) != self._holder.pid:
                with contextlib.suppress(OSError):
                    if os.readlink(entry / "ns" / "net") == self.namespace:
                        pids.append(int(entry.name))
        return pids

    def close(self) -> None:
        """SIGTERM to every process in the namespace, SIGKILL to those left after 5 s (the daemons reaped), what
        :meth:`at_close` registered, then the namespace goes."""
        for signum, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            for pid in self.processes():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signum)
            with contextlib.suppress(AssertionError):
                wait_until("the namespace's processes to end", lambda: not self.processes(), grace)
        for daemon in self._daemons:
            with contextlib.suppress(subprocess.TimeoutExpired):
                daemon.wait(timeout=5)
        for undo in reversed(self._at_close):
            undo()
        self._holder.kill()
        self._holder.wait()


class SshNodes:
    """An OpenSSH server inside the namespace on :data:`SSH_PORT` of both node addresses, a host key and a client key
    made here, and an ``ssh`` on ``bin_dir`` that reads this cluster's client configuration (``-F``): the nodes'
    names, the key, the known host key.  That ``ssh`` first on PATH is what a user's ~/.ssh/config is to DeepSpeed's
    runner and to pdsh, without touching ~/.ssh.  Closed with the namespace."""

    def __init__(self, net: Loopback, state: Path):
        self.net = net
        self.dir = state / "ssh"
        self.dir.mkdir(mode=0o700)
        self.bin_dir = self.dir / "bin"
        self.bin_dir.mkdir()
        for key in ("host_key", "client_key"):
            subprocess.run([tool("ssh-keygen"), "-q", "-t", "ed25519", "-N", "", "-C", key, "-f", self.dir / key],
                           check=True)
        (self.dir / "authorized_keys").write_text((self.dir / "client_key.pub").read_text())
        host_key = (self.dir / "host_key.pub").read_text().split()[:2]
        (self.dir / "known_hosts").write_text("".join(f"[{addr}]:{SSH_PORT} {' '.join(host_key)}\n"
                                                      for addr in NODES.values()))
        (self.dir / "sshd_config").write_text("\n".join([
            *(f"ListenAddress {addr}:{SSH_PORT}" for addr in NODES.values()),
            f"HostKey {self.dir / 'host_key'}",
            f"AuthorizedKeysFile {self.dir / 'authorized_keys'}",
            f"PidFile {self.dir / 'sshd.pid'}",
            "PermitRootLogin prohibit-password", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
            "UsePAM no", "StrictModes no", "X11Forwarding no", "AllowTcpForwarding no", "LogLevel ERROR", ""]))
        # No Port here: the launch names it (--ssh_port), as it must for a cluster's non-standard port.
        (self.dir / "ssh_config").write_text("".join(f"Host {name}\n  HostName {addr}\n"
                                                     for name, addr in NODES.items()) + "\n".join([
            "Host *", "  User root", f"  IdentityFile {self.dir / 'client_key'}", "  IdentitiesOnly yes",
            f"  UserKnownHostsFile {self.dir / 'known_hosts'}", "  StrictHostKeyChecking yes", "  BatchMode yes", ""]))
        wrapper = self.bin_dir / "ssh"
        wrapper.write_text(f"#!/bin/sh\nexec {tool('ssh')} -F {self.dir / 'ssh_config'} \"$@\"\n")
        wrapper.chmod(0o755)
        self.made_privsep = not Path("/run/sshd").exists()
        if self.made_privsep:
            Path("/run/sshd").mkdir(mode=0o755)
        self.server = None
        net.at_close(self.close)
        try:
            self.server = net.start("sshd", [tool("sshd"), "-D", "-e", "-f", self.dir / "sshd_config"])
            wait_until("sshd to accept the client key",
                       lambda: self.ssh("node2", "true").returncode == 0 or self.server.poll() is not None, 15)
            assert self.server.poll() is None, net.log_tail("sshd")
        except BaseException:
            self.close()
            raise

    def ssh(self, node: str, command: str) -> subprocess.CompletedProcess:
        return self.net.run([self.bin_dir / "ssh", "-p", SSH_PORT, node, command], timeout=30)

    def close(self) -> None:
        """sshd stopped (its sessions go with the namespace), and /run/sshd removed if it was made here."""
        if self.server is not None and self.server.poll() is None:
            self.server.terminate()
            self.server.wait()
        if self.made_privsep:
            with contextlib.suppress(OSError):
                Path("/run/sshd").rmdir()


class Slurm:
    """munge, slurmctld and two slurmd (nodes ``node1`` and ``node2``, one CPU each) inside the namespace,
    configured for this machine alone from one slurm.conf in the state folder; its client commands find it through
    ``SLURM_CONF`` (:meth:`env`)."""

    def __init__(self, net: Loopback, state: Path):
        self.net = net
        host = socket.gethostname()
        self.dir = state / "slurm"
        for sub in ("state", "munge", *(f"spool/{name}" for name in NODES)):
            (self.dir / sub).mkdir(parents=True)
        munge = self.dir / "munge"
        munge.chmod(0o711)  # munged wants its socket's folder (and every one above it) searchable by all
        (munge / "munge.key").write_bytes(os.urandom(1024))
        (munge / "munge.key").chmod(0o400)
        self.munge_socket = munge / "munge.socket"
        self.munged = net.start("munged", [tool("munged"), "--foreground", f"--socket={self.munge_socket}",
                                           f"--key-file={munge / 'munge.key'}", f"--pid-file={munge / 'munged.pid'}",
                                           f"--seed-file={munge / 'munged.seed'}", f"--log-file={munge / 'munged.log'}"])
        wait_until("munged's socket", self.munge_socket.exists, 10)
        self.conf = self.dir / "slurm.conf"
        self.conf.write_text("\n".join([
            "ClusterName=dspackdpo", f"SlurmctldHost={host}({NODES['node1']})", "SlurmctldPort=6817",
            "SlurmdPort=6818",  # any ports (the namespace is empty); each slurmd its own (Port=)
            "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge", "CredType=cred/munge",
            # cred_expire: a requeued job waits this long before it may start again (120 s by default)
            f"AuthInfo=socket={self.munge_socket},cred_expire=10",
            f"StateSaveLocation={self.dir / 'state'}", f"SlurmdSpoolDir={self.dir / 'spool'}/%n",
            f"SlurmctldPidFile={self.dir / 'slurmctld.pid'}", f"SlurmdPidFile={self.dir / 'spool'}/%n/slurmd.pid",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU", "SchedulerType=sched/builtin",
            "SchedulerParameters=sched_interval=1", "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none", "JobAcctGatherType=jobacct_gather/none", "ReturnToService=2",
            "KillWait=30", "InactiveLimit=0", "MinJobAge=600",
            *(f"NodeName={name} NodeHostname={host} NodeAddr={addr} Port={6820 + i} CPUs=1 State=UNKNOWN"
              for i, (name, addr) in enumerate(NODES.items())),
            # A job of `urgent` pre-empts one of `test`: SIGTERM, GraceTime to stop, then it is requeued.
            "PreemptType=preempt/partition_prio", "PreemptMode=REQUEUE",
            f"PartitionName=test Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE PriorityTier=1 "
            "GraceTime=60 State=UP",
            f"PartitionName=urgent Nodes={','.join(NODES)} MaxTime=INFINITE PriorityTier=2 PreemptMode=OFF "
            "State=UP", ""]))
        daemon_env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.daemons = {"slurmctld": net.start("slurmctld", [tool("slurmctld"), "-D", "-i"], env=daemon_env)}
        for name in NODES:
            self.daemons[f"slurmd.{name}"] = net.start(f"slurmd.{name}", [tool("slurmd"), "-D", "-N", name],
                                                       env=daemon_env)
        wait_until("both slurmd idle", lambda: self._node_states() == dict.fromkeys(NODES, "idle"), 60, 0.5)

    def env(self, **extra: str) -> dict:
        return {**os.environ, "SLURM_CONF": str(self.conf), **extra}

    def _node_states(self) -> dict[str, str]:
        for name, daemon in self.daemons.items():
            assert daemon.poll() is None, f"{name} exited {daemon.returncode}:\n{self.net.log_tail(name)}"
        proc = self.net.run([tool("sinfo"), "-h", "-N", "-o", "%N %T"], env=self.env())  # a line per partition
        return dict(line.split() for line in proc.stdout.splitlines()) if proc.returncode == 0 else {}

    def command(self, *args, env: dict | None = None, cwd: Path | None = None) -> str:
        """A Slurm client command (sbatch, scancel, scontrol ...) inside the namespace; its standard output."""
        name, *rest = args
        proc = self.net.run([tool(name), *rest], env=env or self.env(), cwd=cwd)
        assert proc.returncode == 0, f"{' '.join(map(str, args))}: exit {proc.returncode}\n{proc.stderr}"
        return proc.stdout

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, ExitCode, Restarts, StdOut ...)."""
        text = self.command("scontrol", "show", "job", job_id)
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait(self, job_id: str, states: tuple[str, ...], timeout: float) -> dict[str, str]:
        return wait_until(f"job {job_id} to reach {states}",
                          lambda: (job := self.job(job_id))["JobState"] in states and job, timeout, 0.5)


@contextlib.contextmanager
def state_folder():
    """The cluster's temporary folder (not pytest's: munged wants every folder above its socket searchable by all,
    and pytest's are private), removed at the end."""
    folder = Path(tempfile.mkdtemp(prefix="ds_packdpo_cluster_"))
    folder.chmod(0o711)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def loopback_namespace():
    """The namespace (:class:`Loopback`) in its state folder; on the way out, failed or not, every process in it
    ended and the folder removed.  Skips (or fails, see :func:`require_tools`) without the tools."""
    require_tools()
    with state_folder() as state:
        net = Loopback(state)
        try:
            yield net
        finally:
            net.close()


def install() -> int:
    """``make cluster-test``'s set-up: as root, apt-get installs what :func:`missing` names; otherwise that one line.

    No daemon of the packages starts (sshd on port 22 of every interface, munged, slurmd): while they are set up,
    a policy-rc.d that denies every start is in place (Debian's own mechanism; one there already is left alone)."""
    line = missing()
    if line is None or os.geteuid() != 0:
        if line is not None:
            print(f"cluster-test: {line}", file=sys.stderr)
        return 0
    policy = Path("/usr/sbin/policy-rc.d")
    made_policy = not policy.exists()
    if made_policy:
        policy.write_text("#!/bin/sh\n# make cluster-test (ds_packdpo): no service starts while packages are set up\n"
                          "exit 101\n")
        policy.chmod(0o755)
    apt = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES.split()]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        if subprocess.run(apt, env=env).returncode != 0:  # a machine whose package lists are stale or absent
            subprocess.run(["apt-get", "update", "-q"], env=env, check=True)
            subprocess.run(apt, env=env, check=True)
    finally:
        if made_policy:
            policy.unlink()
    line = missing()
    if line is not None:
        print(f"cluster-test: still {line}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    assert sys.argv[1:] == ["install"], "usage: python tests/cluster.py install"
    sys.exit(install())
