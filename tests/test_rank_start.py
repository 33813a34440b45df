"""How a rank starts: as clean on every path (default signal handling, its own session, no controller address, its
descriptors), its supervisor's own option pairs, and the job's token that admits it.
"""

import json
import signal
import subprocess
import sys

import pytest
from helpers import (
    PATHS,
    job_argv,
    settle,
)

pytestmark = pytest.mark.mpiexec


RANK_VIEW = """
import json, os, signal, sys
fds = sorted(int(fd) for fd in os.listdir("/proc/self/fd"))
names = ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2")
handlers = {n: str(signal.getsignal(getattr(signal, n))) for n in names}
view = {"fds": fds, "handlers": handlers, "stdin": os.readlink("/proc/self/fd/0"), "own_session": os.getsid(0) == os.getpid(),
        "control": [k for k in os.environ if k.startswith("MPSRUN_CONTROL")]}
open(os.path.join(os.environ["VIEW_DIR"], os.environ["RANK"] + ".json"), "w").write(json.dumps(view))
"""


@pytest.mark.parametrize("path", PATHS)
def test_a_rank_starts_as_clean_on_every_path(fake_gpu, short_tmp, monkeypatch, path):
    """However its supervisor was started (forked by the local launcher, or by an MPI launcher), a rank gets the
    default signal handling, its own session, no controller address, and /dev/null as stdin except rank 0; under
    the local launcher only descriptors 0-2 (MPI launchers hand ranks their own)."""
    monkeypatch.setenv("VIEW_DIR", str(short_tmp))
    out = subprocess.run(job_argv(path, [], [sys.executable, "-c", RANK_VIEW]), capture_output=True, text=True,
                         timeout=120, stdin=subprocess.PIPE)
    assert out.returncode == 0, out.stderr
    views = {int(p.stem): json.loads(p.read_text()) for p in short_tmp.glob("*.json")}
    assert sorted(views) == [0, 1, 2]
    for rank, view in views.items():
        assert view["handlers"]["SIGINT"] == str(signal.default_int_handler), view
        assert all(view["handlers"][n] == str(signal.SIG_DFL) for n in ("SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2"))
        assert view["own_session"] and view["control"] == []
        if rank > 0 and path == "local":
            assert view["stdin"] == "/dev/null"
        if path == "local":
            assert view["fds"][:3] == [0, 1, 2] and len(view["fds"]) == 4, view  # the 4th: the listing itself
    settle(fake_gpu)


def test_the_rank_shim_reads_only_its_own_option_pairs():
    """The shim's own line, as mpsrun writes it: ``--name N`` pairs, ``--``, the command; anything else (an
    unknown name, a value that is not a whole number, a name without a value, no ``--``) is a usage error."""
    from mpsrun.rank.cli import _parse

    assert _parse(["--rank", "3", "--local-rank", "1", "--size", "4", "--local-size", "2", "--", "a", "-b"]) == (
        {"rank": 3, "local_rank": 1, "size": 4, "local_size": 2}, ["a", "-b"])
    assert _parse(["--", "a"]) == ({}, ["a"])
    for bad in (["--rank", "x", "--", "a"], ["--rank", "--", "a"], ["--ranks", "1", "--", "a"], ["--rank", "1"]):
        with pytest.raises(SystemExit, match="usage"):
            _parse(bad)


def test_only_the_jobs_token_admits_a_rank():
    """The controller admits a hello only with the job's token (compared in constant time; OpenSSL's
    compare_digest is imported with the controller, while the daemons start, not at the first hello)."""
    from mpsrun.agent.ranks import token_matches
    from mpsrun.runtime.protocol import new_token

    token = new_token()
    assert token_matches(token, token)
    assert not token_matches(new_token(), token) and not token_matches(token[:-1], token)
    assert not token_matches(None, token) and not token_matches(token.encode(), token)
