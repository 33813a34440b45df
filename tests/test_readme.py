"""The README tells the truth: its commands are the ones CI and the tests run, its options exist."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import FAKE_CUDA

from mpsrun.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
SH_BLOCKS = re.findall(r"```sh\n(.*?)```", README, re.S)


def test_the_first_two_blocks_are_the_two_commands():
    """The README opens with exactly two one-line commands: the main job and the tests."""
    main_job, tests = SH_BLOCKS[0].strip(), SH_BLOCKS[1].strip()
    assert "\n" not in main_job and "\n" not in tests
    assert main_job.endswith("mpsrun -np 4 python examples/sim.py")
    assert tests.endswith("python -m pytest")


def test_ci_runs_the_readme_test_command_verbatim():
    """.ci/run contains the README's test command as one line, unchanged."""
    assert SH_BLOCKS[1].strip() in (ROOT / ".ci" / "run").read_text().splitlines()


def test_the_main_job_runs(fake_gpu):
    """The main job (mpsrun -np 4 python examples/sim.py) runs to the end and combines the ranks."""
    bin_dir = os.path.dirname(sys.executable)
    env = {**os.environ, "PATH": os.pathsep.join([os.environ["PATH"], bin_dir])}
    command = SH_BLOCKS[0].strip().split("&& ")[-1].split("PATH=$PWD/.venv/bin:$PATH ")[-1].split()
    assert command[:4] == ["mpsrun", "-np", "4", "python"]
    out = subprocess.run([sys.executable, "-m", "mpsrun", *command[1:3], sys.executable, *command[4:]],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    assert re.search(r"pi ~ 3\.1\d+ from \d+ points on 4 ranks|rank 3/4: pi ~ 3\.1", out.stdout)


def test_every_option_in_the_table_exists():
    """Each option the README's table names is an option of the parser."""
    known = {option for action in build_parser()._actions for option in action.option_strings}
    section = README.split("## The command")[1].split("### Exit status")[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    named = set(re.findall(r"`(-{1,2}[a-z][a-z0-9-]*)", "".join(rows)))
    assert named and named <= known, named - known


PY_BLOCKS = re.findall(r"```python\n(.*?)```", README, re.S)


@pytest.mark.parametrize("block", PY_BLOCKS, ids=[f"block{i}" for i in range(len(PY_BLOCKS))])
def test_every_python_block_runs_as_written(block, fake_gpu, tmp_path):
    """Each Python block of the README runs as written, by the command its first line names
    (``# python NAME`` or ``# mpsrun ... python NAME``), with the fake GPU and the CuPy double."""
    command = block.splitlines()[0].removeprefix("# ").split()
    assert command[-2] == "python" and command[-1].endswith(".py"), "the first line names how the block runs"
    (tmp_path / command[-1]).write_text(block)
    runner = [sys.executable] if command[0] == "python" else [sys.executable, "-m", "mpsrun", *command[1:-2],
                                                                sys.executable]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FAKE_CUDA), os.environ["PYTHONPATH"]])}
    out = subprocess.run([*runner, command[-1]], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
def test_tox_environments_named_in_the_readme_exist():
    """Every tox environment the README tells people to run is defined in tox.ini."""
    named = set()
    for match in re.findall(r"tox -e ([a-z0-9,]+)", README):
        named.update(match.split(","))
    assert {"py", "mpi", "lint", "type", "gpu"} <= named
    tox_ini = (ROOT / "tox.ini").read_text()
    env_list = re.search(r"^env_list = (.*)$", tox_ini, re.M).group(1)
    defined = set(re.findall(r"^\[testenv:([a-z0-9]+)\]$", tox_ini, re.M)) | {"py"} | set(env_list.replace(" ", "").split(","))
    assert named <= defined, named - defined


def test_subcommands_in_the_readme_answer_help():
    """mpsrun bench and mpsrun doctor, shown in the README, have working --help."""
    for sub in ("bench", "doctor"):
        assert f"mpsrun {sub}" in README
        out = subprocess.run([sys.executable, "-m", "mpsrun", sub, "--help"], capture_output=True, text=True)
        assert out.returncode == 0 and f"mpsrun {sub}" in out.stdout
