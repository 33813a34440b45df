"""MPI launchers and hosts that fail or are not what they seem: an mpiexec that ends without starting its ranks,
or is no MPI launcher at all, a stranger's bytes on a --hosts job's control port, options smuggled into ssh
through --hosts, hosts slow to resolve, mpiexec options under --per-node. Each is said at once, in one line.
"""

from __future__ import annotations

import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from helpers import (
    MPSRUN,
    descendants,
    fake,
    job_argv,
    settle,
    wait_for,
)

PYTHON_PASS = [sys.executable, "-c", "pass"]  # the no_gpu fixture's PATH finds nothing


FAKE_HYDRA = """#!/bin/sh
case "$1" in --version) echo "HYDRA build details:"; echo "    Version: 4.1.2"; exit 0;; esac
{body}
"""


def _fake_mpiexec(directory: Path, body: str) -> str:
    """An mpiexec that says it is MPICH's Hydra, then runs ``body`` (a shell snippet) instead of starting ranks."""
    path = directory / "mpiexec"
    path.write_text(FAKE_HYDRA.format(body=body))
    path.chmod(0o755)
    return str(path)


def _control_port(job: subprocess.Popen[str]) -> tuple[str, int]:
    """The --hosts controller's TCP address, as its per-node ranks were told it."""
    def address() -> str | None:
        for proc in psutil.Process(job.pid).children(recursive=True):
            try:
                value = proc.environ().get("MPSRUN_CONTROL", "")
            except psutil.Error:
                continue
            if value.startswith("tcp:"):
                return value
        return None

    host, _, port = wait_for(address, 60, "no per-node rank was told the controller's address", proc=job)[4:] \
        .rpartition(":")
    return host, int(port)


def _send(address: tuple[str, int], data: bytes, hold: float = 0.0) -> None:
    with socket.create_connection(address, timeout=5) as conn:
        try:
            conn.sendall(data)
        except OSError:  # the controller dropped us: that is its answer
            return
        time.sleep(hold)


def test_strangers_on_the_control_port_do_not_end_a_hosts_job(fake_gpu, short_tmp):
    """The line ``{x`` used to kill any --hosts job (a SystemError out of the private JSON scanner). Now garbage,
    unterminated and oversized lines, nested JSON, a wrong token, valid messages before a hello, a seeded fuzz of
    200 random lines and 100 held connections all reach a live controller, and the job still ends with exit 0."""
    release = short_tmp / "release"  # (the ranks run until every stranger has come)
    job = subprocess.Popen(job_argv("hosts", [], fake("--hold", "0", "--until-file", str(release)), ranks=2),
                           stderr=subprocess.PIPE, text=True)
    address = _control_port(job)
    rng = random.Random(25)  # noqa: S311 - a reproducible fuzz, not a secret
    lines = [b"{x\n", b"[" * 100_000 + b"\n", b"\xff\xfe\x00\n", b'{"type": "exited", "rank": 0, "returncode": 3}\n',
             b'{"type": "hello", "role": "node", "token": "wrong"}\n', b"x" * (2 << 20),
             *(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300))) + b"\n" for _ in range(200))]
    for line in lines:
        _send(address, line)
    held = [socket.create_connection(address, timeout=5) for _ in range(100)]
    release.touch()
    _, err = job.communicate(timeout=120)
    for conn in held:
        conn.close()
    assert job.returncode == 0, err
    settle(fake_gpu)


