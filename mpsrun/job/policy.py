"""What a job's controller is told (:class:`Policy`), the waits it keeps and the signals it takes."""

from __future__ import annotations

import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from mpsrun.rank.identity import RankIdentity

__all__ = ["Policy", "Welcome"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
FORWARD_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)
#: What a controller gives each rank it admits (its environment and settings), from its identity and hello.
Welcome = Callable[[RankIdentity, Mapping[str, Any]], dict[str, Any]]

KILL_WAIT = 10.0  # after SIGKILL, how long a rank's supervisor gets to report before the rank is given up
VERDICT_WAIT = 30.0  # how long a relaying node keeper waits for the job's verdicts once its ranks have ended
LATE_WAIT = 30.0  # how long a node keeper keeps its session for ranks the launcher said would come
NODE_CLOSE_WAIT = 60.0  # how long the job's controller waits for the hosts' node keepers to end their sessions
ABANDON_WAIT = 5.0  # at least, for an abandoned launch's MPI launcher to start (and end) its refused ranks
SAME_INTERRUPT = 0.25  # one Ctrl-C can reach a rank twice (terminal and launcher) within this


@dataclass(frozen=True, slots=True)
class Policy:
    grace: float = 5.0
    timeout: float | None = None  # seconds left of the job's --timeout when the ranks start
    timeout_total: float | None = None  # the --timeout itself, for the message
    mps_required: bool = False  # --mps on: a rank found without MPS fails the job
    watch_interval: float = 0.2  # NVML is sampled this often: two looks in a row find a rank off MPS
