"""The controller's event loop and its links: a descriptor's events never reach another descriptor's callback.

Measured (CI, and 2-5 of 15 runs of ``mpsrun -np 200 --launcher local --mps off true`` here): the controller hung
in a blocking ``waitpid`` on a live rank supervisor for 300 s. A link's socket had been closed when its end was
read, before the loop stopped watching it; the forked supervisors, which hold a copy of every descriptor until
they close theirs, kept the socket alive, so the kernel kept reporting its end under its number, and that number
had been reused for the next supervisor's pidfd.
"""

import os
import signal
import socket

from mpsrun.runtime.loop import EventLoop
from mpsrun.runtime.protocol import Link, Note


def test_a_link_that_ended_stays_open_until_its_owner_closes_it():
    """``receive()`` says the peer is gone (None) but leaves the socket open: its owner stops waiting on it first."""
    ours, theirs = socket.socketpair()
    link = Link(ours)
    theirs.close()
    assert link.receive() is None and not link.usable and not link.send(Note("hello"))
    assert ours.fileno() == link.fd  # still open
    assert link.receive() is None
    link.close()
    assert ours.fileno() == -1


def test_an_ended_link_does_not_wake_the_descriptor_that_reuses_its_number():
    """A link ends while a forked child still holds its socket; the loop's owner unwatches and closes it, and the
    next descriptor gets the same number: only that descriptor's own events reach its callback."""
    loop = EventLoop()
    ours, theirs = socket.socketpair()
    link = Link(ours)
    woken = []

    def on_link():
        if link.receive() is None:
            loop.unwatch(link.fd)
            link.close()

    loop.watch(link.fd, on_link)
    done_read, done_write = os.pipe()
    child = os.fork()
    if child == 0:  # a forked supervisor before it closes what it inherited (here: only the link's socket)
        theirs.close()
        os.close(done_write)
        os.read(done_read, 1)  # holds the socket until the test is done with it
        os._exit(0)
    os.close(done_read)
    try:
        theirs.close()
        loop.run_once(max_wait=1.0)
        assert link.closed
        read_end, write_end = os.pipe()
        reused = read_end if read_end == link.fd else None
        assert reused is not None, "the pipe did not get the link's descriptor number"
        loop.watch(read_end, lambda: woken.append(read_end))
        loop.run_once(max_wait=0.3)
        assert woken == [], "the closed socket's end woke the pipe's callback"
        os.close(read_end)
        os.close(write_end)
    finally:
        os.close(done_write)
        os.waitpid(child, 0)
        loop.close()


def test_a_signal_after_the_loops_last_look_reaches_its_callback():
    """A signal that comes once the loop has stopped looking, before its signals' block ends (the job's loop over,
    NVML shutting down), reaches the block's callback as the block ends, once; after the block, the handler from
    before has it. It was lost: a SIGTERM there left a job to exit 0 (tests/test_signals_as_jobs_start_and_end.py's teardown test, now and
    then in the suite)."""
    loop = EventLoop()
    seen, before = [], []
    previous = signal.signal(signal.SIGUSR1, lambda number, frame: before.append(number))
    try:
        with loop.signals([signal.SIGUSR1], seen.append):
            loop.run_once(0)
            os.kill(os.getpid(), signal.SIGUSR1)  # the loop looks no more
            assert seen == []
        assert seen == [signal.SIGUSR1] and before == []
        os.kill(os.getpid(), signal.SIGUSR1)
        assert seen == [signal.SIGUSR1] and before == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, previous)

