"""The test suite's own layout: what test modules share lives in tests/helpers.py (fixtures in conftest.py)."""

import ast

import pytest
from helpers import TESTS


def imported_test_modules(source: str) -> list[str]:
    """The test modules (``test_*``) and ``conftest`` that ``source`` imports, at any depth."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [name for name in names if name.split(".")[0].startswith("test_") or name.split(".")[0] == "conftest"]
    return found


@pytest.mark.parametrize(("source", "expected"), [
    ("from test_contract import PATHS", ["test_contract"]),
    ("import conftest", ["conftest"]),
    ("def f():\n    import test_gpu_contract as g", ["test_gpu_contract"]),
    ("from helpers import PATHS\nimport testing\nfrom mpsrun import test_x", []),
])
def test_the_check_sees_an_import_of_a_test_module(source, expected):
    """The check below finds an import of a test module or of conftest, wherever it is, and nothing else."""
    assert imported_test_modules(source) == expected


def test_no_test_module_imports_another():
    """No module of the suite imports a test module or conftest: shared helpers come from tests/helpers.py and
    fixtures from conftest.py, so a test module can change (or go) without breaking another."""
    modules = sorted(p for p in TESTS.rglob("*.py") if "data" not in p.relative_to(TESTS).parts)
    assert len(modules) > 30
    offenders = {str(p.relative_to(TESTS)): found for p in modules if (found := imported_test_modules(p.read_text()))}
    assert offenders == {}
