"""A Slurm cluster of test hosts (tests/testhosts.py): a munged on every host (one key), slurmctld on the first and
a slurmd on each, so that ``srun -N 2`` runs across hosts for real.

Everything lives in the hosts' own namespaces: the daemons' files (key, state, spool, logs, pid files) in each host's
private /tmp, munged's socket in its private /run, the daemons listening on the hosts' own network (so Slurm's
default ports clash with nothing of this machine's, CI's one-node cluster included). The daemons run in the
foreground, started through ``nsenter`` (so each Popen's pid is the daemon's own, munged's through ``setpriv``, which
execs it as the munge user), and are ended by those pids; what they wrote goes with the hosts' mounts.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import psutil
import testhosts
from helpers import locked
from testhosts import HOME, TestHost, Unavailable

#: The cluster's directory on every host (in its private /tmp), its configuration, and munged's socket (in /run).
DIR = f"{HOME}/slurm"
CONF = f"{DIR}/slurm.conf"
MUNGE_DIR = f"{HOME}/munge"
MUNGE_SOCKET = "/run/munge/munge.socket.2"
PROGRAMS = ("/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/bin/srun", "/usr/bin/sinfo", "/usr/sbin/munged")
CONF_TEXT = """# The test hosts' Slurm cluster (tests/testslurm.py).
ClusterName=mpsrunhosts
SlurmctldHost={controller}({controller_address})
AuthType=auth/munge
AuthInfo=socket={socket}
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
SlurmctldPort=6817
SlurmdPort=6818
{nodes}
PartitionName=hosts Nodes={names} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


def ensure_slurm() -> None:
    """Debian's Slurm and munge, installed as ci/slurm/start.sh does (their services are never started here)."""
    if all(os.path.exists(program) for program in PROGRAMS):
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    with locked(Path(__file__)):  # one install at a time among xdist's workers
        for argv in (["apt-get", "update", "-qq"],
                     ["apt-get", "install", "-y", "-qq", "slurmctld", "slurmd", "slurm-client", "munge"]):
            if all(os.path.exists(program) for program in PROGRAMS):
                break
            out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600, stdin=subprocess.DEVNULL)
            if out.returncode != 0:
                raise Unavailable(f"{' '.join(argv)} exited {out.returncode}: {out.stderr.strip()[-500:]}")


