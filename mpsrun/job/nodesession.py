"""A job's part on one node, for the ``mpsrun`` command (the node it runs on) and a node keeper alike.

Both make the same things of the job's configuration: the node's MPS session, started within the job's
deadline; the plan of the node's ranks on its GPUs; the welcome each rank gets; and the rules their
controller applies. :class:`NodeSession` is the one owner of those.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from mpsrun.config.options import JobConfig
from mpsrun.errors import DaemonTimeoutError, JobTimeoutError
from mpsrun.job.mpiexec import mpi4py_abort
from mpsrun.job.outcome import Policy
from mpsrun.job.placement import Admission, NodePlan, welcome, without_mps
from mpsrun.rank.identity import RankIdentity
from mpsrun.runtime.constants import DAEMON_START_TIMEOUT
from mpsrun.runtime.deadline import Deadline
from mpsrun.session.claim import SessionClaim
from mpsrun.session.session import Session

__all__ = ["NodeSession"]


class NodeSession:
    """The node's MPS session made from ``config`` (not started: :meth:`plan`, then :meth:`start`), bounded by the
    job's ``deadline``."""

    def __init__(self, config: JobConfig, deadline: Deadline) -> None:
        self.config, self.deadline = config, deadline
        self.session = Session(gpus=list(config.gpus) if config.gpus is not None else "all", mps=config.mps,
                               keep_logs=config.keep_logs, export=False, gpu_bind=config.gpu_bind,
                               start_timeout=max(0.1, deadline.cap(DAEMON_START_TIMEOUT)))
        self.mpi4py_abort = mpi4py_abort(config.mpi4py_abort)
        self.node: NodePlan | None = None

    def plan(self, local_size: int | None) -> NodePlan:
        """Read the GPUs and plan the node's ``local_size`` ranks on them (None: the launcher does not say)."""
        self.session.resolve()
        self.node = NodePlan.make(self.config, len(self.session.gpus), local_size, self.session.free_memory())
        return self.node

    def without_mps(self) -> list[str]:
        """What to say once when the node's ranks run without MPS (nothing when they run under it)."""
        reason = self.session.disabled_reason
        return [] if reason is None else without_mps(self.config, reason, gpus_seen=bool(self.session.gpus))

    def start(self, whose: str, claim: SessionClaim, meanwhile: Callable[[], object] | None = None) -> None:
        """Start the daemons in ``claim`` with the plan's defaults (see :meth:`Session.start_in`). Daemons still
        starting when the job's deadline passed are the job's timeout, said as ``while {whose} MPS daemons
        started``."""
        assert self.node is not None, "plan() first"
        try:
            self.session.start_in(claim, self.node.daemon_defaults(), meanwhile)
        except DaemonTimeoutError as exc:
            if self.deadline.expired():
                raise JobTimeoutError(f"timed out after {self.config.timeout:g} s while {whose} MPS daemons started "
                                      f"({exc})", timeout=self.config.timeout or 0.0) from None
            raise

    def policy(self) -> Policy:
        """The rules the node's controller applies, with what is left of the job's --timeout."""
        return Policy.for_job(self.config, self.deadline)

    def admit(self, identity: RankIdentity, output_lock: str | None = None,
              callers: Mapping[str, str | None] | None = None) -> Admission:
        """A rank's welcome, by the node's plan (see :func:`mpsrun.job.placement.welcome`)."""
        assert self.node is not None, "plan() first"
        dirs = self.session.dirs
        return welcome(identity, self.node, self.session.target, self.mpi4py_abort,
                       str(dirs.root) if dirs is not None else None, output_lock, callers)
