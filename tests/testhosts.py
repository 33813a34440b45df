"""Test hosts made of Linux namespaces: several "machines" on this one, joined by a private network, each with its own
sshd, host name, /tmp and fake GPU, so that ``mpsrun --hosts`` and ``mpiexec -hosts`` run across hosts for real.

Each host is one long-lived init process (``unshare --net --mount --uts --propagation private``, this module run as
a program) that mounts its own tmpfs on /tmp and /run and takes its host name; everything else runs "on the host"
through ``nsenter`` into its namespaces. The hosts' network is a bridge in a namespace of its own (a switch process),
with one veth pair per host: nothing outside it is reachable, and nothing of it exists in this machine's own network
namespace. The set-up writes each host's files (ssh keys, sshd's and ssh's configuration, /etc/hosts, the fake GPU)
into its own /tmp through ``/proc/PID/root``, so all of it goes with the host's mount namespace.

Tearing down kills, by pid, every process left in a host's network namespace (all of them started there by a test),
then ends the init processes: the namespaces, mounts, veth pairs and bridge go with them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from helpers import FAKE_MPS, FAKE_NVML, ROOT, locked

#: Where each host keeps its own files, inside its private /tmp (the same path on every host).
HOME = "/tmp/th"
GPU_BIN, NVML_DIR, HOST_TMPDIR = f"{HOME}/gpu/bin", f"{HOME}/gpu/nvml", f"{HOME}/t"
SUBNET = "10.231.0"
SSHD = "/usr/sbin/sshd"
SSH_CONFIG = """Host *
  StrictHostKeyChecking no
  UserKnownHostsFile /dev/null
  GlobalKnownHostsFile /dev/null
  IdentityFile {home}/ssh/id_ed25519
  IdentitiesOnly yes
  BatchMode yes
  LogLevel ERROR
  ConnectTimeout 5
"""
SSHD_CONFIG = """ListenAddress {address}
Port 22
HostKey {home}/ssh_host_ed25519_key
AuthorizedKeysFile {home}/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PidFile none
PrintMotd no
X11Forwarding no
MaxStartups 100:30:200
"""


class Unavailable(Exception):
    """The test hosts cannot be made here (a sandbox refusal, no sshd): the reason, exactly."""


def _run(argv: Sequence[str], what: str, timeout: float = 60) -> str:
    """``argv`` to its end; its failure is :class:`Unavailable` with its own words."""
    try:
        out = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise Unavailable(f"{what}: {' '.join(argv)}: {exc}") from exc
    if out.returncode != 0:
        raise Unavailable(f"{what}: {' '.join(argv)} exited {out.returncode}: {(out.stderr or out.stdout).strip()}")
    return out.stdout


def _netns(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None


class Holder:
    """A process holding namespaces of its own (a host's init, or the switch) until its stdin closes."""

    def __init__(self, unshare: Sequence[str], role: str) -> None:
        argv = ["unshare", *unshare, "--", sys.executable, str(Path(__file__).resolve()), *role.split()]
        try:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True)
        except OSError as exc:
            raise Unavailable(f"{' '.join(argv)}: {exc}") from exc
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if line.strip() != "ready":
            self.proc.wait(timeout=30)
            error = self.proc.stderr.read().strip() if self.proc.stderr else ""
            raise Unavailable(f"{' '.join(argv)} exited {self.proc.returncode}: {error or line.strip()}")
        self.pid = self.proc.pid
        self.net = _netns(self.pid)

    def enter(self, *argv: str, net_only: bool = False, wd: str = str(ROOT)) -> list[str]:
        """``argv`` run in this holder's namespaces (its network only, with ``net_only``)."""
        spaces = ["--net"] if net_only else ["--net", "--mount", "--uts", f"--wd={wd}"]
        return ["nsenter", f"--target={self.pid}", *spaces, "--", *argv]

    def processes(self) -> list[int]:
        """Every live process in this holder's network namespace but the holder itself."""
        found = []
        for name in os.listdir("/proc"):
            if name.isdigit() and int(name) != self.pid and _netns(int(name)) == self.net:
                with contextlib.suppress(OSError):
                    if Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                        found.append(int(name))
        return found

    def end(self) -> None:
        """Kill what runs in its namespaces (by pid), then let the holder go, and with it the namespaces."""
        for _ in range(50):
            left = self.processes()
            if not left:
                break
            for pid in left:
                with contextlib.suppress(OSError):
                    os.kill(pid, 9)
            time.sleep(0.05)
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream:
                stream.close()


