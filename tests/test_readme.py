"""The README tells the truth: its commands are the ones CI and the tests run, its options exist.

Every code block of the README and of docs/ runs in tests/test_docs.py (the Python blocks too); here are the
README's own promises: the two set-up commands, the option tables, the tox environments and subcommands it names.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

from mpsrun.config.options import options

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


def test_ci_runs_the_tests_in_a_clean_environment():
    """.ci/run starts itself again under ``env -i`` (HOME, PATH, LANG and CI only) before anything else, so no test
    leans on the workplace's variables (PYTHONUNBUFFERED=1 there hid a test that failed on users' machines)."""
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    clean = next(i for i, line in enumerate(lines) if line.startswith("exec env -i "))
    assert clean < lines.index("cd \"$(dirname \"$0\")/..\"") < lines.index(SH_BLOCKS[1].strip())
    names = {word.split("=")[0] for word in lines[clean].split()[3:] if "=" in word}
    assert names == {"HOME", "PATH", "LANG", "CI", "CI_CLEAN_ENVIRONMENT"}, names


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



def table_options(text, start, end):
    """The options named in the first column of the table between ``start`` and ``end`` in ``text``."""
    section = text.split(start, 1)[1].split(end, 1)[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    return set(re.findall(r"`(-{1,2}[a-z][a-z0-9-]*)", "".join(rows)))


#: What the parser takes: every declared option (the parser is built from them), and argparse's own two.
KNOWN = {flag for spec in options().values() for flag in spec.flags} | {"-h", "--help", "--version"}
COMMAND_LINE = (ROOT / "docs" / "command-line.md").read_text()
SHORT_TABLE = ("## The options most jobs use", "\n## ")
FULL_TABLE = ("\n## Options\n", "\n### Options in detail")


def test_every_option_in_the_tables_exists():
    """Each option that the README's short table or docs/command-line.md's full table names is an option of the
    parser."""
    for named in (table_options(README, *SHORT_TABLE), table_options(COMMAND_LINE, *FULL_TABLE)):
        assert named and named <= KNOWN, named - KNOWN


def test_the_full_table_names_every_option():
    """docs/command-line.md's table names every option the parser knows, so the full list stays complete."""
    named = table_options(COMMAND_LINE, *FULL_TABLE)
    assert named >= KNOWN, KNOWN - named


def test_tox_environments_named_in_the_docs_exist():
    """Every tox environment the README or docs/ tell people to run is defined in tox.ini."""
    named = set()
    for page in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        for match in re.findall(r"tox -e ([a-z0-9,]+)", page.read_text()):
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
