"""The exit-code contract as a table: every process of a job decides its status with exitcodes.exit_code()."""

from __future__ import annotations

import ast
import signal
from pathlib import Path

import pytest

from mpsrun.exitcodes import CAUSES, Outcome, describe_returncode, exit_code, signal_name

TABLE = [
    # (outcome, code, what the README's table says)
    (Outcome(), 0, "every rank succeeded"),
    (Outcome("rank-failed", 7), 7, "the first failing rank's code"),
    (Outcome("rank-failed", -signal.SIGKILL), 137, "a rank killed by signal N: 128+N"),
    (Outcome("rank-failed", -signal.SIGSEGV), 139, "a segfault: 139"),
    (Outcome("rank-failed", None), 137, "a rank lost without a word: as if SIGKILLed"),
    (Outcome("launcher-failed", 9), 9, "mpiexec's own code when it ended the job"),
    (Outcome("launcher-failed", 0), 3, "mpiexec that ended 0 before its ranks ran: a set-up failure"),
    (Outcome("launcher-failed", -signal.SIGTERM), 143, "mpiexec killed by SIGTERM"),
    (Outcome("timeout"), 124, "--timeout expired"),
    (Outcome("signal", signal.SIGINT), 130, "interrupted by SIGINT"),
    (Outcome("signal", signal.SIGTERM), 143, "terminated by SIGTERM"),
    (Outcome("signal", signal.SIGHUP), 129, "hang-up"),
    (Outcome("check-failed"), 3, "a rank ran without MPS under --mps on"),
    (Outcome("check-failed", 124), 124, "a host's node keeper timed out starting"),
    (Outcome("setup", 2), 2, "a usage error"),
    (Outcome("setup", 127), 127, "command not found"),
    (Outcome("setup", 126), 126, "command not executable"),
    (Outcome("setup"), 3, "a set-up failure"),
    (Outcome("decided", 5), 5, "a supervisor told its code by the job's controller"),
    (Outcome("decided", None), 3, "a supervisor refused without a code"),
    (Outcome(teardown_failed=True), 3, "a job that succeeded but could not be torn down"),
    (Outcome("teardown-failed"), 3, "the cause a report gives such a job"),
    (Outcome(late_signal=signal.SIGTERM), 143, "a job that succeeded, stopped while it ended"),
    (Outcome("rank-failed", 7, teardown_failed=True, late_signal=signal.SIGTERM), 7, "the first failure wins"),
    (Outcome("decided", 0, late_signal=signal.SIGINT), 130, "a rank told 0, interrupted while the job ended"),
]


@pytest.mark.parametrize(("outcome", "code", "meaning"), TABLE, ids=[row[2] for row in TABLE])
def test_the_exit_code_table(outcome, code, meaning):
    """Each fact of a job's end gives the code the README documents for it."""
    assert exit_code(outcome) == code


def test_every_cause_is_in_the_table_and_no_other_is_accepted():
    """The table covers every cause; an unknown cause is a bug, not a silent code."""
    assert {row[0].cause for row in TABLE} == set(CAUSES)
    with pytest.raises(ValueError, match="unknown cause"):
        exit_code(Outcome("frobnicated"))


def test_no_other_module_computes_an_exit_code_from_a_returncode():
    """``128 - returncode`` and ``128 + signal`` arithmetic lives in exitcodes alone (it was in four places)."""
    offenders = []
    for path in (Path(__file__).resolve().parent.parent / "mpsrun").rglob("*.py"):
        if path.name == "exitcodes.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.BinOp) and isinstance(node.left, ast.Constant) and node.left.value == 128 \
                    and isinstance(node.op, (ast.Sub, ast.Add)):
                offenders.append(f"{path.name}:{node.lineno}")
    assert not offenders


def test_returncodes_and_signals_are_described_as_a_shell_would():
    """``exited with code 7``, ``was killed by signal 9 (SIGKILL)``, and a number that names no signal."""
    assert describe_returncode(7) == "exited with code 7"
    assert describe_returncode(-9) == "was killed by signal 9 (SIGKILL)"
    assert signal_name(15) == "SIGTERM" and signal_name(99) == "signal 99"


def test_a_lost_host_is_named_even_when_its_collateral_came_first():
    """Under --hosts a host that dies makes the MPI launcher end the job's other processes; under load the end of
    one of this host's ranks (lost unreported) may reach the judge first. A rank lost with another host's node
    keeper then takes its place as the summary's first, so the line names that host; a rank that failed with a code
    of its own keeps its place."""
    from mpsrun.agent.outcome import Judge, RankEnd

    judge = Judge()
    assert judge.rank_ended(RankEnd(0, 101, None, "its supervisor is gone"))
    assert not judge.rank_ended(RankEnd(3, None, None, "its node keeper is gone", host="h2"))
    judge.launcher_ended("mpiexec", 255)
    assert judge.message == ("rank 3 (on h2) ended without reporting first (its node keeper is gone); mpiexec exited "
                             "with code 255") and judge.exit_code() == 255
    failed = Judge()
    assert failed.rank_ended(RankEnd(1, 102, 7))
    assert not failed.rank_ended(RankEnd(3, None, None, "its node keeper is gone", host="h2"))
    assert failed.message == "rank 1 (pid 102) exited with code 7 first" and failed.exit_code() == 7