class TestHost:
    """One test host: its name, address and init process; what runs on it, and what it holds."""

    __test__ = False  # not a test class, for pytest

    def __init__(self, name: str, index: int) -> None:
        self.name, self.index = name, index
        self.address = f"{SUBNET}.{index}"
        self.init = Holder(["--net", "--mount", "--uts", "--propagation", "private"], f"host {name}")
        self.sshd: subprocess.Popen | None = None
        self.gpus: list[dict] = []
        self.services: set[int] = set()  # pids of daemons a helper runs on the host (tests/testslurm.py's), not a job's

    def argv(self, *argv: str, wd: str = str(ROOT)) -> list[str]:
        """``argv`` as run on this host (its network, mounts and host name; working directory ``wd``)."""
        return self.init.enter(*argv, wd=wd)

    def run(self, *argv: str, timeout: float = 120, **kwargs: object) -> subprocess.CompletedProcess[str]:
        """``argv`` on this host to its end, its output captured as text."""
        return subprocess.run(self.argv(*argv), capture_output=True, text=True, timeout=timeout, **kwargs)

    def popen(self, *argv: str, **kwargs: object) -> subprocess.Popen:
        """``argv`` started on this host (nsenter execs it: the pid is the program's own)."""
        return subprocess.Popen(self.argv(*argv), **kwargs)

    def path(self, inner: str) -> Path:
        """``inner`` (an absolute path on this host, in its private /tmp say) as this machine reaches it."""
        return Path(f"/proc/{self.init.pid}/root") / inner.lstrip("/")

    def processes(self) -> list[int]:
        """The live processes on this host but its init, sshd and :attr:`services`: what jobs left running."""
        keep = ({self.sshd.pid} if self.sshd is not None else set()) | self.services
        return [pid for pid in self.init.processes() if pid not in keep]

    def described(self) -> list[str]:
        """:meth:`processes`, each as ``pid: command line``."""
        lines = []
        for pid in self.processes():
            with contextlib.suppress(OSError):
                words = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                lines.append(f"{pid}: {b' '.join(words).decode(errors='replace').strip()}")
        return lines

    def session_dirs(self) -> list[str]:
        """The session directories in this host's MPSRUN_TMPDIR."""
        root = self.path(f"{HOST_TMPDIR}/mpsrun-{os.getuid()}")
        return sorted(p.name for p in root.iterdir()) if root.is_dir() else []

    def write(self, inner: str, text: str, mode: int = 0o644) -> None:
        """A file of this host's, written from outside."""
        path = self.path(inner)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        path.chmod(mode)

    def clear(self) -> None:
        """Kill what a job left running on the host (by pid), and remove its session directories."""
        for pid in self.processes():
            with contextlib.suppress(OSError):
                os.kill(pid, 9)
        shutil.rmtree(self.path(f"{HOST_TMPDIR}/mpsrun-{os.getuid()}"), ignore_errors=True)

    def end(self) -> None:
        """Kill what runs on the host, its sshd included, and end its namespaces."""
        self.init.end()
        if self.sshd is not None:
            self.sshd.wait(timeout=10)


