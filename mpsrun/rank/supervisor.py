"""The rank supervisor ("shim"): every rank of every mpsrun job runs under one.

``python -m mpsrun.rank.supervisor [--rank R --local-rank L --size N --local-size M] -- COMMAND...``

The local launcher starts one per rank (with the identity on its command line); under
``mpiexec`` or ``srun`` each launched process is one, and reads its identity from the
launcher's variables. It connects to its controller (``$MPSRUN_CONTROL``: the ``mpsrun``
that launched the job, or the node keeper under ``--per-node``), which answers with the
rank's environment. It then runs COMMAND in a process group of its own, passing on every
descriptor it inherited (MPICH's ``PMI_FD``, Slurm's PMI2), forwards signals, tags output
lines, and reports the rank's start and end. When the rank's main process ends, whatever
it left in its group is killed. The controller's verdict then sets this process's exit code.

Built-in modules only, on its whole import path (``ctypes`` and ``collections`` aside): one of these starts per
rank, on the path of every job, so no ``subprocess``, ``socket``, ``signal``, ``json``, ``contextlib``, ``re`` or
``threading`` (their imports cost a supervisor about 20 ms; ``tests/test_lean_start.py`` holds the line).
"""

from __future__ import annotations

import _socket
import os
import sys

from mpsrun.errors import MPSError
from mpsrun.exitcodes import ExitCode, exit_code_of, signal_name
from mpsrun.rank.identity import RankIdentity, identity_from_env
from mpsrun.runtime.deadline import Deadline
from mpsrun.runtime.interrupts import InterruptionError, Interrupts
from mpsrun.runtime.loop import EventLoop
from mpsrun.runtime.output import LineTagger, say
from mpsrun.runtime.processes import (
    close_all,
    find_program,
    inherited_fds,
    kill_group,
    pidfd,
    set_parent_death_signal,
    spawn,
    start_ticks,
    wait,
)
from mpsrun.runtime.protocol import Link, connect

TYPE_CHECKING = False  # the rank supervisor starts once per rank: typing's import (3-5 ms) is left out
if TYPE_CHECKING:  # the stubs of ``signal`` describe ``_signal``, which is ``signal`` without its enums
    import signal
    from collections.abc import Callable, Mapping, Sequence
    from typing import Any

    Join = Callable[[Mapping[str, Any]], tuple[Link, dict[str, Any] | None]]
else:
    import _signal as signal

__all__ = ["CONTROL_VARIABLES", "direct", "greet", "main", "report_failure", "run_rank"]

#: How a shim finds its controller; never passed on to the rank.
CONTROL_VARIABLES = ("MPSRUN_CONTROL", "MPSRUN_CONTROL_TOKEN")
#: Signals the shim passes to its rank's process group.
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
STOPPING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
WELCOME_TIMEOUT = 300.0  # the controller may be starting MPS daemons meanwhile
VERDICT_TIMEOUT = 300.0  # the last rank of a node waits for the node's teardown
LINGER_TIMEOUT = 60.0  # the node keeper's teardown (a hanging quit, then SIGTERM, SIGKILL) after the last verdict
DRAIN_TIMEOUT = 2.0  # output still open after the rank's group is gone (a writer that left the group)


def _say(text: str) -> None:
    say(f"mpsrun: {text}")


