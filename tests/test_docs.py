"""Every code block of the README and of docs/*.md is run as written, or is plainly not a command.

The convention (docs/development.md points here):

* **Markers.** An HTML comment on the line right before a block's opening fence says what the block needs, or why it
  is not run::

      <!-- needs: gpu -->          a real GPU and MPS: run in the GPU tier (marked gpu), skipped elsewhere
      <!-- needs: slurm -->        a Slurm cluster: run where one answers (as tests/test_slurm.py), skipped elsewhere
      <!-- needs: torch -->        PyTorch: run with the fake GPU where torch imports, skipped elsewhere
      <!-- needs: hosts -->        other hosts: never run here; its mpsrun commands are only parsed
      <!-- not run: output -->     what a command prints
      <!-- not run: listing -->    a file tree or other text shown, not a command
      <!-- not run: benchmark -->  measurements on a GPU machine (benchmarks/, docs/benchmarks.md): hours, not a test

  ``needs`` may name several, separated by commas. An unmarked block runs as on a laptop: no GPU, no CuPy, the
  README's venv (mpsrun with NumPy, mpi4py and MPICH's ``mpiexec`` on PATH); what the README and docs show runs
  there as written. A job script or ``srun`` line runs on the test cluster, against the fake GPU.
* **```python blocks.** The first line says how the block runs: ``# python NAME.py`` or
  ``# mpsrun OPTIONS python NAME.py``. The block is written to NAME.py in a fresh directory and run so, with the fake
  ``# mpsrun OPTIONS python NAME.py``. The block is written to NAME.py in a fresh directory and run so, on the laptop
  (or with ``needs: gpu`` on the real GPU); it must exit 0 without a traceback.
* **```sh blocks.** Every line is blank, a comment, or a command. A command is ``mpsrun ...`` or
  ``mpiexec ...`` (after any ``NAME=VALUE`` words, which set the command's environment), or ``srun ...``, which
  needs slurm. Commands run from the repository's root on the laptop, each ``python`` word standing for this
  interpreter, ``mpsrun`` for ``python -m mpsrun`` and ``mpiexec`` for MPICH's (helpers.mpiexec); they must exit 0,
  or N where the line's comment says ``exit N``. ``srun`` gets ``--overcommit`` (the CI cluster has as many CPUs as
  the machine). A block that starts ``#!/bin/bash`` is a job script: it needs slurm and is submitted as written
  (``python`` and ``mpsrun`` standing for the same) with ``sbatch --wait --overcommit --gpus=0`` from the
  repository's root (the test cluster's GPU is the fake, which Slurm cannot allocate).
  The README's first two blocks are the set-up commands: tests/test_readme.py runs the first's job and checks that
  CI runs the second.
* **Plain ``` blocks** are never run. Each is marked ``not run``, or is a usage synopsis (every line starts
  ``mpsrun`` followed by a subcommand or ``[``, or continues the line above, indented; its options must be ones the
  subcommand's ``--help`` names), or is mpsrun's own messages (every line starts ``mpsrun: ``).
* No other language is used.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import MPSRUN, ROOT, cluster_answers, mpiexec

from mpsrun.config.commandline import parse_args

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NEEDS = {"gpu", "slurm", "torch", "hosts"}
NOT_RUN = {"output", "listing", "benchmark"}
#: First on PYTHONPATH for the laptop: a CuPy that cannot be imported, also where CuPy is installed.
LAPTOP = ROOT / "tests" / "laptop"
SUBCOMMANDS = ("bench", "tune", "doctor", "top", "status", "cleanup")
#: The README's set-up commands (its first two sh blocks), which tests/test_readme.py and CI run.
SETUP_BLOCKS = 2


@dataclass(frozen=True)
class Block:
    """One fenced code block: where it is, its language, its marker and its text."""

    page: Path
    line: int  # of the opening fence, counting from 1
    language: str
    marker: str  # the HTML comment's text on the line before, or ""
    text: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def needs(self) -> set[str]:
        found = re.fullmatch(r"needs: *(.+)", self.marker)
        return {need.strip() for need in found.group(1).split(",")} if found else set()

    @property
    def not_run(self) -> str | None:
        found = re.fullmatch(r"not run: *(\S+)", self.marker)
        return found.group(1) if found else None


def blocks(page: Path) -> list[Block]:
    """The fenced code blocks of ``page``, in order."""
    lines = page.read_text().splitlines()
    found, index = [], 0
    while index < len(lines):
        fence = re.fullmatch(r"```(\S*)", lines[index])
        if fence is None:
            index += 1
            continue
        end = lines.index("```", index + 1)
        before = lines[index - 1].strip() if index else ""
        marker = re.fullmatch(r"<!--\s*(.*?)\s*-->", before)
        found.append(Block(page, index + 1, fence.group(1), marker.group(1) if marker else "",
                           "\n".join(lines[index + 1:end]) + "\n"))
        index = end + 1
    return found


ALL_BLOCKS = [block for page in PAGES for block in blocks(page)]


def is_setup(block: Block) -> bool:
    """One of the README's two set-up commands (tests/test_readme.py's)."""
    readme_sh = [b for b in ALL_BLOCKS if b.page.name == "README.md" and b.page.parent == ROOT and b.language == "sh"]
    return block in readme_sh[:SETUP_BLOCKS]


def split_comment(line: str) -> tuple[str, str]:
    """A shell line's command and its trailing comment (a ``#`` after a blank, outside quotes)."""
    quote = None
    for index, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (index == 0 or line[index - 1].isspace()):
            return line[:index].rstrip(), line[index + 1:].strip()
    return line.rstrip(), ""


