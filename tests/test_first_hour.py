"""A new user's first hour (issue 26, C): each surprise measured on a CPU machine, kept as a test.

Python ranks report errors as Python does; a GPU named without a driver is said to have no effect;
``bench`` without a GPU or CuPy is one line; ``-v`` says what really happened; ``--help`` fits a
terminal and knows ``-np4`` and typos; the examples say in one line what they need; and what
``mpirun`` users reach for, ``-x`` and ``--output-filename``, works on every path.
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys

import pytest
from helpers import MPSRUN, PATHS, ROOT, mpsrun, run_job

HOST_MEMORY = "sharing host memory as read-only NumPy arrays"


def _no_device() -> dict[str, str]:
    """The environment with no CUDA device in sight (on the GPU machine too, where CuPy finds the real one)."""
    return {**os.environ, "CUDA_VISIBLE_DEVICES": ""}


@pytest.mark.parametrize("path", PATHS)
def test_a_missing_python_script_is_pythons_one_line(path, fake_gpu, tmp_path):
    """``mpsrun -np 2 python nosuchfile.py`` says what ``python nosuchfile.py`` says, once per rank, and exits 2
    (it printed two 12-line tracebacks of runpy and mpi4py and exited 1)."""
    pytest.importorskip("mpi4py")
    out = run_job(path, [], [sys.executable, str(tmp_path / "nosuchfile.py")], ranks=2)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    assert out.stderr.count("can't open file") == 2, out.stderr


@pytest.mark.parametrize(("path", "error", "code"), [*[(path, "ValueError", 1) for path in PATHS],
                                                     ("local", "KeyboardInterrupt", 130)])
def test_a_python_ranks_traceback_holds_only_the_programs_frames(path, fake_gpu, tmp_path, error, code):
    """An uncaught exception in a Python rank shows the program's frames only (it carried 8 frames of mpi4py's
    runner and runpy; a KeyboardInterrupt still did), and the job's exit code is Python's (1, or 130: SIGINT)."""
    pytest.importorskip("mpi4py")
    script = tmp_path / "boom.py"
    script.write_text(f"def fail():\n    raise {error}('boom')\n\n\nfail()\n")
    out = run_job(path, [], [sys.executable, str(script)], ranks=2)
    assert out.returncode == code, out.stderr
    frames = re.findall(r'File "([^"]+)"', out.stderr)
    assert frames and set(frames) == {str(script)}, out.stderr
    assert f"{error}: boom" in out.stderr


def test_bench_without_a_gpu_says_so_in_one_line(no_gpu):
    """``mpsrun bench`` without a driver: one line and exit 3; with ``--json`` the reason is on stdout too
    (it was a traceback, and --json printed nothing)."""
    for argv in (["bench"], ["bench", "--json"]):
        out = mpsrun(*argv)
        assert out.returncode == 3, out.stderr
        assert out.stderr.count("\n") == 1 and "bench needs an NVIDIA GPU" in out.stderr, out.stderr
    assert "bench needs an NVIDIA GPU" in json.loads(out.stdout)["error"]


def test_bench_without_cupy_says_so_in_one_line(fake_gpu):
    """With a GPU and MPS but no CuPy, ``bench`` names the missing package in one line (no traceback of the
    calibration's child process)."""
    code = ("import sys; sys.modules['cupy'] = None; from mpsrun.tools.bench import main; "
            "sys.exit(main(['--json']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 3, out.stderr
    assert out.stderr.count("\n") == 1 and "bench needs CuPy" in out.stderr, out.stderr
    assert "needs CuPy" in json.loads(out.stdout)["error"]


def test_bench_help_is_plain_text():
    """``bench --help`` shows no reStructuredText markup (it showed ````mpsrun bench````)."""
    out = mpsrun("bench", "--help")
    assert out.returncode == 0 and "``" not in out.stdout and "--repeats" in out.stdout


@pytest.mark.parametrize("gpus", ["5", "GPU-abc"])
def test_gpus_named_without_a_driver_are_said_to_have_no_effect(no_gpu, gpus):
    """``--gpus 5`` or ``--gpus GPU-abc`` on a machine without a driver: the job runs (as without MPS) and a
    warning says that --gpus has no effect (there was no word at all)."""
    out = mpsrun("--gpus", gpus, "-np", "2", "--launcher", "local", sys.executable, "-c", "print(1)")
    assert out.returncode == 0, out.stderr
    assert "warning: --gpus has no effect without MPS and a GPU" in out.stderr, out.stderr


def test_mps_session_says_a_named_gpu_is_ignored_without_a_driver(no_gpu):
    """``mps_session(gpu=5)`` without a driver runs without MPS and says that GPU 5 is ignored."""
    code = "from mpsrun import mps_session\nwith mps_session(gpu=5) as session:\n    assert not session.enabled\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "running without MPS" in out.stderr and "GPU 5 ignored" in out.stderr, out.stderr


def test_verbose_without_a_gpu_says_what_happened(no_gpu):
    """``-v`` without a GPU says ``no GPU`` and no daemon (it said ``GPU -`` and ``daemons ready``)."""
    out = mpsrun("-v", "-np", "2", "--launcher", "local", sys.executable, "-c", "pass")
    assert out.returncode == 0, out.stderr
    assert "rank 1: no GPU" in out.stderr and "set up without MPS after" in out.stderr, out.stderr
    assert "GPU -" not in out.stderr and "daemons ready" not in out.stderr


def test_help_fits_a_terminal():
    """``--help`` has no line longer than 110 characters (the variables' line had 377) and names bench's options."""
    out = mpsrun("--help")
    assert out.returncode == 0
    assert max(map(len, out.stdout.splitlines())) <= 110
    assert "mpsrun bench [--ranks 1,2,4,8,16] [--repeats 3]" in out.stdout


def test_np_glued_to_its_number(no_gpu):
    """``-np4`` is four ranks (it was refused as ``not 'p4'``)."""
    out = mpsrun("-np4", "--launcher", "local", sys.executable, "-c",
                 "import os; os.write(1, os.environ['WORLD_SIZE'].encode() + b'\\n')")  # one write: lines never mix
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["4"] * 4


def test_a_mistyped_option_gets_a_suggestion():
    """An unknown option near a known one is answered with the known one, exit 2."""
    out = mpsrun("--tag-ouput", "-np", "1", "true")
    assert out.returncode == 2
    assert "did you mean --tag-output?" in out.stderr


def test_the_docs_have_no_stray_blank_lines_or_second_version():
    """The README's prose has no run of blank lines; the CHANGELOG names each version once; docs/benchmarks.md
    quotes the
    old summary wording only as the wording of its day."""
    prose = re.sub(r"```.*?```", "(code)", (ROOT / "README.md").read_text(), flags=re.S)
    assert "\n\n\n" not in prose
    headings = re.findall(r"^## (\S+)", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert len(headings) == len(set(headings)) and not {"Unreleased", "unreleased"} & set(headings), headings
    benchmarks = (ROOT / "docs" / "benchmarks.md").read_text()
    for quote in re.finditer(r"`[^`]*verified as MPS clients[^`]*`", benchmarks):
        assert benchmarks[max(0, quote.start() - 40):quote.start()].rstrip().endswith("then read"), quote.group()


def test_per_rank_limits_without_a_gpu_is_one_line(no_gpu):
    """examples/per_rank_limits.py without a GPU: rank 0 says what it needs, once; no traceback (there were two)."""
    out = subprocess.run([*MPSRUN, "-np", "2", "--launcher", "local", sys.executable,
                          str(ROOT / "examples" / "per_rank_limits.py")],
                         capture_output=True, text=True, timeout=120, env=_no_device())
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr and out.stderr.count("needs CuPy and an NVIDIA GPU") == 1, out.stderr


def test_shared_table_says_host_memory_once(no_gpu):
    """examples/shared_table.py with 3 ranks and no GPU: the host-memory notice comes once (it came per rank)."""
    pytest.importorskip("numpy")
    out = subprocess.run([*MPSRUN, "-np", "3", "--launcher", "local", sys.executable,
                          str(ROOT / "examples" / "shared_table.py"), "--mib", "1", "--samples", "1000"],
                         capture_output=True, text=True, timeout=120, env=_no_device())
    assert out.returncode == 0, out.stderr
    assert out.stderr.count(HOST_MEMORY) == 1, out.stderr
    assert len(re.findall(r"rank \d/3: table of 1 MiB", out.stdout)) == 3


@pytest.mark.parametrize("path", PATHS)
def test_x_gives_every_rank_the_callers_variables(path, fake_gpu, monkeypatch):
    """``-x NAME`` gives each rank the value NAME has where the command line is read, ``-x NAME=VALUE`` that
    value, and ``-x NAME`` of an unset NAME leaves it unset, on every path; under --hosts the remote
    environment (here an mpiexec -genv) does not win."""
    monkeypatch.setenv("FIRST_HOUR_CALLER", "the caller's")
    monkeypatch.delenv("FIRST_HOUR_UNSET", raising=False)
    options = ["-x", "FIRST_HOUR_CALLER", "-x", "FIRST_HOUR_GIVEN=a b=c", "-x", "FIRST_HOUR_UNSET"]
    if path == "hosts":
        options += ["--mpiexec-arg=-genv", "--mpiexec-arg=FIRST_HOUR_CALLER", "--mpiexec-arg=remote"]
    code = ("import json, os; os.write(1, json.dumps([os.environ.get(name) for name in "
            "('FIRST_HOUR_CALLER', 'FIRST_HOUR_GIVEN', 'FIRST_HOUR_UNSET')]).encode() + b'\\n')")  # one write
    out = run_job(path, options, [sys.executable, "-c", code], ranks=2)
    assert out.returncode == 0, out.stderr
    assert [json.loads(line) for line in out.stdout.splitlines()] == [["the caller's", "a b=c", None]] * 2


@pytest.mark.parametrize("value", ["RANK", "CUDA_VISIBLE_DEVICES=0", "MPSRUN_GPU", "1A", "A-B=1", ""])
def test_x_refuses_what_mpsrun_sets_and_what_is_no_name(value):
    """``-x`` of a variable mpsrun sets in each rank, or of no variable name, is a usage error (exit 2)."""
    out = mpsrun("-x", value, "-np", "1", "true")
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and "-x" in out.stderr


@pytest.mark.parametrize("path", PATHS)
def test_output_filename_gives_each_rank_its_files(path, fake_gpu, tmp_path):
    """``--output-filename DIR``: rank N's stdout and stderr go to DIR/rank.N/stdout and DIR/rank.N/stderr, in
    directories made with the user's umask; nothing of the ranks' reaches the terminal."""
    target = tmp_path / "out"
    code = "import os, sys; print('out', os.environ['RANK']); print('err', os.environ['RANK'], file=sys.stderr)"
    out = run_job(path, ["--output-filename", str(target)], [sys.executable, "-c", code], ranks=3)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "" and "err " not in out.stderr
    umask = os.umask(0)
    os.umask(umask)
    for rank in range(3):
        directory = target / f"rank.{rank}"
        assert (directory / "stdout").read_text() == f"out {rank}\n"
        assert (directory / "stderr").read_text() == f"err {rank}\n"
        assert stat.S_IMODE(directory.stat().st_mode) == 0o777 & ~umask


def test_output_filename_that_cannot_be_made_is_one_line(fake_gpu, tmp_path):
    """A DIR that cannot be made (a file is in the way) is one line and exit 3, before any rank starts."""
    (tmp_path / "file").write_text("")
    out = mpsrun("--output-filename", tmp_path / "file" / "out", "-np", "2", "--launcher", "local", "true")
    assert out.returncode == 3, out.stderr
    assert out.stderr.count("\n") == 1 and "--output-filename" in out.stderr, out.stderr
