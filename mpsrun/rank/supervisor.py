"""The rank supervisor: every rank of every mpsrun job runs under one (``python -m mpsrun.rank``: its command line).

The local launcher forks one per rank (with the identity on its command line); under ``mpiexec`` or
``srun`` each launched process is one, and reads its identity from the launcher's variables. It joins
its controller (:mod:`mpsrun.rank.join`), which answers with the rank's environment. It then runs COMMAND
in a process group of its own, passing on every descriptor it inherited (MPICH's ``PMI_FD``, Slurm's
PMI2), forwards signals, passes the rank's output on in whole lines (tagged under ``--tag-output``), and
reports the rank's start and end. When the rank's main
process ends, whatever it left in its group is killed. The controller's verdict then sets this
process's exit code.

Standard library only (it starts with ``python -S`` once per rank under an MPI launcher;
``tests/test_layout.py`` holds the line).
"""

from __future__ import annotations

import functools
import os
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence

from mpsrun.errors import InterruptionError, MPSError
from mpsrun.exitcodes import Cause, ExitCode, Outcome, exit_code, exit_status, signal_name
from mpsrun.rank.abort import AbortChannel
from mpsrun.rank.command import exec_failure_code, through_mpi4py
from mpsrun.rank.environ import rank_env
from mpsrun.rank.identity import RankIdentity
from mpsrun.rank.join import Join, refused, report_failure, report_interrupt
from mpsrun.rank.streams import RankOutput, output_files
from mpsrun.runtime.constants import (
    DRAIN_TIMEOUT,
    FORWARDED_SIGNALS,
    KILL_WAIT,
    LINGER_TIMEOUT,
    SESSION_DIR_VARIABLE,
    STOP_SIGNALS,
    VERDICT_TIMEOUT,
    WORLD_VARIABLE,
)
from mpsrun.runtime.deadline import Deadline
from mpsrun.runtime.interrupts import Interrupts
from mpsrun.runtime.loop import EventLoop
from mpsrun.runtime.output import say
from mpsrun.runtime.processes import (
    close_all,
    find_program,
    kill_group,
    kill_group_but_leader,
    pidfd,
    set_parent_death_signal,
    start_ticks,
)
from mpsrun.runtime.protocol import (
    Exited,
    Hello,
    Interrupted,
    Link,
    Message,
    Say,
    SignalRanks,
    Started,
    Verdict,
    Welcome,
)

__all__ = ["RankSupervisor", "run_rank", "say_line"]


def say_line(text: str) -> None:
    """One line of mpsrun's, from a rank's supervisor."""
    say(f"mpsrun: {text}")


def _become_rank(parent: int) -> None:
    """In the rank's process, before its exec: our wake-up descriptor is not its to write to (a signal now would
    look like ours), and the rank dies with us."""
    signal.set_wakeup_fd(-1)
    set_parent_death_signal(signal.SIGKILL, parent)


