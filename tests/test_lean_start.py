"""What keeps the rank supervisor's start and the command's start short, and what that must not break.

The supervisor starts once per rank on the path of every job: its imports are the built-in modules
(``_signal``, ``_socket``, ``select``; :mod:`mpsrun.runtime.wire` for JSON, :func:`mpsrun.runtime.processes.spawn` for the
rank's process). These tests hold that line and check that the replacements behave as what they replace.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mpsrun import cli
from mpsrun.mps import readahead as ahead
from mpsrun.runtime import wire
from mpsrun.runtime.processes import python_without_site, spawn, wait

REPO = Path(__file__).resolve().parent.parent
#: Standard-library modules whose imports cost a supervisor milliseconds each, and that it does without.
HEAVY = {"subprocess", "socket", "signal", "json", "contextlib", "re", "threading", "enum", "selectors", "typing",
         "shutil", "logging", "dataclasses", "argparse", "pathlib"}


def test_the_rank_supervisor_imports_no_heavy_module():
    """The supervisor's whole import path (as mpiexec starts it: ``python -S``) leaves out every module of HEAVY;
    one of them imported again by any of its modules fails here."""
    code = "import sys; import mpsrun.rank.supervisor; print(','.join(sorted(m for m in sys.modules)))"
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, check=True,
                         cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert HEAVY & set(out.stdout.strip().split(",")) == set()


def test_the_supervisor_comes_from_mpsrun_not_from_the_working_directory(tmp_path):
    """A job run from a directory that holds another ``mpsrun`` package (a checkout, a stray directory) or a module
    named as one of the standard library's (a project's ``math.py``) still runs its own supervisor on the standard
    library: nothing comes from the working directory, which ``-c`` puts first on the path (it used to win)."""
    foreign = tmp_path / "mpsrun"
    foreign.mkdir()
    (foreign / "__init__.py").write_text("raise SystemExit('the foreign mpsrun was imported')\n")
    (tmp_path / "math.py").write_text("raise SystemExit('the project math.py was imported')\n")
    argv = [*python_without_site("mpsrun.rank.supervisor"), "--", "true"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MPSRUN_CONTROL")}
    out = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60)
    assert "foreign" not in out.stderr and "project" not in out.stderr
    assert "needs MPSRUN_CONTROL" in out.stderr  # mpsrun's own supervisor, refusing to run without a job
    assert out.returncode == 2


@pytest.mark.parametrize("value", [
    {"type": "welcome", "env": {"A": "b", "ü": "\u2603\n\"\\"}, "lines": ["x", ""], "grace": 5.0, "tag": True,
     "lock": None, "big": 10**30, "neg": -3, "tiny": 1e-300, "managed": ["CUDA_VISIBLE_DEVICES"]},
    [1, [2, [3, {}]], []], "text", 0, None, True,
])
def test_wire_writes_what_json_writes_and_reads_it_back(value):
    """mpsrun.runtime.wire's bytes are json.dumps(..., separators=(",", ":")) byte for byte, and both read them alike."""
    text = wire.dumps(value)
    assert text == json.dumps(value, separators=(",", ":"))
    assert wire.loads(text.encode()) == json.loads(text) == value


def test_wire_reads_json_numbers_and_constants_as_json_does():
    """Whitespace around the value, NaN and Infinity, and numbers: as json.loads reads them."""
    value = wire.loads(b' {"a": NaN, "b": -Infinity, "c": 1.5e3, "d": 12} \n')
    assert math.isnan(value["a"]) and value["b"] == -math.inf and value["c"] == 1500.0 and value["d"] == 12


@pytest.mark.parametrize("data", [b"", b"  ", b"{", b'{"a":1} x', b"nul", b"\xff", b"[1,]", b"'a'"])
def test_wire_refuses_what_is_not_one_json_value(data):
    """Whatever json.loads refuses, wire.loads refuses with a ValueError (a peer's garbage is dropped, never a
    crash of the controller)."""
    with pytest.raises(ValueError):
        json.loads(data)
    with pytest.raises(ValueError):
        wire.loads(data)


def test_wire_refuses_what_json_cannot_hold():
    """An object JSON cannot hold is a TypeError, as with json.dumps."""
    with pytest.raises(TypeError):
        wire.dumps({"a": object()})


def test_spawn_runs_the_program_in_a_session_of_its_own(tmp_path):
    """spawn() starts the program as its own session leader, with the given environment and stdout, and wait()
    gives its exit code as Popen does."""
    read, write = os.pipe()
    code = "import os, sys; print(os.getsid(0) == os.getpid(), os.environ['X']); sys.exit(7)"
    pid = spawn(sys.executable, [sys.executable, "-c", code], {"X": "y", "PATH": os.environ["PATH"]}, stdout=write)
    os.close(write)
    with open(read) as out:
        assert out.read().split() == ["True", "y"]
    assert wait(pid) == 7


