"""The GPU tier's gate: skipped without a GPU, but failing when MPSRUN_REQUIRE_GPU=1 demands one."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import real_gpu_available

TESTS = Path(__file__).resolve().parent


@pytest.mark.skipif(real_gpu_available()[0], reason="this machine has a GPU: the gate has nothing to refuse")
@pytest.mark.parametrize(("require", "expected_rc", "expected"), [("1", 1, "MPSRUN_REQUIRE_GPU=1 but"), ("", 0, "skipped")])
def test_gpu_tier_fails_instead_of_skipping_when_required(require, expected_rc, expected):
    """Without a GPU, -m gpu skips; with MPSRUN_REQUIRE_GPU=1 the same tests fail and say why."""
    env = {**os.environ, "MPSRUN_REQUIRE_GPU": require}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", "-m", "gpu",
                          str(TESTS / "test_gpu_session.py")], capture_output=True, text=True, env=env, timeout=300,
                         cwd=TESTS.parent)
    assert out.returncode == expected_rc, out.stdout[-2000:]
    assert expected in out.stdout
