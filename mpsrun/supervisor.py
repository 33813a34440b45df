"""The process supervisor: starts rank processes, watches them, stops them.

Each rank runs in its own session and process group (so a signal reaches its whole
tree and a terminal Ctrl-C reaches only us), with a parent-death signal so it cannot
outlive mpsrun. Waiting is event-driven: one pidfd per rank plus the signal wake-up
pipe, so nothing is slept. Signals to mpsrun are forwarded to the ranks; a second
Ctrl-C kills at once. The first rank to fail decides the exit code (a signal N
counts as 128+N) and the others are stopped: SIGTERM, then SIGKILL after ``grace``.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import IO

import attrs

from mpsrun.daemon import _set_parent_death_signal

__all__ = ["JobResult", "RankExit", "RankSpec", "Supervisor", "describe_returncode", "exit_code_of"]

#: Signals forwarded to the ranks and then ending the job.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: Signals only forwarded (Open MPI does the same).
FORWARD_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)


def exit_code_of(returncode: int) -> int:
    """A shell-style exit code: a process killed by signal N gives 128+N."""
    return 128 - returncode if returncode < 0 else returncode


def describe_returncode(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by signal {-returncode} ({name})"
    return f"exited with code {returncode}"


@attrs.frozen
class RankSpec:
    """What to run for one rank: its argv and complete environment."""

    rank: int
    argv: Sequence[str]
    env: dict[str, str]


@attrs.frozen
class RankExit:
    rank: int
    pid: int
    returncode: int

    @property
    def exit_code(self) -> int:
        return exit_code_of(self.returncode)

    def describe(self) -> str:
        return f"rank {self.rank} (pid {self.pid}) {describe_returncode(self.returncode)}"


@attrs.define
class JobResult:
    """How the job ended. ``cause`` is one of ok, rank-failed, timeout, signal, check-failed, not-found."""

    exit_code: int
    cause: str
    message: str = ""
    first_failure: RankExit | None = None
    exits: list[RankExit] = attrs.Factory(list)


class _LineTagger:
    """Copies a rank's output to ours line by line, each line prefixed ``[rank N] ``."""

    def __init__(self, lock: threading.Lock) -> None:
        self.lock = lock
        self.threads: list[threading.Thread] = []

    def attach(self, rank: int, source: IO[bytes], sink: IO[bytes]) -> None:
        prefix = f"[rank {rank}] ".encode()
        thread = threading.Thread(target=self._copy, args=(prefix, source, sink), daemon=True)
        thread.start()
        self.threads.append(thread)

    def _copy(self, prefix: bytes, source: IO[bytes], sink: IO[bytes]) -> None:
        with source:
            for line in iter(source.readline, b""):
                if not line.endswith(b"\n"):
                    line += b"\n"
                with self.lock:  # whole lines only: no interleaving inside a line
                    sink.write(prefix + line)
                    sink.flush()

    def join(self, timeout: float = 5.0) -> None:
        for thread in self.threads:
            thread.join(timeout)