class RankSupervisor:
    """Runs one rank's command to its end under the controller's rules."""

    def __init__(self, identity: RankIdentity, command: Sequence[str], env: Mapping[str, str], link: Link,
                 welcome: Mapping[str, Any], fds: Sequence[int]) -> None:
        self.rank = identity.rank
        self.command = list(command)
        self.env = dict(env)
        self.link = link
        self.link_fd = link.fileno()
        self.fds = list(fds)
        self.grace = float(welcome.get("grace", 5.0))
        self.tag = bool(welcome.get("tag"))
        self.mpi4py_abort = bool(welcome.get("mpi4py_abort"))
        self.lock = welcome.get("output_lock")
        self.loop = EventLoop()
        self.pid: int | None = None
        self.returncode: int | None = None
        self.streams: dict[int, LineTagger] = {}  # the read ends of the rank's stdout and stderr, when tagged
        self.killing = False
        self.controller_lost = False

    def run(self) -> int:
        program, code, reason = find_program(self.command[0], self.env.get("PATH"))
        if program is None:
            return self._finish(code, f"{self.command[0]}: {reason}")
        if self.mpi4py_abort:
            self.command = through_mpi4py(self.command, program)
        with self.loop.signals(FORWARDED, self._on_signal):  # a signal from here on reaches the rank
            try:
                self._spawn(program)
            except OSError as exc:
                code = ExitCode.NOT_FOUND if isinstance(exc, FileNotFoundError) else ExitCode.NOT_EXECUTABLE
                return self._finish(code, f"{self.command[0]}: {exc.strerror}")
            self.loop.run_until(lambda: self.returncode is not None and not self.streams)
        assert self.returncode is not None
        return self._finish(self.returncode)

    def _spawn(self, program: str) -> None:
        pipes = (os.pipe(), os.pipe()) if self.tag else None
        try:
            self.pid = pid = spawn(program, self.command, self.env, stdout=pipes and pipes[0][1],
                                   stderr=pipes and pipes[1][1], death_signal=signal.SIGKILL)
        except OSError:
            close_all([fd for pipe in pipes or () for fd in pipe])
            raise
        close_all(self.fds)  # the rank has them now; holding them would keep its launcher's connections open
        self.link.send("started", rank=self.rank, pid=pid, start=start_ticks(pid), host=_socket.gethostname())
        exit_fd = pidfd(pid)
        if exit_fd is None:
            self._poll_exit()
        else:
            self.loop.watch(exit_fd, lambda: self._on_exit(exit_fd))
        self.loop.watch(self.link_fd, self._on_link)
        for (read_end, write_end), sink in zip(pipes or (), (1, 2), strict=False):
            os.close(write_end)
            self._tag(read_end, sink)

    def _tag(self, fd: int, sink: int) -> None:
        os.set_blocking(fd, False)
        self.streams[fd] = LineTagger(self.rank, sink, self.lock)
        self.loop.watch(fd, lambda: self._copy(fd))

    def _copy(self, fd: int) -> None:
        tagger = self.streams[fd]
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return
        if data and tagger.feed(data):
            return
        self._close_stream(fd)  # end of the stream, or our own output is gone: the rank gets EPIPE

    def _close_stream(self, fd: int) -> None:
        tagger = self.streams.pop(fd)
        self.loop.unwatch(fd)
        tagger.finish()
        os.close(fd)

    def _poll_exit(self) -> None:  # kernels without pidfds: a bounded poll interval
        assert self.pid is not None
        if os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:  # not reaped: see below
            self.loop.after(0.02, self._poll_exit)
        else:
            self._on_exit(None)

    def _on_exit(self, exit_fd: int | None) -> None:
        assert self.pid is not None
        if exit_fd is not None:
            self.loop.unwatch(exit_fd)
            os.close(exit_fd)
        # The leader is a zombie until reaped, so its pid still names our group: end what it left.
        kill_group(self.pid, signal.SIGKILL)
        self.returncode = wait(self.pid)
        self.loop.unwatch(self.link_fd)
        self.loop.after(DRAIN_TIMEOUT, self._close_streams)

    def _close_streams(self) -> None:
        for fd in list(self.streams):
            self._close_stream(fd)

    def _signal(self, sig: int) -> None:
        if self.pid is not None and self.returncode is None:
            kill_group(self.pid, sig)
        if sig == signal.SIGTERM and not self.killing:  # what launchers send before SIGKILL
            self.killing = True
            self.loop.after(self.grace, lambda: self._signal(signal.SIGKILL))

    def _on_signal(self, sig: int) -> None:
        """A signal from outside (srun, mpiexec, a user): pass it on, and tell the controller it stops the job."""
        self._signal(sig)
        if sig in STOPPING and self.returncode is None:
            self.link.send("interrupted", rank=self.rank, signal=sig)

    @staticmethod
    def _said(message: Mapping[str, Any]) -> None:
        if message.get("type") == "say":  # a node keeper's word for the user, sent as the rank ended
            _say(str(message.get("text")))

    def _on_link(self) -> None:
        messages = self.link.receive()
        if messages is None:  # the controller is gone (killed): the job is over
            self.loop.unwatch(self.link_fd)  # before the close: see Link
            self.link.close()
            self.controller_lost = True
            self._signal(signal.SIGTERM)
            return
        for message in messages:
            if message.get("type") == "signal" and isinstance(message.get("signal"), int):
                self._signal(message["signal"])
            else:
                self._said(message)

    def _finish(self, returncode: int, reason: str = "") -> int:
        self.link.send("exited", rank=self.rank, returncode=returncode, reason=reason)
        with Interrupts() as interrupts, interrupts.deferred():  # the job's end is not cut short: noted only
            verdict = self.link.expect(("verdict",), Deadline(VERDICT_TIMEOUT), others=self._said)
            if verdict is not None and verdict.get("linger"):  # the node keeper's last rank: wait until it is gone
                self.link.expect(("",), Deadline(LINGER_TIMEOUT), others=self._said)
        self.link.close()
        code = self._exit_code(returncode, reason, verdict)
        if interrupts.received and code == ExitCode.OK:
            _say(f"rank {self.rank}: interrupted by {signal_name(interrupts.received[0])} while the job ended")
            return 128 + interrupts.received[0]
        return code

    def _exit_code(self, returncode: int, reason: str, verdict: Mapping[str, Any] | None) -> int:
        if verdict is None and self.controller_lost:
            _say(f"rank {self.rank}: the job's controller (mpsrun, or the node keeper) died under the job; "
                 "the rank was stopped")
            return ExitCode.SETUP
        if verdict is None:
            if reason:
                _say(f"rank {self.rank}: {reason}")
            return exit_code_of(returncode)
        for line in verdict.get("lines") or ():
            _say(str(line))
        code = verdict.get("exit_code")
        return code if isinstance(code, int) and 0 <= code <= 255 else exit_code_of(returncode)