@dataclass(frozen=True)
class Command:
    """One command line of a sh block."""

    block: Block
    number: int  # line number in the page
    text: str
    comment: str

    @property
    def words(self) -> list[str]:
        return shlex.split(self.text)

    @property
    def environment(self) -> dict[str, str]:
        """The ``NAME=VALUE`` words it starts with."""
        found = {}
        for word in self.words:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", word):
                break
            name, value = word.split("=", 1)
            found[name] = value
        return found

    @property
    def argv(self) -> list[str]:
        """The words after the assignments."""
        return self.words[len(self.environment):]

    @property
    def expected_exit(self) -> int:
        found = re.search(r"\bexit (\d+)\b", self.comment)
        return int(found.group(1)) if found else 0

    @property
    def needs(self) -> set[str]:
        return self.block.needs | ({"slurm"} if self.argv[:1] == ["srun"] else set())

    @property
    def id(self) -> str:
        return f"{self.block.page.relative_to(ROOT)}:{self.number}"


def commands(block: Block) -> list[Command]:
    """The command lines of a sh block that is not a job script."""
    found = []
    for offset, line in enumerate(block.text.splitlines(), start=1):
        command, comment = split_comment(line)
        if command.strip():
            found.append(Command(block, block.line + offset, command, comment))
    return found


def is_job_script(block: Block) -> bool:
    return block.text.startswith("#!/bin/bash\n")


SH_BLOCKS = [b for b in ALL_BLOCKS if b.language == "sh" and not is_setup(b) and b.not_run is None]
#: What a sh block's command lines may start with: the tests run nothing else.
RUNNABLE = (["mpsrun"], ["mpiexec"], ["srun"])
COMMANDS = [c for b in SH_BLOCKS if not is_job_script(b) for c in commands(b) if c.argv[:1] in RUNNABLE]
JOB_SCRIPTS = [b for b in SH_BLOCKS if is_job_script(b)]
PY_BLOCKS = [b for b in ALL_BLOCKS if b.language == "python" and b.not_run is None]


def expand(words: list[str]) -> list[str]:
    """The words as this test runs them: ``python`` is this interpreter, ``mpsrun`` is ``python -m mpsrun``, and
    ``mpiexec`` is MPICH's."""
    expanded: list[str] = []
    for word in words:
        if word in ("python", "python3"):
            expanded.append(sys.executable)
        elif word == "mpsrun":
            expanded += MPSRUN
        elif word == "mpiexec":
            expanded.append(mpiexec())
        else:
            expanded.append(word)
    return expanded


def marks(needs: set[str], *more: pytest.MarkDecorator) -> list[pytest.MarkDecorator]:
    """The pytest marks for what a block needs."""
    found = list(more)
    if "gpu" in needs:
        found.append(pytest.mark.gpu)
    if "slurm" in needs:
        found.append(pytest.mark.slurm)
    if "hosts" in needs:
        found.append(pytest.mark.skip(reason="needs other hosts: its mpsrun commands are only parsed here"))
    return found