class Supervisor:
    """Runs rank processes to completion under one set of rules.

    Args:
        ranks: what to start, one :class:`RankSpec` per process.
        tag_output: prefix every output line with ``[rank N]``.
        grace: seconds between SIGTERM and SIGKILL when stopping ranks.
        timeout: end the job (exit 124) after this many seconds.
        before_stop: called with the live ranks' pids before they are signalled
            (the session uses it to ``terminate_client`` connected MPS clients).
        check: called now and then while ranks run; a returned message fails the job
            (exit 3) and a ``None`` means all is well.
        after_start: called once every rank is started (the launcher waits there for
            the MPS servers, which come up while the ranks start); raising fails the job
            (exit 3) with its message.
        note: where one-line messages go (default: stderr).
    """

    def __init__(
        self,
        ranks: Sequence[RankSpec],
        *,
        tag_output: bool = False,
        grace: float = 5.0,
        timeout: float | None = None,
        before_stop: Callable[[list[int]], object] | None = None,
        check: Callable[[], str | None] | None = None,
        after_start: Callable[[], None] | None = None,
        check_interval: tuple[float, float] = (0.2, 2.0),
        note: Callable[[str], None] | None = None,
        stdout: IO[bytes] | None = None,
        stderr: IO[bytes] | None = None,
    ) -> None:
        self.ranks = list(ranks)
        self.tag_output = tag_output
        self.grace = grace
        self.timeout = timeout
        self.before_stop = before_stop
        self.check = check
        self.after_start = after_start
        self.check_interval = check_interval
        self.note = note or (lambda text: print(f"mpsrun: {text}", file=sys.stderr, flush=True))
        self.stdout = stdout or sys.stdout.buffer
        self.stderr = stderr or sys.stderr.buffer
        self.procs: dict[int, subprocess.Popen[bytes]] = {}  # rank -> process
        self._pidfds: dict[int, int] = {}  # fd -> rank
        self._reaped: dict[int, RankExit] = {}
        self._stop_deadline: float | None = None
        self._killed = False

    # -- process handling -------------------------------------------------------------------

    def _spawn(self, spec: RankSpec) -> None:
        piped = subprocess.PIPE if self.tag_output else None
        proc = subprocess.Popen(
            list(spec.argv),
            env=spec.env,
            stdin=subprocess.DEVNULL if spec.rank else None,
            stdout=piped,
            stderr=piped,
            start_new_session=True,
            preexec_fn=_set_parent_death_signal,
        )
        self.procs[spec.rank] = proc
        if self.tag_output:
            assert proc.stdout is not None and proc.stderr is not None
            self._tagger.attach(spec.rank, proc.stdout, self.stdout)
            self._tagger.attach(spec.rank, proc.stderr, self.stderr)
        with contextlib.suppress(AttributeError, OSError):  # no pidfds: fall back to polling
            self._pidfds[os.pidfd_open(proc.pid)] = spec.rank

    def live_pids(self) -> list[int]:
        return [p.pid for r, p in self.procs.items() if r not in self._reaped]

    def _signal_ranks(self, sig: int) -> None:
        for rank, proc in self.procs.items():
            if rank in self._reaped and sig != signal.SIGKILL:
                continue
            # The rank's own process group: its whole tree, never anything else.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)

    def _begin_stop(self, sig: int = signal.SIGTERM) -> None:
        if self._stop_deadline is not None:
            return
        live = self.live_pids()
        if live and self.before_stop is not None:
            try:
                self.before_stop(live)
            except Exception as exc:  # stopping must go on
                self.note(f"could not detach ranks from MPS before stopping them: {exc}")
        self._signal_ranks(sig)
        self._stop_deadline = time.monotonic() + self.grace

    def _kill_now(self) -> None:
        self._killed = True
        self._signal_ranks(signal.SIGKILL)

    def _reap(self) -> list[RankExit]:
        new = []
        for rank, proc in self.procs.items():
            if rank not in self._reaped and proc.poll() is not None:
                self._reaped[rank] = RankExit(rank, proc.pid, proc.returncode)
                new.append(self._reaped[rank])
        return new

    # -- the loop -----------------------------------------------------------------------------

    def _wait(self, wakeup: int, timeout: float) -> list[int]:
        """Block until a rank exits, a signal arrives, or ``timeout``; return signals received."""
        poller = select.poll()
        poller.register(wakeup, select.POLLIN)
        for fd in self._pidfds:
            poller.register(fd, select.POLLIN)
        if len(self._pidfds) < len(self.procs):
            timeout = min(timeout, 0.05)  # no pidfd support: a bounded poll interval
        poller.poll(max(0, int(timeout * 1000)))
        received: list[int] = []
        with contextlib.suppress(BlockingIOError):
            received.extend(os.read(wakeup, 512))
        for fd in [fd for fd, rank in self._pidfds.items() if rank in self._reaped]:
            os.close(fd)
            del self._pidfds[fd]
        return received

    def run(self) -> JobResult:
        self._tagger = _LineTagger(threading.Lock())
        read_end, write_end = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        previous: dict[int, object] = {}
        old_wakeup = -1
        in_main = threading.current_thread() is threading.main_thread()
        try:
            if in_main:
                old_wakeup = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
                for sig in (*STOP_SIGNALS, *FORWARD_SIGNALS):
                    previous[sig] = signal.signal(sig, lambda *_: None)  # the byte on the pipe is the event
            return self._run(read_end)
        finally:
            if self.live_pids():
                self._kill_now()
            for proc in self.procs.values():
                proc.wait()
            with contextlib.suppress(Exception):
                self._signal_ranks(signal.SIGKILL)  # leftovers in the ranks' groups
            self._tagger.join()
            if in_main:
                for number, handler in previous.items():
                    signal.signal(number, handler)  # type: ignore[arg-type]
                signal.set_wakeup_fd(old_wakeup)
            for fd in (read_end, write_end, *self._pidfds):
                os.close(fd)

    def _run(self, wakeup: int) -> JobResult:
        start = time.monotonic()
        deadline = None if self.timeout is None else start + self.timeout
        for spec in self.ranks:
            try:
                self._spawn(spec)
            except OSError as exc:
                self._begin_stop()
                return JobResult(
                    127 if isinstance(exc, FileNotFoundError) else 126,
                    "not-found",
                    f"cannot start rank {spec.rank}: {spec.argv[0]}: {exc.strerror}",
                )
        first: RankExit | None = None
        interrupted: int | None = None
        timed_out = False
        check_failed: str | None = None
        if self.after_start is not None:
            try:
                self.after_start()
            except Exception as exc:
                check_failed = str(exc)
                self._begin_stop()
        next_check, interval = start + self.check_interval[0], self.check_interval[0]
        while True:
            for done in self._reap():
                if done.returncode != 0 and first is None and self._stop_deadline is None:
                    first = done
                    self._begin_stop()
            if len(self._reaped) == len(self.procs):
                break
            now = time.monotonic()
            if self._stop_deadline is not None and now >= self._stop_deadline and not self._killed:
                self._kill_now()
            if deadline is not None and now >= deadline and not timed_out:
                timed_out = True
                self.note(f"timeout: the job ran longer than {self.timeout:g} s; stopping it")
                self._begin_stop()
            if self.check is not None and now >= next_check and self._stop_deadline is None:
                check_failed = self.check()
                interval = min(interval * 2, self.check_interval[1])
                next_check = now + interval
                if check_failed:
                    self._begin_stop()
            waits = [next_check - now] if self.check is not None else [3600.0]
            waits += [t - now for t in (deadline, self._stop_deadline) if t is not None]
            for sig in self._wait(wakeup, max(0.0, min(waits))):
                if sig in FORWARD_SIGNALS:
                    self._signal_ranks(sig)
                elif interrupted is not None and sig == signal.SIGINT:
                    self.note("second interrupt: killing the ranks now")
                    self._kill_now()
                elif interrupted is None:
                    interrupted = sig
                    self.note(f"received {signal.Signals(sig).name}; stopping the ranks")
                    self._stop_deadline = None
                    self._begin_stop(sig)
        exits = [self._reaped[r] for r in sorted(self._reaped)]
        if interrupted is not None:
            return JobResult(
                128 + interrupted, "signal", f"stopped by {signal.Signals(interrupted).name}", first, exits
            )
        if timed_out:
            return JobResult(124, "timeout", f"timed out after {self.timeout:g} s", first, exits)
        if check_failed:
            return JobResult(3, "check-failed", check_failed, first, exits)
        if first is not None:
            return JobResult(first.exit_code, "rank-failed", f"{first.describe()} first", first, exits)
        return JobResult(0, "ok", "", None, exits)
