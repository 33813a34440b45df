"""Packaging: the conda recipe agrees with pyproject.toml; pip install . and the wheel work in fresh venvs."""

import re
import subprocess
import sys
import venv
from importlib.metadata import version
from pathlib import Path

import pytest
from helpers import building_from_source

import mpsrun

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
RECIPE = (ROOT / "conda" / "meta.yaml").read_text()


def _requirement(text):
    """('name', 'constraint') with names normalised and spaces removed."""
    match = re.match(r"\s*([A-Za-z0-9_.\-]+)\s*(.*)$", text)
    return match.group(1).lower().replace("_", "-"), match.group(2).replace(" ", "")


def _recipe_section(name):
    block = RECIPE.split(f"\n  {name}:\n", 1)[1]
    lines = []
    for line in block.splitlines():
        if not line.startswith("    - "):
            break
        lines.append(line[len("    - "):])
    return lines


def test_recipe_version_matches_the_package():
    """The conda recipe's version is the package's single version."""
    assert re.search(r'{% set version = "([^"]+)" %}', RECIPE).group(1) == mpsrun.__version__


def test_recipe_run_requirements_match_pyproject():
    """The recipe's run requirements are exactly pyproject's dependencies (plus python), same bounds."""
    recipe = dict(_requirement(r) for r in _recipe_section("run"))
    assert recipe.pop("python") == ">=" + PYPROJECT["project"]["requires-python"].removeprefix(">=")
    assert recipe == dict(_requirement(r) for r in PYPROJECT["project"]["dependencies"])


def test_recipe_tests_the_command_and_the_import():
    """The recipe's own tests run the command line and import the package."""
    assert "mpsrun --help" in RECIPE and re.search(r"imports:\s*\n\s*- mpsrun", RECIPE)
    assert "noarch: python" in RECIPE


def _check_installed(env_dir, cwd) -> None:
    """The venv's `mpsrun` command runs and says this version; the package ships py.typed."""
    version = subprocess.run([str(env_dir / "bin" / "mpsrun"), "--version"], capture_output=True, text=True,
                             check=True, cwd=cwd)
    assert version.stdout.strip() == f"mpsrun {mpsrun.__version__}"
    typed = subprocess.run([str(env_dir / "bin" / "python"), "-c", "import mpsrun, pathlib; "
                            "print((pathlib.Path(mpsrun.__file__).parent / 'py.typed').exists())"],
                           capture_output=True, text=True, check=True, cwd=cwd)
    assert typed.stdout.strip() == "True"


@pytest.mark.slow
@pytest.mark.timeout(300)  # pip builds and installs: about 20 s beside the other tests, minutes on a loaded machine
def test_install_into_a_fresh_venv(tmp_path):
    """The wheel pip builds from this tree (as ``pip install .`` builds and installs it) installs with its
    dependencies into a fresh venv and gives a working ``mpsrun`` command with ``py.typed`` (one build: pip's
    builds are most of the suite's pip time; and no ensurepip: it was half the test's CPU time)."""
    with building_from_source():  # pip builds in the tree: one build at a time
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"),
                        str(ROOT)], check=True, timeout=600)
    [wheel] = (tmp_path / "dist").glob("mpsrun-*.whl")
    env_dir = tmp_path / "venv"
    _install_into_a_fresh_venv(wheel, env_dir)
    _check_installed(env_dir, tmp_path)


def _install_into_a_fresh_venv(wheel, env_dir) -> None:
    """A fresh venv at ``env_dir`` with ``wheel`` and its dependencies installed by pip: ours, with ``--python``
    (pip 22.3 and later), so the venv needs no pip of its own; else the venv's own pip."""
    own_pip = tuple(map(int, version("pip").split(".")[:2])) < (22, 3)
    venv.create(env_dir, with_pip=own_pip)
    python = str(env_dir / "bin" / "python")
    pip = [python, "-m", "pip"] if own_pip else [sys.executable, "-m", "pip", "--python", python]
    subprocess.run([*pip, "install", "-q", str(wheel)], check=True, timeout=600)