class RankSupervisor:
    """Runs one rank's command to its end under the controller's rules."""

    def __init__(self, identity: RankIdentity, command: Sequence[str], env: Mapping[str, str], link: Link,
                 welcome: Welcome, world: str = "mpi") -> None:
        self.rank, self.local_rank = identity.rank, identity.local_rank
        self.command = list(command)
        self.env = dict(env)
        self.link = link
        self.grace = welcome.grace
        self.mpi4py_abort = welcome.mpi4py_abort
        self.world = world  # who started the rank: "local" (the local launcher) or "mpi" (an MPI launcher)
        self.output_dir = welcome.output_dir
        self.queue_budget = welcome.gpu_clients, welcome.gpu_queues  # its GPU's MPS clients and their queues
        self.loop = EventLoop()
        self.process: subprocess.Popen[bytes] | None = None
        self.returncode: int | None = None
        self.output = RankOutput(self.loop, f"rank {self.rank}", welcome.tag, self.env.get("WORLD_SIZE") != "1",
                                 welcome.output_lock)
        self.killing = False
        self.controller_lost = False
        # The job's --timeout, should its controller stop answering (a node keeper stopped by SIGSTOP): by then it
        # has signalled the ranks, waited --grace, and judged them.
        self.timeout = welcome.timeout
        self.backstop = Deadline(None if self.timeout is None else self.timeout + self.grace + KILL_WAIT)
        self.aborting: AbortChannel | None = None  # where the rank's runner says it is about to call MPI_Abort
        self.reported: int | None = None  # this process's exit code, when the rank's end was reported ahead of it
        self.began: float | None = None  # when the program started (monotonic)
        self.wall: float | None = None  # the program's seconds running, and of CPU (its own and its reaped
        self.cpu: float | None = None  # descendants'), once it has ended

    def run(self) -> int:
        program, code, reason = find_program(self.command[0], self.env.get("PATH"))
        if program is None:
            return self._finish(Outcome("setup", code), f"{self.command[0]}: {reason}")
        if self.mpi4py_abort:
            command, self.command = self.command, through_mpi4py(self.command, program)
            if self.command != command:  # for the runner alone, which takes it out
                self.env[WORLD_VARIABLE] = self.world
        with self.loop.signals(FORWARDED_SIGNALS, self._on_signal):  # a signal from here on reaches the rank
            try:
                files = self._output_files()
            except OSError as exc:
                return self._finish(Outcome("setup", ExitCode.SETUP),
                                    f"--output-filename: cannot write {exc.filename}: {exc.strerror}")
            try:
                self._spawn(program, files)
            except OSError as exc:
                return self._finish(Outcome("setup", exec_failure_code(exc)), f"{self.command[0]}: {exc.strerror}")
            finally:
                close_all(files)
            if self.timeout is not None:
                self.loop.after(self.backstop.remaining(), self._overdue)
            self.loop.run_until(lambda: self.returncode is not None and self.output.done)
        assert self.returncode is not None
        if self.reported is not None:  # said before MPI_Abort: the job knows this rank's end already
            self.link.close()  # (kept open until now: see _finish)
            return self.reported
        if self.returncode == ExitCode.OK:
            return self._finish(Outcome("ok", ExitCode.OK))
        # Imported for a failure's words only: every rank's supervisor imports this module.
        from mpsrun.rank.frameworks import failure_reason

        return self._finish(Outcome("rank-failed", self.returncode), failure_reason(self.env, *self.queue_budget))

    def _output_files(self) -> list[int]:
        """The rank's stdout and stderr files under ``--output-filename``, or none."""
        return output_files(self.output_dir, f"rank.{self.rank}") if self.output_dir else []

    def _spawn(self, program: str, files: Sequence[int]) -> None:
        """Start the rank: its output to ``files`` (stdout, stderr) when given, else through pipes (or terminals) of
        ours, passed on in whole lines."""
        self._abort_channel()
        began = time.monotonic()  # before the start: the rank's wall time holds all of its life
        try:
            outputs = list(files) or self.output.open()
            self.process = subprocess.Popen(
                self.command, executable=program, env=self.env, close_fds=False, start_new_session=True,
                stdout=outputs[0], stderr=outputs[1],
                preexec_fn=functools.partial(_become_rank, os.getpid()))
        except OSError:
            self.output.close()
            raise
        # The launcher's descriptors (MPICH's PMI_FD) reach the rank (close_fds=False: Python's own are not
        # inheritable) and stay open here too until this process ends, as a plain rank holds them: Hydra's proxy
        # spins a core from the moment a rank's PMI connection closes until its process is gone.
        pid = self.process.pid
        self.began = began
        self.link.send(Started(self.rank, pid, start_ticks(pid), socket.gethostname()))
        exit_fd = pidfd(pid)
        if exit_fd is None:
            self._poll_exit()
        else:
            self.loop.watch(exit_fd, lambda: self._on_exit(exit_fd))
        self.loop.watch(self.link.fd, self._on_link)
        if self.link.held:  # what came with the welcome
            self.loop.after(0, self._on_link)
        self.output.forward()

    def _abort_channel(self) -> None:
        """For a Python rank under mpi4py's runner: where the runner says how the rank ends before MPI_Abort."""
        channel = AbortChannel.open(self.env.get(SESSION_DIR_VARIABLE, ""), self.rank) if self.mpi4py_abort else None
        if channel is not None:
            self.aborting = channel
            self.env.update(channel.variables)
            self.loop.watch(channel.listener.fileno(), self._on_abort_notice)

    def _on_abort_notice(self) -> None:
        """The rank's runner is about to call MPI_Abort: report the rank's end now, say the job's verdict, and let the
        runner go on (it waits for the word); when the rank then ends, this process exits as the verdict says."""
        assert self.aborting is not None
        word = self.aborting.notice(self.process.pid if self.process is not None else None)
        if word is None:  # not from the rank's own processes
            return
        self.loop.unwatch(self.aborting.listener.fileno())
        code, reason, conn = word
        if code is not None and self.returncode is None and self.reported is None:
            self.loop.unwatch(self.link.fd)
            self.reported = self._finish(Outcome("rank-failed", code), reason, aborting=True)
            # MPI_Abort ends this process too, before the rank's end could be seen here: end what it started now.
            assert self.process is not None
            kill_group_but_leader(self.process.pid, signal.SIGKILL)
        AbortChannel.answer(conn)

    def _poll_exit(self) -> None:  # kernels without pidfds: a bounded poll interval
        assert self.process is not None
        if os.waitid(os.P_PID, self.process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:  # not reaped
            self.loop.after(0.02, self._poll_exit)
        else:
            self._on_exit(None)

    def _on_exit(self, exit_fd: int | None) -> None:
        assert self.process is not None
        if exit_fd is not None:
            self.loop.unwatch(exit_fd)
            os.close(exit_fd)
        # The leader is a zombie until reaped, so its pid still names our group: end what it left.
        kill_group(self.process.pid, signal.SIGKILL)
        _, status, usage = os.wait4(self.process.pid, 0)  # its own CPU time, which Popen.wait does not give
        self.returncode = self.process.returncode = os.waitstatus_to_exitcode(status)
        self.cpu = round(usage.ru_utime + usage.ru_stime, 3)
        self.wall = None if self.began is None else round(time.monotonic() - self.began, 3)
        self.loop.unwatch(self.link.fd)
        if self.aborting is not None:
            self.loop.unwatch(self.aborting.listener.fileno())
            self.aborting.close()
        self.loop.after(DRAIN_TIMEOUT, self.output.drain)

    def _signal(self, sig: int) -> None:
        if self.process is not None and self.returncode is None:
            kill_group(self.process.pid, sig)
        if sig == signal.SIGTERM and not self.killing:  # what launchers send before SIGKILL
            self.killing = True
            self.loop.after(self.grace, lambda: self._signal(signal.SIGKILL))

    def _on_signal(self, sig: int) -> None:
        """A signal from outside (srun, mpiexec, a user): pass it on, and tell the controller it stops the job."""
        self._signal(sig)
        if sig in STOP_SIGNALS and self.returncode is None and self.reported is None:
            self.link.send(Interrupted(sig))

    def _overdue(self) -> None:
        """The job's controller let its --timeout pass without ending this rank: end it as the controller would."""
        if self.returncode is None:
            self._signal(signal.SIGTERM)

    @staticmethod
    def _said(message: Message) -> None:
        if isinstance(message, Say):  # a node keeper's word for the user, sent as the rank ended
            say_line(message.text)

    def _on_link(self) -> None:
        messages = self.link.receive()
        if messages is None:  # the controller is gone (killed): the job is over
            self.loop.unwatch(self.link.fd)  # before the close: see Link
            self.link.close()
            self.controller_lost = True
            self._signal(signal.SIGTERM)
            return
        for message in messages:
            if isinstance(message, SignalRanks):
                self._signal(message.signal)
            else:
                self._said(message)

    def _finish(self, own: Outcome, reason: str = "", aborting: bool = False) -> int:
        returncode = ExitCode.OK if own.cause == Cause.OK else ExitCode.SETUP if own.detail is None else own.detail
        wall = self.wall if self.wall is not None or self.began is None else round(time.monotonic() - self.began, 3)
        # A program that never started (its exec failed) is named by this process, which ends with its code.
        pid = None if self.process is not None else os.getpid()
        self.link.send(Exited(self.rank, returncode, reason, pid, aborting=aborting, wall=wall, cpu=self.cpu))
        # The job's end is not cut short: a signal is noted only, also one that comes as the block ends (a deferral
        # that ended inside the block let the reaper's SIGTERM raise there: a traceback, once under load).
        with Interrupts(deferred=True) as interrupts:
            # Past the backstop, a controller held up (by a daemon that does not answer) still gets KILL_WAIT.
            wait = VERDICT_TIMEOUT if self.timeout is None else max(KILL_WAIT, self.backstop.remaining())
            verdict = self.link.expect((Verdict,), Deadline(wait), others=self._said)
            assert verdict is None or isinstance(verdict, Verdict)
            if verdict is not None and verdict.linger:  # until the node's ranks may leave together (Verdict)
                heard = len(interrupts.received)
                self.link.outlive_peer(Deadline(LINGER_TIMEOUT), others=self._said, until_gone=verdict.outlive)
                if not verdict.last:  # a signal while it waited is the others' (the launcher signals every rank)
                    del interrupts.received[heard:]
        # A rank about to call MPI_Abort: the link stays open until this process ends, for its closing tells the
        # controller that the launcher has ended us (ABORT_WAIT). Closed at the verdict, it let the controller stop
        # the other ranks before the MPI_Abort; under Hydra their supervisors' ends then closed their PMI
        # connections, and Hydra SIGKILLed every process, this one too: the MPI_Abort never came and mpiexec
        # exited 9, not the rank's code.
        if not aborting:
            self.link.close()
        late = interrupts.received[0] if interrupts.received else None
        decided = self._decided(own, reason, verdict)
        if late is not None and exit_code(decided) == ExitCode.OK:
            say_line(f"rank {self.rank}: interrupted by {signal_name(late)} while the job ended")
        return exit_code(decided._replace(late_signal=late))

    def _decided(self, own: Outcome, reason: str, verdict: Verdict | None) -> Outcome:
        """The job's word on this rank (its verdict), else the rank's own end."""
        if verdict is None and self.controller_lost:  # each rank says it: the reaper may have ended any of them
            say_line(f"rank {self.rank}: the job's controller (mpsrun, or the node keeper) died under the job; "
                     "the rank was stopped")
            return Outcome("setup")
        if verdict is None and self.backstop.expired():
            if self.local_rank in (0, None):  # once per node
                say_line(f"timed out after {self.timeout:g} s; the job's controller did not stop the ranks (it no "
                         "longer answers), so their supervisors did")
            return Outcome("timeout")
        if verdict is None:
            if reason:
                say_line(f"rank {self.rank}: {reason}")
            return own
        for line in verdict.lines:
            say_line(line)
        return Outcome(Cause.DECIDED, verdict.exit_code) if exit_status(verdict.exit_code) else own


def run_rank(command: Sequence[str], identity: RankIdentity, join: Join, token: str, world: str = "mpi") -> int:
    """Join the job's controller, then supervise ``command`` as rank ``identity.rank`` (``world``: ``local`` when the
    local launcher started it, each rank an MPI world of its own)."""
    parent = os.getppid()
    set_parent_death_signal(signal.SIGTERM)  # our launcher gone: stop the rank like a SIGTERM
    if os.getppid() != parent:
        return exit_code(Outcome("signal", signal.SIGTERM))
    hello = Hello("rank", token, identity.rank, identity.local_rank, identity.world_size, identity.local_world_size,
                  os.environ.get("CUDA_VISIBLE_DEVICES"))
    try:
        with Interrupts():
            link, answer = join(hello)
    except InterruptionError as exc:  # the launcher signals every rank: said once per node (or job)
        report_interrupt(exc, identity.local_rank)
        return exc.exit_code
    except MPSError as exc:  # the node's session cannot start: said once
        report_failure(exc, identity.local_rank)
        return exc.exit_code
    except OSError as exc:
        say_line(f"rank {identity.rank}: cannot reach the job's controller: {exc}")
        return ExitCode.SETUP
    if not isinstance(answer, Welcome):
        return refused(link, answer, identity)
    for line in answer.lines:
        say_line(line)
    return RankSupervisor(identity, command, rank_env(os.environ, answer), link, answer, world).run()
