"""The public API is one list (``mpsrun.__all__``), and the README and :mod:`mpsrun.errors` agree with it."""

from __future__ import annotations

import builtins
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

import mpsrun
from mpsrun import errors

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()
API_SECTION = README[README.index("## The Python API"):README.index("## How a session works")]


@pytest.mark.parametrize("name", mpsrun.__all__)
def test_every_public_name_can_be_imported_from_the_package(name):
    """``from mpsrun import NAME`` works for every name of the list, in a fresh interpreter (lazy names too)."""
    subprocess.run([sys.executable, "-c", f"from mpsrun import {name}"], check=True, timeout=60)


def test_the_public_errors_are_exactly_the_errors_list():
    """mpsrun.errors' list is the public errors, all of them MPSError subclasses, and all of them in the package's
    list; an error raised to callers cannot be missing from it (SharedArrayError once was)."""
    public = {name for name in mpsrun.__all__ if name.endswith("Error")}
    assert public == set(errors.__all__)
    assert all(issubclass(getattr(errors, name), errors.MPSError) for name in public)
    internal = {"InterruptionError", "RecordError", "HandoffError", "JoinError",  # raised and caught inside mpsrun
                "LockHeldError"}  # (or said as an MPSError)
    defined = {name for name, value in vars(errors).items()
               if inspect.isclass(value) and issubclass(value, errors.MPSError)}
    assert defined == public | internal


def test_every_name_the_readme_gives_for_the_api_is_public():
    """Every error, class and function the README's Python API section names exists in ``mpsrun.__all__`` (or is a
    method or module the list gives: ``session.env``, ``shared.array``)."""
    names = {name for name in re.findall(r"`(?:mpsrun\.)?([A-Z][A-Za-z]+Error)`", API_SECTION)
             if not hasattr(builtins, name)}
    assert "MPSError" in names, "the README's API section names no error"
    assert names <= set(mpsrun.__all__), names - set(mpsrun.__all__)
    assert "mps_session(" in API_SECTION and "Session" in API_SECTION
    shared_calls = set(re.findall(r"shared\.([a-z_]+)\(", README))
    assert shared_calls and shared_calls <= set(mpsrun.shared.__all__)


def test_the_readme_lists_every_public_error():
    """Conversely, the README says what each public error is (none is left undocumented)."""
    for name in errors.__all__:
        assert re.search(rf"`(mpsrun\.)?{name}`", README), name
