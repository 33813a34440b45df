"""Integration tests of the supervisor alone (no MPS): exits, signals, hooks."""

import os
import signal
import sys

from mpsrun.supervisor import RankSpec, Supervisor, describe_returncode, exit_code_of


def spec(rank, code):
    return RankSpec(rank, [sys.executable, "-c", code], dict(os.environ))


def test_exit_code_mapping():
    """Signals map to 128+N and are described by name."""
    assert exit_code_of(-9) == 137 and exit_code_of(3) == 3
    assert describe_returncode(-15) == "was killed by signal 15 (SIGTERM)"


def test_after_start_failure_stops_the_job_with_3():
    """If the after-start hook fails (a server never came up), ranks are stopped and the exit is 3."""
    def broken():
        raise RuntimeError("MPS server did not become ACTIVE")

    notes = []
    result = Supervisor([spec(0, "import time; time.sleep(60)")], grace=1, after_start=broken, note=notes.append).run()
    assert (result.exit_code, result.cause) == (3, "check-failed")
    assert result.message == "MPS server did not become ACTIVE"
    assert result.exits[0].returncode == -signal.SIGTERM


def test_before_stop_gets_the_live_ranks():
    """When a rank fails, before_stop is called with the pids still alive, before they are signalled."""
    seen = []
    ranks = [spec(0, "import sys; sys.exit(5)"), spec(1, "import time; time.sleep(60)")]
    sup = Supervisor(ranks, grace=1, before_stop=seen.append, note=lambda _: None)
    result = sup.run()
    assert result.exit_code == 5 and result.first_failure.rank == 0
    assert seen == [[sup.procs[1].pid]]


def test_spawn_failure_is_127():
    """A program that cannot be started gives 127 and starts nothing else."""
    result = Supervisor([RankSpec(0, ["/nonexistent/prog"], dict(os.environ))], note=lambda _: None).run()
    assert result.exit_code == 127 and "cannot start rank 0" in result.message
