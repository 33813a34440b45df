"""A rank's environment is the caller's, plus what the README lists, on every path (issue 26).

Each rank dumps its environment; the test compares it with the environment mpsrun was started
with. The only differences allowed are the variables mpsrun documents (the rank's place, its GPU and
MPS settings, its session directory) and the MPI launcher's own (``OMPI_*``, ``PMI_*``, ...); a
variable the caller set must reach the rank unchanged, PATH and LD_LIBRARY_PATH above all (Open MPI
started by absolute path puts its own directories first: measured on the H100 machine).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import MPSRUN, PATHS, gpu_job_argv, job_argv, mpiexec, mpsrun, run_job, settle

from mpsrun.runtime.constants import LAUNCHER_PREFIXES

#: What mpsrun gives every rank (README, "The command").
DOCUMENTED = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MPSRUN_RANK", "MPSRUN_GPU", "MPSRUN_SESSION_DIR",
              "CUDA_VISIBLE_DEVICES", "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY", "MASTER_ADDR", "MASTER_PORT",
              "XLA_PYTHON_CLIENT_MEM_FRACTION", "NCCL_DEBUG", "NCCL_DEBUG_FILE", "NCCL_MULTI_RANK_GPU_ENABLE",
              "NCCL_MAX_CTAS", "CUDA_DEVICE_MAX_CONNECTIONS", "CUDA_LOG_FILE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE",
              "ROLE_NAME", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS"}
#: Open MPI narrows OCL_ICD_FILENAMES for its processes; where no mpsrun process knows the caller's value (a bare
#: --per-node, --hosts) the rank has the launcher's, as under mpirun (README, "The command").
OPEN_MPI_OWN = {"OCL_ICD_FILENAMES"}

DUMP = "import json, os, sys\nopen(os.path.join(sys.argv[1], os.environ['RANK'] + '.json'), 'w').write(" \
       "json.dumps(dict(os.environ)))\n"


def callers_environment(directory: object) -> dict[str, str]:
    """What a process started directly from here gets (os.environ is not all of it: a library may have set
    variables in the C environment only)."""
    subprocess.run([sys.executable, "-c", DUMP.replace("os.environ['RANK']", "'caller'"), str(directory)],
                   check=True, timeout=60)
    return dict(json.loads(Path(str(directory), "caller.json").read_text()))


def differences(caller: dict[str, str], rank: dict[str, str]) -> dict[str, tuple[str | None, str | None]]:
    """What differs between the caller's environment and a rank's, less what mpsrun and the launcher add."""
    names = (set(caller) | set(rank)) - DOCUMENTED
    return {name: (caller.get(name), rank.get(name)) for name in sorted(names)
            if caller.get(name) != rank.get(name) and not name.startswith(LAUNCHER_PREFIXES)}


@pytest.mark.mpiexec
@pytest.mark.parametrize("path", PATHS)
def test_a_ranks_environment_is_the_callers(fake_gpu, short_tmp, monkeypatch, path):
    """A variable of the caller's own, a PATH and an LD_LIBRARY_PATH with the caller's directories first: every
    rank gets them unchanged, and nothing else differs but mpsrun's documented variables and the launcher's."""
    bin_dir = os.path.dirname(sys.executable)
    monkeypatch.setenv("PATH", os.pathsep.join([str(short_tmp / "first"), os.environ["PATH"], bin_dir]))
    monkeypatch.setenv("LD_LIBRARY_PATH", os.pathsep.join([str(short_tmp / "mylib"), "/usr/lib"]))
    monkeypatch.setenv("MY_SETTING", "kept as given")
    caller = callers_environment(short_tmp)
    out = run_job(path, [], [sys.executable, "-c", DUMP, str(short_tmp)], ranks=2)
    assert out.returncode == 0, out.stderr
    for rank in (0, 1):
        env = json.loads((short_tmp / f"{rank}.json").read_text())
        assert differences(caller, env) == {}, (path, rank)
        assert env["RANK"] == str(rank) and env["WORLD_SIZE"] == "2"
    settle(fake_gpu)


def test_what_mpsrun_manages_never_leaks_from_the_caller(fake_gpu, short_tmp, monkeypatch):
    """Stale MPS settings and mpsrun's own control variables in the caller's environment never reach a rank."""
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", "/nonexistent/pipe")
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "7")
    out = run_job("local", [], [sys.executable, "-c", DUMP, str(short_tmp)], ranks=1)
    assert out.returncode == 0, out.stderr
    env = json.loads((short_tmp / "0.json").read_text())
    assert env["CUDA_MPS_PIPE_DIRECTORY"] != "/nonexistent/pipe" and "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in env
    assert not [name for name in env if name.startswith("MPSRUN_CONTROL") or name == "MPSRUN_JOB_ID"]
    settle(fake_gpu)


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
def test_a_ranks_environment_is_the_callers_under_open_mpi(short_tmp, monkeypatch, path):
    """The same on the GPU machine, real MPS and Open MPI: its mpiexec started by absolute path (as ``--mpiexec
    /usr/bin/mpiexec`` did) rewrote PATH and LD_LIBRARY_PATH in every rank (a wrapper's ``python3`` became the
    system's), and it narrows OCL_ICD_FILENAMES; now each rank has the caller's values (the launcher's own
    OCL_ICD_FILENAMES where no mpsrun process knows the caller's). Under a bare --per-node the launcher is
    started by name, as the README says to."""
    monkeypatch.setenv("PATH", os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]))
    monkeypatch.setenv("LD_LIBRARY_PATH", os.pathsep.join([str(short_tmp / "mylib"), "/usr/lib"]))
    caller = callers_environment(short_tmp)
    argv = gpu_job_argv(path, [], [sys.executable, "-c", DUMP, str(short_tmp)], ranks=2)
    if path == "per-node":
        argv[0] = os.path.basename(argv[0])
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    for rank in (0, 1):
        env = json.loads((short_tmp / f"{rank}.json").read_text())
        allowed = OPEN_MPI_OWN if path in ("per-node", "hosts") else set()
        assert set(differences(caller, env)) <= allowed, (path, rank, differences(caller, env))


@pytest.mark.mpiexec
def test_whatever_the_launcher_changes_of_the_callers_is_put_back(fake_gpu, short_tmp, monkeypatch):
    """An mpiexec that changes, removes and prefixes the caller's variables (Open MPI narrows OCL_ICD_FILENAMES
    and, started by absolute path, puts its directories first on PATH): every rank has the caller's values, and
    what the launcher adds of its own (here HYDRA_EXTRA) stays."""
    real = mpiexec()
    wrapper = short_tmp / "wrapped" / "mpiexec"
    wrapper.parent.mkdir()
    wrapper.write_text(f"#!/bin/sh\nexport MY_SETTING=changed PATH=/usr/bin:$PATH HYDRA_EXTRA=1\nunset MY_OTHER\n"
                       f"exec {real} \"$@\"\n")
    wrapper.chmod(0o755)
    monkeypatch.setenv("MY_SETTING", "kept as given")
    monkeypatch.setenv("MY_OTHER", "also kept")
    # The wrapper's shell exports PWD where the caller has none (a clean environment): the launcher's own, which
    # stays as HYDRA_EXTRA does. A caller's PWD, as a shell gives it, is the caller's to keep.
    monkeypatch.setenv("PWD", os.getcwd())
    caller = callers_environment(short_tmp)
    out = subprocess.run([*MPSRUN, "-np", "2", "--launcher", "mpiexec", "--mpiexec", str(wrapper), sys.executable,
                          "-c", DUMP, str(short_tmp)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for rank in (0, 1):
        env = json.loads((short_tmp / f"{rank}.json").read_text())
        assert differences(caller, env) == {}, rank
        assert env["HYDRA_EXTRA"] == "1"
    settle(fake_gpu)


@pytest.mark.parametrize("value", ["RANK", "CUDA_VISIBLE_DEVICES=0", "MPSRUN_GPU", "1A", "A-B=1", ""])
def test_x_refuses_what_mpsrun_sets_and_what_is_no_name(value):
    """``-x`` of a variable mpsrun sets in each rank, or of no variable name, is a usage error (exit 2)."""
    out = mpsrun("-x", value, "-np", "1", "true")
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and "-x" in out.stderr


@pytest.mark.parametrize("path", PATHS)
def test_x_gives_every_rank_the_callers_variables(path, fake_gpu, monkeypatch):
    """``-x NAME`` gives each rank the value NAME has where the command line is read, ``-x NAME=VALUE`` that
    value, and ``-x NAME`` of an unset NAME leaves it unset, on every path, with one warning (it was silent;
    under --per-node, where every rank reads the command line, none); under --hosts the remote environment (here an
    mpiexec -genv) does not win."""
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
    warned = [line for line in out.stderr.splitlines() if "-x" in line]
    assert warned == ([] if path == "per-node" else [
        "mpsrun: warning: -x FIRST_HOUR_UNSET: FIRST_HOUR_UNSET is not set here, so the ranks have none"]), out.stderr


@pytest.mark.mpiexec
@pytest.mark.parametrize("path", PATHS)
def test_a_large_environment_reaches_the_ranks(fake_gpu, path):
    """An environment of 1.5 MB (Linux allows 2 MiB by default) reaches every rank whole (local and mpiexec failed
    with exit 3 and 'the job's controller went away': the welcome, which carries it, was over a line's limit)."""
    big = {f"BIGVAR{i}": "z" * 10000 for i in range(150)}
    check = "import os; assert all(len(os.environ[f'BIGVAR{i}']) == 10000 for i in range(150))"
    out = subprocess.run(job_argv(path, [], [sys.executable, "-c", check], ranks=2), capture_output=True, text=True,
                         timeout=120, env={**os.environ, **big})
    assert out.returncode == 0, out.stderr[-2000:]
    settle(fake_gpu)