def test_spawn_restores_the_signals_python_ignores_and_passes_inheritable_descriptors():
    """The program starts with SIGPIPE at its default (Python ignores it; Popen restores it: ``cat`` shows what it
    inherited) and with the descriptors this process inherited (an MPI launcher's PMI_FD): an inheritable one is
    passed on."""
    read, write = os.pipe()
    pid = spawn("/bin/cat", ["cat", "/proc/self/status"], dict(os.environ), stdout=write)
    os.close(write)
    with open(read) as out:
        ignored = next(int(line.split()[1], 16) for line in out if line.startswith("SigIgn:"))
    assert wait(pid) == 0
    assert not ignored & (1 << (signal.SIGPIPE - 1))
    keep_read, keep_write = os.pipe()
    os.set_inheritable(keep_write, True)
    pid = spawn(sys.executable, [sys.executable, "-c", f"import os; os.write({keep_write}, b'passed')"],
                dict(os.environ))
    os.close(keep_write)
    assert wait(pid) == 0
    assert os.read(keep_read, 100) == b"passed"
    os.close(keep_read)


def test_spawn_raises_as_popen_does_when_the_program_cannot_run(tmp_path):
    """A program that cannot be executed is an OSError in the parent, of the class Popen raises (missing: not
    found; no execute permission: permission denied), and the child that tried is reaped."""
    import psutil

    not_executable = tmp_path / "data"
    not_executable.write_text("data\n")
    not_executable.chmod(0o644)
    before = {child.pid for child in psutil.Process().children()}
    for program, error in (("/nonexistent/program", FileNotFoundError), (str(not_executable), PermissionError)):
        with pytest.raises(error):
            spawn(program, [program], dict(os.environ))
        with pytest.raises(error):
            subprocess.Popen([program])
    assert {child.pid for child in psutil.Process().children()} <= before


def test_spawn_gives_the_program_the_parent_death_signal():
    """The program gets ``death_signal`` when the process that spawned it ends (a supervisor SIGKILLed: its rank
    must not run on)."""
    code = textwrap.dedent("""
        import os, sys, time
        sys.path.insert(0, sys.argv[1])
        from mpsrun.runtime.processes import spawn
        pid = spawn("/bin/sleep", ["sleep", "30"], dict(os.environ))
        print(pid, flush=True)
        time.sleep(30)
    """)
    parent = subprocess.Popen([sys.executable, "-c", code, str(REPO)], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.01)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_signal_during_spawn_reaches_neither_the_child_before_exec_nor_the_wakeup_descriptor():
    """Signals are held across the fork: the forked child resets every Python handler before it takes them, so
    none runs there and writes to the parent's wake-up descriptor (which the parent would read as its own)."""
    read, write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    old_wakeup = signal.set_wakeup_fd(write)
    old_handler = signal.signal(signal.SIGUSR1, lambda *_: None)
    try:
        for _ in range(20):
            pid = spawn(sys.executable, [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), 10)"],
                        dict(os.environ))
            assert wait(pid) == -signal.SIGUSR1  # the default action, not our handler
        with pytest.raises(BlockingIOError):
            os.read(read, 100)
    finally:
        signal.set_wakeup_fd(old_wakeup)
        signal.signal(signal.SIGUSR1, old_handler)
        os.close(read)
        os.close(write)


@pytest.mark.parametrize(("argv", "env", "expected"), [
    (["-np", "4", "python", "x.py"], {}, True),
    (["--per-node", "python", "x.py"], {}, False),
    (["--hosts=a,b", "-np", "2", "true"], {}, False),
    (["-np", "2", "true"], {"MPSRUN_PER_NODE": "1"}, False),
    (["-np", "2", "true"], {"MPSRUN_PER_NODE": "0"}, True),
    (["status"], {}, False),
    (["--help"], {}, False),
    ([], {}, False),
])
def test_the_early_gpu_read_is_wanted_only_for_a_job_on_this_node(argv, env, expected):
    """The command forks its GPU-reading child before parsing its options only when the words look like a job
    of this node: not for --per-node/--hosts (each node keeper reads its GPUs), subcommands or help."""
    assert ahead.wanted(argv, env) is expected


def test_a_command_that_needs_no_gpu_list_ends_the_child_read_ahead(fake_gpu):
    """A child forked early for a command that then turns out to need no GPU list (here a usage error) is
    killed and reaped before the command returns: nothing of it is left."""
    import threading

    if threading.active_count() > 1:
        pytest.skip("another thread runs here: ahead.start() rightly does not fork")
    ahead.start()
    child = ahead._child[0] if ahead._child else None
    assert child is not None
    assert cli.main(["-np", "0", "true"]) == 2
    assert ahead._child is None
    with pytest.raises(ChildProcessError):
        os.waitpid(child, os.WNOHANG)


def test_a_line_nested_deeper_than_python_parses_is_dropped_not_raised():
    """A peer's line of 100,000 opening brackets is garbage like any other: the link drops it (it used to raise
    RecursionError out of the controller's loop)."""
    from mpsrun.runtime.protocol import _decode

    assert _decode(b"[" * 100_000) is None
    assert _decode(b'{"type": "hello"}') == {"type": "hello"}


def test_a_session_record_nested_deeper_than_python_parses_is_unreadable(tmp_path):
    """A corrupt session.json of 100,000 nested brackets is a RecordError (``status`` lists it as unreadable and
    ``cleanup`` goes on), not a RecursionError out of the command."""
    from mpsrun.session.record import RecordError, SessionRecord

    record = tmp_path / "session.json"
    record.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(RecordError):
        SessionRecord.read(record)