def with_needs(items: list, name_of: Callable[[object], str]) -> list:
    """``items`` as pytest parameters, named by ``name_of`` and marked for what each needs."""
    return [pytest.param(item, id=name_of(item), marks=marks(item.needs)) for item in items]


@pytest.fixture
def needs(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """What the test's block needs, provided: a laptop's machine (no GPU, no CuPy; this venv's bin, with MPICH's
    mpiexec, on PATH), a Slurm cluster with the fake GPU, or for ``gpu`` the real one (the GPU tier; a private
    MPSRUN_TMPDIR, checked empty afterwards), PyTorch. Skips where a need cannot be met."""
    wanted = next(iter(request.node.callspec.params.values())).needs
    if "torch" in wanted:
        pytest.importorskip("torch")
    if "slurm" in wanted and not cluster_answers():
        if os.environ.get("MPSRUN_REQUIRE_SLURM") == "1":
            pytest.fail("MPSRUN_REQUIRE_SLURM=1 but no Slurm cluster answers (see ci/slurm/start.sh)")
        pytest.skip("no Slurm cluster (ci/slurm/start.sh starts one)")
    if "slurm" in wanted:
        request.getfixturevalue("fake_gpu")  # it checks that nothing is left behind
        yield
        return
    if "gpu" not in wanted:
        request.getfixturevalue("no_gpu")
        monkeypatch.setenv("PATH", os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]))
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(LAPTOP), os.environ["PYTHONPATH"]]))  # no CuPy
        yield
        return
    base = request.getfixturevalue("short_tmp")
    monkeypatch.setenv("MPSRUN_TMPDIR", str(base))
    yield
    root = base / f"mpsrun-{os.getuid()}"
    assert not root.exists() or not list(root.iterdir()), list(root.iterdir())


def test_every_block_follows_the_convention():
    """Every block is python, sh or plain; every marker is one the tests know; every sh line is blank, a comment or
    a command the tests can run; every python block names how it runs."""
    assert ALL_BLOCKS, "no code blocks found"
    for block in ALL_BLOCKS:
        assert block.language in ("python", "sh", ""), f"{block.where}: unknown language {block.language!r}"
        if block.marker:
            assert block.needs <= NEEDS and (block.needs or block.not_run in NOT_RUN), \
                f"{block.where}: unknown marker <!-- {block.marker} -->"
        if block.language == "python" and block.not_run is None:
            first = block.text.splitlines()[0].removeprefix("# ").split()
            assert first[0] in ("python", "mpsrun") and first[-2] == "python" and first[-1].endswith(".py"), \
                f"{block.where}: the first line must say how it runs: # python NAME.py or # mpsrun ... python NAME.py"
    for block in SH_BLOCKS:
        if is_job_script(block):
            assert "slurm" in block.needs, f"{block.where}: a job script needs <!-- needs: slurm -->"
            continue
        for command in commands(block):
            assert command.argv[:1] in RUNNABLE, \
                f"{command.id}: {command.text!r} is no command the tests run (mark the block not run, or needs)"


def test_plain_blocks_are_output_or_synopses():
    """A block without a language is marked not run, or is mpsrun's own messages, or is a usage synopsis whose
    options the subcommand's ``--help`` names."""
    helps: dict[str, str] = {}
    for block in (b for b in ALL_BLOCKS if b.language == "" and b.not_run is None):
        lines = block.text.splitlines()
        if lines and all(line.startswith("mpsrun: ") for line in lines):
            continue
        synopses: list[str] = []
        for line in lines:
            if re.match(r"mpsrun ([a-z]+ )?\[", line):
                synopses.append(line)
            else:
                assert synopses and line.startswith(" "), \
                    f"{block.where}: mark it <!-- not run: output --> or make it a synopsis (mpsrun [...] ...)"
                synopses[-1] += " " + line.strip()
        for synopsis in synopses:
            word = synopsis.split()[1]
            sub = word if word in SUBCOMMANDS else ""
            if sub not in helps:
                out = subprocess.run([*MPSRUN, *([sub] if sub else []), "--help"], capture_output=True, text=True,
                                     timeout=60)
                assert out.returncode == 0, out.stderr
                helps[sub] = out.stdout
            for option in re.findall(r"(?<![\w-])(--?[a-z][a-z0-9-]*)", synopsis):
                assert option in helps[sub], f"{block.where}: mpsrun {sub} has no option {option}"