def through_mpi4py(command: list[str], program: str) -> list[str]:
    """``python x.py``, ``python -m mod``, ``python -c code`` as ``python -m mpi4py ...`` when mpi4py is there.

    mpi4py's runner calls MPI_Abort for an uncaught exception or ``sys.exit(N)`` (only if the
    program imported MPI), instead of MPI_Finalize, which waits forever for ranks that never come.
    Only this interpreter is known to have mpi4py (the controller checked); other commands run as given.
    """
    if os.path.realpath(program) != os.path.realpath(sys.executable) or len(command) < 2:
        return command
    first = command[1]
    interpreter_option = first.startswith("-") and first not in ("-m", "-c")  # -u, -X, -: left alone
    if interpreter_option or command[1:3] == ["-m", "mpi4py"]:
        return command
    return [command[0], "-m", "mpi4py", *command[1:]]


def rank_env(base: Mapping[str, str], welcome: Mapping[str, Any]) -> dict[str, str]:
    """The rank's environment: ours, less what mpsrun manages, plus what the controller gave."""
    managed = set(welcome.get("managed") or ()) | set(CONTROL_VARIABLES)
    env = {k: v for k, v in base.items() if k not in managed}
    env.update({str(k): str(v) for k, v in (welcome.get("env") or {}).items()})
    return env


def greet(link: Link, hello: Mapping[str, Any]) -> dict[str, Any] | None:
    """Say hello; the controller's welcome or refusal, or None if it went away."""
    link.send("hello", **hello)
    answer = link.expect(("welcome", "refuse"), Deadline(WELCOME_TIMEOUT))
    return None if answer is not None and answer.get("retry") else answer


def report_failure(exc: MPSError, local_rank: int | None) -> None:
    """A rank that cannot start says why once: under ``--hosts`` to the job's controller, which makes it
    the job's one summary line; otherwise the node's first local rank prints it."""
    address = os.environ.get("MPSRUN_CONTROL")
    if address and _tell_controller(address, exc):
        return
    if local_rank in (0, None):
        _say(f"error: {exc}")


def _tell_controller(address: str, exc: MPSError) -> bool:
    try:
        link = connect(address)
        link.send("hello", role="node", token=os.environ.get("MPSRUN_CONTROL_TOKEN", ""), node=_socket.gethostname())
        told = link.expect(("welcome",), Deadline(5.0)) is not None and link.send(
            "finding", message=str(exc), fatal=True, code=int(exc.exit_code))
        link.close()
    except OSError:
        return False
    return told