@pytest.mark.parametrize("hosts", ["-x", "bad host", "a,-oProxyCommand=x", "a:b"])
def test_hosts_are_validated_like_host_file_lines(no_gpu, hosts):
    """``--hosts -x`` reached ssh as an option and ``'bad host'`` gave Hydra's exit 255: each is now one line and
    exit 2, before anything starts."""
    out = subprocess.run([*MPSRUN, "-np", "2", "--hosts", hosts, "true"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and "must name hosts" in out.stderr


@pytest.mark.parametrize("path", ["mpiexec", "hosts"])
def test_an_mpiexec_that_ends_without_its_ranks_is_reported_at_once(fake_gpu, short_tmp, path):
    """An mpiexec that exits 1 after 0.5 s without starting a rank: the job ends with mpiexec's code and says so,
    on both launchers that use one (under --hosts it used to wait forever)."""
    launcher = _fake_mpiexec(short_tmp, "sleep 0.5; exit 1")
    where = ["--hosts", "localhost"] if path == "hosts" else ["--launcher", "mpiexec"]
    out = subprocess.run([*MPSRUN, "-np", "2", *where, "--mpiexec", launcher, "true"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 1, out.stderr
    assert "mpiexec exited with code 1 before rank(s) 0-1 started" in out.stderr
    settle(fake_gpu)


@pytest.mark.parametrize("launcher", ["/bin/false", "/bin/true", "exit-1-later"])
def test_a_hosts_job_whose_mpiexec_is_no_mpi_launcher_is_refused_at_once(no_gpu, launcher):
    """``--hosts localhost --mpiexec /bin/false`` (or /bin/true, or a script that exits 1 after 0.5 s) still ran
    after 10 minutes, deaf to SIGTERM: mpsrun cannot tell how to name the hosts to it, and now says so (exit 2)
    before anything starts."""
    if launcher == "exit-1-later":
        script = no_gpu / "mpiexec"
        script.write_text("#!/bin/sh\nsleep 0.5\nexit 1\n")
        script.chmod(0o755)
        launcher = str(script)
    out = subprocess.run([*MPSRUN, "-np", "2", "--hosts", "localhost", "--mpiexec", launcher, *PYTHON_PASS],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "cannot tell how this mpiexec takes hosts" in out.stderr, out.stderr


def test_a_signal_ends_a_hosts_job_whose_mpiexec_never_starts_its_ranks(fake_gpu, short_tmp):
    """An mpiexec that hangs without starting ranks: SIGTERM to mpsrun ends the job (143) within --grace and its
    own deadlines; SIGTERM and SIGINT used to print 'stopping' and leave it running."""
    launcher = _fake_mpiexec(short_tmp, "exec sleep 300")
    job = subprocess.Popen([*MPSRUN, "-np", "2", "--grace", "1", "--hosts", "localhost", "--mpiexec", launcher,
                            "true"], stderr=subprocess.PIPE, text=True)
    wait_for(lambda: descendants(job, "sleep 300"), 30, "mpiexec did not start", proc=job)
    job.send_signal(signal.SIGTERM)
    _, err = job.communicate(timeout=30)
    assert job.returncode == 143, err
    settle(fake_gpu)


@pytest.mark.mpiexec
def test_mpiexec_options_under_per_node_are_said_to_do_nothing(fake_gpu):
    """--mpiexec-arg given to mpsrun --per-node (where the user's launcher already started the ranks) is said once
    to have no effect, as under --launcher local (it was ignored without a word)."""
    out = subprocess.run(job_argv("per-node", ["--mpiexec-arg", "-verbose"], ["true"], ranks=2), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("have no effect with --per-node") == 1, out.stderr
    settle(fake_gpu)


def test_hosts_slow_to_resolve_are_looked_up_only_until_the_timeout(monkeypatch):
    """Names that each take a resolver's time (unreachable DNS): the controller stops looking them up when the job's
    --timeout has passed, and listens on every interface (the timeout then ends the job). A host file of 100 such
    names under --timeout 3 took 22 s, 3,000 more than 40 s, before the job's clock could say a word (fourth
    hostile pass)."""
    import time

    from mpsrun.job import hosts
    from mpsrun.runtime.deadline import Deadline

    looked_up = []

    def slow(host, *args, **kwargs):
        looked_up.append(host)
        time.sleep(0.1)
        raise OSError("no resolver")

    monkeypatch.setattr(hosts.socket, "getaddrinfo", slow)
    assert hosts.listen_address([f"h{i}" for i in range(100)], Deadline(0.5)) == ""
    assert 0 < len(looked_up) <= 6, looked_up  # (a loaded machine sleeps longer: fewer)


def test_a_hosts_controller_listens_on_the_address_its_hosts_reach(fake_gpu):
    """The --hosts controller listens where its hosts reach it, not on every interface: over loopback for
    ``--hosts localhost`` (its per-node ranks are told 127.0.0.1). Only hosts that resolve to nothing (the launcher
    then says why) leave it on every interface. tests/test_two_hosts.py checks the same across two hosts."""
    from mpsrun.job.hosts import listen_address
    from mpsrun.runtime.deadline import Deadline

    assert listen_address(["localhost"], Deadline(None)) == "127.0.0.1"
    assert listen_address(["no-such-host.invalid"], Deadline(None)) == listen_address([], Deadline(None)) == ""
    job = subprocess.Popen(job_argv("hosts", [], fake("--hold", "1"), ranks=2), stderr=subprocess.PIPE, text=True)
    host, port = _control_port(job)
    _, err = job.communicate(timeout=120)
    assert job.returncode == 0 and (host, port > 0) == ("127.0.0.1", True), err
    settle(fake_gpu)