@pytest.mark.parametrize("block", with_needs(PY_BLOCKS, lambda b: b.where))
def test_every_python_block_runs_as_written(block, needs, tmp_path):
    """Each Python block runs as written, by the command its first line names (``# python NAME`` or
    ``# mpsrun ... python NAME``), on the laptop (or, needing a GPU, on the real one)."""
    command = block.text.splitlines()[0].removeprefix("# ").split()
    (tmp_path / command[-1]).write_text(block.text)
    runner = [sys.executable] if command[0] == "python" else [*MPSRUN, *command[1:-2], sys.executable]
    out = subprocess.run([*runner, command[-1]], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr


def _venv_path() -> str:
    """PATH with this interpreter's directory on it (where pip put mpiexec), as for a user of the venv."""
    return os.pathsep.join([os.environ["PATH"], os.path.dirname(sys.executable)])


@pytest.mark.parametrize("command", [
    pytest.param(c, id=c.id, marks=marks(c.needs, *([pytest.mark.mpiexec] if "mpiexec" in c.argv else [])))
    for c in COMMANDS])
def test_every_shell_command_runs_as_written(command, needs):
    """Each command of a sh block, run from the repository's root (``python`` being this interpreter), exits as the
    page says: 0, or the ``exit N`` of its comment; a successful one prints no traceback."""
    argv = expand(command.argv)
    if argv[0] == "srun":
        argv.insert(1, "--overcommit")
    env = {**os.environ, "PATH": _venv_path(), **command.environment}
    out = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert out.returncode == command.expected_exit, out.stdout + out.stderr
    if command.expected_exit == 0:
        assert "Traceback" not in out.stderr, out.stderr


@pytest.mark.parametrize("block", with_needs(JOB_SCRIPTS, lambda b: b.where))
def test_every_job_script_runs_as_written(block, needs, short_tmp):
    """Each job script is submitted as written (``python`` being this interpreter, ``mpsrun`` ``python -m mpsrun``)
    from the repository's root, and the job exits 0. The test cluster has no GPUs to allocate (its GPU is the fake):
    ``--gpus=0`` on sbatch's command line overrides the script's ``#SBATCH --gpus``."""
    text = re.sub(r"(?<![\w./-])python3?(?![\w./-])", sys.executable, block.text)
    text = re.sub(r"(?<![\w./-])mpsrun(?![\w./-])", f"{sys.executable} -m mpsrun", text)
    script = short_tmp / "job.sh"
    script.write_text(text)
    log = short_tmp / "job.out"
    out = subprocess.run(["sbatch", "--wait", "--overcommit", "--gpus=0", "-o", str(log), "--chdir", str(ROOT),
                          str(script)],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "PATH": _venv_path()})
    assert out.returncode == 0, out.stdout + out.stderr + (log.read_text() if log.exists() else "")


def test_commands_not_run_here_parse():
    """Every mpsrun job command of the docs that should succeed, also one that needs other hosts, a cluster or a GPU,
    is one mpsrun reads without error (shell variables such as ``$SLURM_NTASKS`` standing for 4)."""
    lines = [c.argv for c in COMMANDS if c.expected_exit == 0]
    for block in JOB_SCRIPTS:
        lines += [shlex.split(line, comments=True) for line in block.text.splitlines() if line.startswith("mpsrun ")]
    checked = 0
    for argv in (argv for argv in lines if "mpsrun" in argv):
        words = [re.sub(r"^\$\{?\w+\}?$", "4", word) for word in argv[argv.index("mpsrun") + 1:]]
        if words and words[0] not in SUBCOMMANDS:
            parse_args(words, {})
            checked += 1
    assert checked


def test_the_docs_pages_are_linked_and_links_resolve():
    """Every docs page is linked from the README, and every relative link of the README and docs/ names a file that
    exists (and, with ``#anchor``, a heading of it)."""
    readme = (ROOT / "README.md").read_text()
    for page in PAGES[1:]:
        assert f"(docs/{page.name})" in readme, f"the README does not link docs/{page.name}"
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            assert file.exists(), f"{page.relative_to(ROOT)}: no file {path}"
            if anchor and file.suffix == ".md":
                assert anchor in anchors(file), f"{page.relative_to(ROOT)}: no heading #{anchor} in {path}"