class Cluster:
    """The running cluster: its hosts, its daemons (host, name, process) and the environment its tools need."""

    def __init__(self, hosts: Mapping[str, TestHost]) -> None:
        self.hosts = dict(hosts)
        self.daemons: list[tuple[TestHost, str, subprocess.Popen]] = []

    def environment(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """The test hosts' environment (:func:`testhosts.environment`) with this cluster's SLURM_CONF."""
        return testhosts.environment({"SLURM_CONF": CONF, **(extra or {})})

    def start(self, host: TestHost, name: str, *argv: str) -> None:
        """``argv`` (a daemon in the foreground) started on ``host``, its output in ``DIR/NAME.out``, its pid kept out of
        the host's :meth:`~TestHost.processes`."""
        with host.path(f"{DIR}/{name}.out").open("w") as out:
            proc = host.popen(*argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                              env=self.environment())
        self.daemons.append((host, name, proc))
        host.services.add(proc.pid)

    def adopt_children(self) -> None:
        """The daemons' own children (slurmctld's slurmscriptd) kept out of the hosts' processes too."""
        for host, _, proc in self.daemons:
            with contextlib.suppress(psutil.Error):
                host.services.update(child.pid for child in psutil.Process(proc.pid).children(recursive=True))

    def logs(self) -> str:
        """Every daemon's output and log file, for a failure's message (the last lines of each)."""
        found = []
        for host in self.hosts.values():
            for path in sorted(host.path(DIR).glob("*.out")) + sorted(host.path(DIR).glob("*.log")) + sorted(
                    host.path(MUNGE_DIR).glob("*.log")):
                with contextlib.suppress(OSError):
                    tail = " | ".join(path.read_text(errors="replace").strip().splitlines()[-5:])
                    found.append(f"{host.name}:{path.name}: {tail}")
        return "; ".join(found)

    def stop(self) -> None:
        """Every daemon ended by its pid (SIGTERM, then SIGKILL after 5 s), the last started first."""
        for _, _, proc in reversed(self.daemons):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        for _, _, proc in reversed(self.daemons):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for host in self.hosts.values():
            host.services.clear()
        self.daemons.clear()


def _munge_files(hosts: Mapping[str, TestHost]) -> None:
    """One key for every host (in its /tmp, 0400, the munge user's, as munged insists), and munged's directories."""
    user = pwd.getpwnam("munge")
    key = os.urandom(1024)
    for host in hosts.values():
        for inner, mode in ((MUNGE_DIR, 0o700), (os.path.dirname(MUNGE_SOCKET), 0o755)):
            host.path(inner).mkdir(mode=mode)
            os.chown(host.path(inner), user.pw_uid, user.pw_gid)
        path = host.path(f"{MUNGE_DIR}/munge.key")
        path.write_bytes(key)
        path.chmod(0o400)
        os.chown(path, user.pw_uid, user.pw_gid)


def _slurm_files(hosts: Mapping[str, TestHost]) -> None:
    """slurm.conf (the first host the controller, every host a node of one partition), and its directories."""
    first = next(iter(hosts.values()))
    cpus = len(os.sched_getaffinity(0))
    nodes = "\n".join(f"NodeName={host.name} NodeAddr={host.address} CPUs={cpus} State=UNKNOWN"
                      for host in hosts.values())
    text = CONF_TEXT.format(controller=first.name, controller_address=first.address, socket=MUNGE_SOCKET, dir=DIR,
                            nodes=nodes, names=",".join(hosts))
    for host in hosts.values():
        host.write(CONF, text)
        for inner in ("state", "spool"):
            host.path(f"{DIR}/{inner}").mkdir(mode=0o755)


def _start(cluster: Cluster) -> None:
    """munged on every host, slurmctld on the first, then a slurmd on each."""
    for host in cluster.hosts.values():
        cluster.start(host, "munged", "setpriv", "--reuid=munge", "--regid=munge", "--clear-groups",
                      "/usr/sbin/munged", "--foreground", f"--socket={MUNGE_SOCKET}",
                      f"--key-file={MUNGE_DIR}/munge.key", f"--pid-file={MUNGE_DIR}/munged.pid",
                      f"--log-file={MUNGE_DIR}/munged.log", f"--seed-file={MUNGE_DIR}/munged.seed")
    first = next(iter(cluster.hosts.values()))
    _wait(cluster, lambda: all(host.path(MUNGE_SOCKET).exists() for host in cluster.hosts.values()), "munged")
    cluster.start(first, "slurmctld", "/usr/sbin/slurmctld", "-D", "-f", CONF)
    for host in cluster.hosts.values():
        cluster.start(host, "slurmd", "/usr/sbin/slurmd", "-D", "-N", host.name, "-f", CONF)


def _idle(cluster: Cluster) -> bool:
    """Whether every node is idle, as sinfo on the first host says."""
    first = next(iter(cluster.hosts.values()))
    out = first.run("sinfo", "-h", "-N", "-o", "%N %T", env=cluster.environment(), timeout=20)
    states = dict(line.split() for line in out.stdout.splitlines() if len(line.split()) == 2)
    return out.returncode == 0 and states == dict.fromkeys(cluster.hosts, "idle")


def _wait(cluster: Cluster, ready: Callable[[], bool], what: str, timeout: float = 30) -> None:
    """Until ``ready()``; :class:`Unavailable` with the daemons' logs if a daemon ends first or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while not ready():
        ended = [f"{host.name}'s {name} exited {proc.returncode}" for host, name, proc in cluster.daemons
                 if proc.poll() is not None]
        if ended or time.monotonic() > deadline:
            raise Unavailable(f"{what} did not come up ({', '.join(ended) or f'{timeout} s'}): {cluster.logs()}")
        time.sleep(0.2)


@contextlib.contextmanager
def slurm_cluster(hosts: Mapping[str, TestHost]) -> Iterator[Cluster]:
    """A Slurm cluster of ``hosts`` (test hosts, by name; the first is the controller), once every node is idle; on
    leaving, its daemons are ended and its files removed. Raises :class:`Unavailable` where it cannot be made."""
    ensure_slurm()
    cluster = Cluster(hosts)
    try:
        _munge_files(hosts)
        _slurm_files(hosts)
        _start(cluster)
        _wait(cluster, lambda: _idle(cluster), "the Slurm nodes")
        cluster.adopt_children()
        yield cluster
    finally:
        cluster.stop()
        for host in hosts.values():
            for inner in (DIR, MUNGE_DIR, os.path.dirname(MUNGE_SOCKET)):
                shutil.rmtree(host.path(inner), ignore_errors=True)