def _wire(switch: Holder, hosts: Sequence[TestHost]) -> None:
    """A bridge in the switch's namespace, and one veth pair from it to each host (its ``eth0``, its address)."""
    for argv in (["ip", "link", "add", "br0", "type", "bridge"], ["ip", "link", "set", "br0", "up"]):
        _run(switch.enter(*argv, net_only=True), "the test hosts' bridge")
    for host in hosts:
        port = f"p{host.index}"
        for argv in (["ip", "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", str(host.init.pid)],
                     ["ip", "link", "set", port, "master", "br0"], ["ip", "link", "set", port, "up"]):
            _run(switch.enter(*argv, net_only=True), f"{host.name}'s link")
        for argv in (["ip", "addr", "add", f"{host.address}/24", "dev", "eth0"], ["ip", "link", "set", "eth0", "up"]):
            _run(host.init.enter(*argv, net_only=True), f"{host.name}'s address")


def _keys(hosts: Sequence[TestHost]) -> None:
    """A client key every host's root logs in with, and a host key each, made by ssh-keygen on the first host
    (in its private /tmp, so they end with it); each host gets a copy of the client key in its own /tmp."""
    first = hosts[0]
    keys = first.path(f"{HOME}/keys")
    keys.mkdir(parents=True, mode=0o700)
    for host in hosts:
        _run(first.argv("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", host.name, "-f",
                        f"{HOME}/keys/{host.name}"), "ssh-keygen")
    _run(first.argv("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "client", "-f", f"{HOME}/keys/client"),
         "ssh-keygen")
    client, public = (keys / "client").read_text(), (keys / "client.pub").read_text()
    for host in hosts:
        host.write(f"{HOME}/ssh_host_ed25519_key", (keys / host.name).read_text(), 0o600)
        host.write(f"{HOME}/authorized_keys", public, 0o600)
        host.write(f"{HOME}/ssh/id_ed25519", client, 0o600)
    shutil.rmtree(keys)


def _files(host: TestHost, hosts: Sequence[TestHost], gpus: int) -> None:
    """The host's /etc/hosts (every test host by name), ssh's configuration (bound over /etc/ssh/ssh_config, and
    over /root/.ssh where that exists), sshd's, and its fake GPUs, all in its own /tmp."""
    names = "".join(f"{other.address} {other.name}\n" for other in hosts)
    host.write(f"{HOME}/hosts", f"127.0.0.1 localhost\n::1 localhost ip6-localhost\n{names}")
    host.write(f"{HOME}/ssh/config", SSH_CONFIG.format(home=HOME), 0o600)
    host.write(f"{HOME}/sshd_config", SSHD_CONFIG.format(address=host.address, home=HOME))
    binds = [(f"{HOME}/hosts", "/etc/hosts"), (f"{HOME}/ssh/config", "/etc/ssh/ssh_config")]
    if os.path.isdir("/root/.ssh"):
        binds.append((f"{HOME}/ssh", "/root/.ssh"))
    for source, target in binds:
        _run(host.argv("mount", "--bind", source, target), f"{host.name}'s {target}")
    host.gpus = [{"uuid": f"GPU-{host.index:08d}-fake-4000-8000-{i:012d}", "name": f"Fake H100 of {host.name}",
                  "memory_total": 80 << 30} for i in range(gpus)]
    host.write(f"{NVML_DIR}/gpus.json", json.dumps(host.gpus))
    host.write(f"{GPU_BIN}/nvidia-cuda-mps-control",
               f"#!{sys.executable} -S\nimport sys\nsys.path.insert(0, {str(FAKE_MPS)!r})\n"
               "from fake_mps_client import main\nsys.exit(main(sys.argv[1:]))\n", 0o755)
    host.path(HOST_TMPDIR).mkdir(mode=0o700)


def _start_sshd(host: TestHost) -> None:
    log = host.path(f"{HOME}/sshd.log").open("w")
    with log:
        host.sshd = host.popen(SSHD, "-D", "-e", "-f", f"{HOME}/sshd_config", stdin=subprocess.DEVNULL,
                               stdout=log, stderr=subprocess.STDOUT)


def _reachable(hosts: Sequence[TestHost], timeout: float = 30) -> None:
    """Until every host with an sshd answers ``ssh NAME true`` from the first (no prompt: BatchMode)."""
    deadline = time.monotonic() + timeout
    for host in hosts:
        if host.sshd is None:
            continue
        while True:
            out = hosts[0].run("ssh", host.name, "true", timeout=30)
            if out.returncode == 0:
                break
            if host.sshd.poll() is not None or time.monotonic() > deadline:
                log = host.path(f"{HOME}/sshd.log").read_text()
                raise Unavailable(f"ssh {host.name} true: {out.stderr.strip()}; sshd: {log.strip()}")
            time.sleep(0.1)


def environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a job started on a test host runs with: each host's own fake GPU (at the same paths on every
    host), and mpsrun from this checkout."""
    path = os.pathsep.join([GPU_BIN, os.path.dirname(sys.executable), os.environ.get("PATH", "/usr/bin:/bin")])
    python = os.pathsep.join(filter(None, [str(FAKE_NVML), str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {name: value for name, value in os.environ.items()
           if not name.startswith(("CUDA_", "MPSRUN_", "PMI_", "HYDRA_", "SLURM_", "OMPI_", "PYTEST_"))}
    env.update(PATH=path, PYTHONPATH=python, MPSRUN_FAKE_NVML=NVML_DIR, MPSRUN_TMPDIR=HOST_TMPDIR)
    return {**env, **(extra or {})}


def ensure_sshd() -> None:
    """Debian's sshd, installed as CI's other services are (its service is never started: we run our own)."""
    if os.path.exists(SSHD):
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    with locked(Path(__file__)):  # one install at a time among xdist's workers
        for argv in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "openssh-server"]):
            if os.path.exists(SSHD):
                break
            out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600, stdin=subprocess.DEVNULL)
            if out.returncode != 0:
                raise Unavailable(f"{' '.join(argv)} exited {out.returncode}: {out.stderr.strip()[-500:]}")


@contextlib.contextmanager
def test_hosts(names: Sequence[str] = ("h1", "h2"), gpus: int = 1, without_sshd: Sequence[str] = ()) -> Iterator[
        dict[str, TestHost]]:
    """Test hosts ``names`` (h1, h2, ...), each with ``gpus`` fake GPUs and an sshd (none on ``without_sshd``),
    by name; on leaving, nothing of them is left. Raises :class:`Unavailable` where they cannot be made."""
    if os.geteuid() != 0:
        raise Unavailable("test hosts need root (namespaces, mounts, sshd)")
    ensure_sshd()
    made: list[Holder | TestHost] = []
    try:
        switch = Holder(["--net"], "switch")
        made.append(switch)
        hosts = []
        for index, name in enumerate(names, 1):
            hosts.append(TestHost(name, index))
            made.append(hosts[-1])
        _wire(switch, hosts)
        _keys(hosts)
        for host in hosts:
            _files(host, hosts, gpus)
            if host.name not in without_sshd:
                _start_sshd(host)
        _reachable(hosts)
        yield {host.name: host for host in hosts}
    finally:
        for thing in reversed(made):
            thing.end()


def _init(name: str) -> None:
    """A host's init, in its new namespaces: private tmpfs on /tmp and /run (/run/sshd for sshd), its loopback up,
    its host name; says ``ready`` and holds the namespaces until its stdin ends."""
    for target, mode in (("/tmp", "1777"), ("/run", "755")):
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"mode={mode},size=256m", f"th-{name}", target], check=True)
    os.mkdir("/run/sshd", 0o755)
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    socket.sethostname(name)
    _hold()


def _hold() -> None:
    print("ready", flush=True)
    sys.stdin.read()


test_hosts.__test__ = False  # type: ignore[attr-defined]  # not a test, for pytest

if __name__ == "__main__":
    if sys.argv[1] == "host":
        _init(sys.argv[2])
    else:
        _hold()