def anchors(page: Path) -> set[str]:
    """The anchors GitHub makes of a page's headings."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    found = set()
    for heading in re.findall(r"^#+ (.*)$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        found.add(slug)
    return found


NEW_PAGES = [ROOT / "README.md", *(ROOT / "docs" / name for name in (
    "command-line.md", "multi-node.md", "python-api.md", "tools.md", "troubleshooting.md", "architecture.md",
    "development.md"))]


@pytest.mark.parametrize("page", NEW_PAGES, ids=[p.name for p in NEW_PAGES])
def test_prose_is_narrow_and_paragraphs_short(page):
    """Prose lines are at most 120 characters wide (code blocks and table rows aside) and no paragraph runs over 150
    words; the README stays a page of about 200 lines."""
    text = re.sub(r"```.*?```", "```", page.read_text(), flags=re.S)
    for line in text.splitlines():
        assert len(line) <= 120 or line.startswith("|"), f"{page.name}: a line is {len(line)} wide: {line[:60]}..."
    for paragraph in re.split(r"\n\s*\n|\n(?=\s*(?:- |\d+\. ))", text):  # a list item is a paragraph
        if not paragraph.startswith("|"):
            assert len(paragraph.split()) <= 150, f"{page.name}: {len(paragraph.split())} words: {paragraph[:60]}..."
    if page.name == "README.md":
        assert len(page.read_text().splitlines()) <= 210


def test_the_docs_have_no_stray_blank_lines_or_second_version():
    """The README's prose has no run of blank lines; the CHANGELOG names each version once; docs/benchmarks.md and
    the lab notebook it came from (benchmarks/results/NOTEBOOK.md) quote the old summary wording only as the wording
    of its day."""
    prose = re.sub(r"```.*?```", "(code)", (ROOT / "README.md").read_text(), flags=re.S)
    assert "\n\n\n" not in prose
    headings = re.findall(r"^## (\S+)", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert len(headings) == len(set(headings)) and not {"Unreleased", "unreleased"} & set(headings), headings
    for page in (ROOT / "docs" / "benchmarks.md", ROOT / "benchmarks" / "results" / "NOTEBOOK.md"):
        text = page.read_text()
        for quote in re.finditer(r"`[^`]*verified as MPS clients[^`]*`", text):
            before = text[max(0, quote.start() - 40):quote.start()]
            assert before.rstrip().endswith("then read"), (page.name, quote.group())


def test_benchmarks_do_not_say_mpsrun_leaves_the_queues_alone():
    """docs/benchmarks.md once said 'mpsrun leaves the variable alone' of CUDA_DEVICE_MAX_CONNECTIONS, the opposite of
    what mpsrun does since issue 40 (a hostile user found it): no page says so."""
    for page in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        assert "mpsrun leaves the variable alone" not in " ".join(page.read_text().split()), page.name


def test_the_benchmarks_page_is_short_and_each_section_names_its_card():
    """docs/benchmarks.md is a results page read in minutes, not a notebook: at most 300 lines, and every ``## ``
    section holds a table that names the card it was measured on (H100 or H200), with the driver and the date, in the
    table or in the paragraph right before it (its caption)."""
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    assert len(text.splitlines()) <= 300, f"docs/benchmarks.md has {len(text.splitlines())} lines"
    sections = re.split(r"^## ", re.sub(r"```.*?```", "", text, flags=re.S), flags=re.M)[1:]
    assert sections
    for section in sections:
        title, paragraphs = section.splitlines()[0], re.split(r"\n\s*\n", section)
        captioned = [paragraphs[i - 1] + "\n" + table for i, table in enumerate(paragraphs)
                     if i and table.strip().startswith("|")]
        assert captioned, f"## {title}: no table"
        assert any(re.search(r"\bH[12]00\b", table) and re.search(r"\b\d{3}\.\d+\.\d+\b", table)
                   and re.search(r"\b20\d\d-\d\d-\d\d\b", table) for table in captioned), \
            f"## {title}: no table names its card (H100 or H200), driver and date"
