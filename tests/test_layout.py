"""The package's architecture as a contract: layers, no cycles, a standard-library rank supervisor, one public list.

Every ``import`` of mpsrun's own modules is read from the source (function-level and TYPE_CHECKING imports
included), so a dependency cannot hide from these checks.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "mpsrun"

#: Bottom first: a module may import its own package and the layers below it, never one above.
LAYERS = [
    {"errors", "exitcodes"},
    {"runtime"},
    {"config"},
    {"rank"},
    {"mps"},
    {"session"},
    {"shared"},
    {"agent"},
    {"job"},
    {"farm"},
    {"tools", "tuning"},
    {"cli", "_entry", "__main__", "__init__"},
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The mpsrun modules ``path`` imports (``from mpsrun.x import y`` counts as mpsrun.x.y when that is a module)."""
    found: set[str] = set()
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "mpsrun"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], base]).strip(".")
            if base.split(".")[0] != "mpsrun":
                continue
            submodules = {f"{base}.{alias.name}" for alias in node.names} & known
            found |= submodules
            if len(submodules) < len(node.names):  # names the module defines, not only its submodules
                found.add(base)
    return found - {module_name(path)}


def graph() -> dict[str, set[str]]:
    known = set(modules())
    return {name: imports_of(path, known) & known for name, path in modules().items()}


def layer(name: str) -> int:
    top = name.split(".")[1] if "." in name else "__init__"
    return next(index for index, members in enumerate(LAYERS) if top in members)


def test_every_module_belongs_to_a_layer():
    """A new package or top-level module must be placed in the layering (LAYERS) before it can be used."""
    unplaced = [name for name in modules() if not any(
        (name.split(".")[1] if "." in name else "__init__") in members for members in LAYERS)]
    assert not unplaced


def test_no_module_imports_a_layer_above_its_own():
    """Data flows down: config never imports the job, the rank supervisor never imports the session, and so on."""
    upward = sorted((name, target) for name, targets in graph().items() for target in targets
                    if layer(target) > layer(name) and name != "mpsrun")
    assert not upward, "\n".join(f"{a} imports {b}" for a, b in upward)


def test_no_import_cycles():
    """No two modules import each other, directly or through others."""
    edges = graph()
    cycles: list[list[str]] = []
    state: dict[str, int] = {}

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for target in sorted(edges.get(name, ())):
            if target == "mpsrun":
                continue
            if state.get(target) == 1:
                cycles.append([*path[path.index(target):], target])
            elif target not in state:
                visit(target, [*path, target])
        state[name] = 2

    for name in sorted(edges):
        if name not in state:
            visit(name, [name])
    assert not cycles, "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_the_top_of_the_package_holds_at_most_ten_modules():
    """The folder names show the architecture: only the public face and the entry points sit at the top."""
    top = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(top) <= 10, top


#: The house's sizes (the developers' guide): a module at most this many lines, a function under the other.
MODULE_LINES, FUNCTION_LINES = 400, 50
#: Modules whose concept is larger, each with its own limit and the reason (a module's size follows its concept:
#: code is never moved or squeezed only to pass a limit).
LARGER = {
    "agent/agent.py": (560, "the agent: one node's whole part of a job (its session, each rank's admission, the "
                            "watch, the stop, the verdicts and when the ranks may go), one owner by design"),
    "job/run.py": (490, "the command: one job's whole life, on one node or several, what its launchers' ends mean, "
                        "and its report"),
    "runtime/protocol.py": (490, "every message declared with its fields, and the link that carries them (descriptors "
                                 "too, what came with an awaited message, its peer's end and its process's)"),
    "config/values.py": (460, "every option's value, read and checked once, where it is parsed (a farm's ranges and "
                              "files too, and paths made absolute, a removed working directory said)"),
    "farm/executor.py": (520, "a concurrent.futures.Executor whole: its manager thread, its workers' lives and "
                              "deaths, a fault's triage, its shutdown on every path, and its accounts"),
    "session/session.py": (420, "the public Session: its arguments and docstrings are the Python API's documentation"),
}


def test_modules_and_functions_stay_short():
    """Every module of the package holds at most 400 lines and every function fewer than 50, so each reads at once."""
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        limit, _ = LARGER.get(path.relative_to(PACKAGE).as_posix(), (MODULE_LINES, ""))
        if len(text.splitlines()) > limit:
            long.append(f"{path.name}: {len(text.splitlines())} lines")
        long += [f"{path.name}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines"
                 for node in ast.walk(ast.parse(text)) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and node.end_lineno is not None and node.end_lineno - node.lineno + 1 >= FUNCTION_LINES]
    assert not long, long


def test_every_package_says_what_it_owns():
    """Each sub-package's docstring names what it owns and what it may import."""
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "Owns" in doc and "Imports" in doc, f"{init.parent.name}: {doc!r}"


def test_the_rank_supervisor_imports_only_the_standard_library():
    """Under an MPI launcher one supervisor starts per rank, without site-packages (``python -S``): everything it
    imports must be the standard library's or mpsrun's own, and mpsrun's own only below the rank layer."""
    code = ("import sys; before = set(sys.modules); import mpsrun.rank.cli, mpsrun.rank.forked; "
            "print('\\n'.join(sorted(set(sys.modules) - before)))")
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, check=True,
                         cwd=PACKAGE.parent)
    loaded = out.stdout.split()
    foreign = [name for name in loaded if name.split(".")[0] not in sys.stdlib_module_names
               and name.split(".")[0] != "mpsrun"]
    assert not foreign, foreign
    ours = [name for name in loaded if name.startswith("mpsrun.")]
    assert all(layer(name) <= layer("mpsrun.rank") for name in ours), ours


@pytest.mark.parametrize("name", sorted(n for n in modules() if n.startswith("mpsrun.") and not n.endswith("__main__")))
def test_every_module_imports_on_its_own(name):
    """Each module can be imported first, alone (no hidden order between modules)."""
    subprocess.run([sys.executable, "-c", f"import {name}"], check=True, cwd=PACKAGE.parent, timeout=60)