def direct(address: str) -> Join:
    """Join the controller at ``address`` (the launcher's, or a node keeper's)."""

    def join(hello: Mapping[str, Any]) -> tuple[Link, dict[str, Any] | None]:
        link = connect(address)
        return link, greet(link, hello)

    return join


def run_rank(command: Sequence[str], identity: RankIdentity, join: Join, token: str,
             hello: Mapping[str, Any] | None = None) -> int:
    """Join the job's controller, then supervise ``command`` as rank ``identity.rank``."""
    fds = inherited_fds()  # first: what the launcher handed us, before we open anything
    parent = os.getppid()
    set_parent_death_signal(signal.SIGTERM)  # our launcher gone: stop the rank like a SIGTERM
    if os.getppid() != parent:
        return exit_code_of(-signal.SIGTERM)
    fields = {"role": "rank", "token": token, "identity": identity.to_json(), "host": _socket.gethostname(),
              "shim": os.getpid(), "devices": os.environ.get("CUDA_VISIBLE_DEVICES"), **(hello or {})}
    try:
        with Interrupts():
            link, answer = join(fields)
    except InterruptionError as exc:  # the launcher signals every rank: said once per node
        if identity.local_rank == 0:
            _say(f"{exc} before the ranks started")
        return exc.exit_code
    except MPSError as exc:  # the node's session cannot start: said once
        report_failure(exc, identity.local_rank)
        return exc.exit_code
    except OSError as exc:
        _say(f"rank {identity.rank}: cannot reach the job's controller: {exc}")
        return ExitCode.SETUP
    if answer is None or answer["type"] == "refuse":
        message = answer.get("message") if answer else \
            "the job's controller went away before the ranks started" if identity.local_rank == 0 else ""
        if message:  # a rank refused because the job is already stopping says nothing; a lost controller, once
            _say(str(message).removeprefix("mpsrun: "))
        link.close()
        code = (answer or {}).get("exit_code")
        return code if isinstance(code, int) else ExitCode.SETUP
    for line in answer.get("lines") or ():
        _say(str(line))
    env = rank_env(os.environ, answer)
    return RankSupervisor(identity, command, env, link, answer, fds).run()


USAGE = "usage: python -m mpsrun.rank.supervisor [--rank R --local-rank L --size N --local-size M] -- COMMAND"


def _parse(argv: Sequence[str]) -> tuple[dict[str, int], list[str]]:
    """The identity options (``--name N`` pairs, as mpsrun writes them) and the command.

    Not argparse: this line is mpsrun's own, and argparse's imports would cost every shim some milliseconds.
    """
    words = list(argv)
    if "--" not in words:
        raise SystemExit(USAGE)
    split = words.index("--")
    pairs = words[:split]
    if len(pairs) % 2:
        raise SystemExit(USAGE)
    options: dict[str, int] = {}
    for name, value in zip(pairs[::2], pairs[1::2], strict=True):
        if name not in ("--rank", "--local-rank", "--size", "--local-size") or not value.isdecimal():
            raise SystemExit(USAGE)
        options[name[2:].replace("-", "_")] = int(value)
    return options, words[split + 1 :]


def main(argv: Sequence[str] | None = None) -> int:
    options, command = _parse(sys.argv[1:] if argv is None else argv)
    address, token = os.environ.get("MPSRUN_CONTROL"), os.environ.get("MPSRUN_CONTROL_TOKEN", "")
    if not command or not address:
        _say("python -m mpsrun.rank.supervisor runs a rank of a job started by mpsrun; it needs MPSRUN_CONTROL and a command")
        return ExitCode.USAGE
    if "rank" in options and "local_rank" in options:
        identity: RankIdentity | None = RankIdentity(options["rank"], options["local_rank"], options.get("size"),
                                                     options.get("local_size"))
    else:
        identity = identity_from_env(os.environ)
    if identity is None:
        _say("no local-rank variable from the MPI launcher "
             "(OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID, SLURM_LOCALID, ...)")
        return ExitCode.SETUP
    return run_rank(command, identity, direct(address), token)


if __name__ == "__main__":
    sys.exit(main())
