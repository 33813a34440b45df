"""The protocol between a job's processes: messages declared once, garbage dropped, strangers bounded.

Also what a rank's supervisor and a session record make of input they did not write.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from mpsrun.errors import RecordError
from mpsrun.runtime.deadline import Deadline
from mpsrun.runtime.processes import python_without_site
from mpsrun.runtime.protocol import (
    HELLO_MAX,
    LINE_MAX,
    MESSAGES,
    Link,
    Note,
    Say,
    SignalRanks,
    Verdict,
    Welcome,
    connect,
    decode,
    encode,
)
from mpsrun.session.record import SessionRecord


def test_every_declared_message_is_sent_somewhere():
    """Every message class of MESSAGES is built somewhere in the package (the declaration holds no dead kind), and
    every kind has its own class: the declaration and the code cannot drift apart (the code builds its messages from
    these classes, so it can send nothing else)."""
    import ast
    from pathlib import Path

    built: set[str] = set()
    for path in (Path(__file__).resolve().parent.parent / "mpsrun").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                built.add(node.func.id)
    assert {cls.__name__ for cls in MESSAGES.values()} <= built
    assert len(set(MESSAGES.values())) == len(MESSAGES)


def test_a_message_is_encoded_only_as_declared():
    """encode() refuses a field of the wrong type (a bool for a number, a number for a text, a list of the wrong
    items), and what it writes decodes to the same message."""
    assert decode(encode(Verdict(3, ["a", "b"], True))) == Verdict(3, ["a", "b"], True)
    welcome = Welcome({"A": "1"}, [{"B": "2"}], ["C"], {"D": None}, True, 5, None, False, None, None, 3, 126, ["said"])
    assert decode(encode(welcome)) == welcome
    for wrong in (SignalRanks("15"), Verdict(0, True), Verdict(0, [0]), Note(None),  # type: ignore[arg-type]
                  Welcome({"A": 1}, [], [], {}, True, 5, None, False, None, None, None, None, [])):  # type: ignore[dict-item]
        with pytest.raises(ValueError, match="not a"):
            encode(wrong)


@pytest.mark.parametrize("line", [
    b"{x", b"[" * 100_000, b'{"type": "hello"}', b'{"type": "exited", "rank": "0", "returncode": 0}',
    b'{"type": "signal", "signal": 9.5}', b"\xff\xfe", b"null", b'"text"', b'{"type": 7}', b"",
    b'{"type": "verdict", "exit_code": 0, "lines": ["a", 1]}', b'{"type": "verdict", "exit_code": true}',
    b'{"type": "welcome", "env": {"A": 1}}', b'{"type": "frobnicate"}',
])
def test_what_is_not_a_declared_message_is_dropped(line):
    """Garbage, JSON nested deeper than Python parses, an unknown type, a message missing a field or with one of
    the wrong type (inside a list or a mapping too): decode() returns None for each, never an exception (a peer's
    line once crashed the controller)."""
    assert decode(line) is None


def test_a_field_the_declaration_does_not_know_is_left_out():
    """A line with a field its message does not declare decodes to the message without it (a newer peer's addition
    reaches no handler)."""
    assert decode(b'{"type": "say", "text": "hi", "colour": "red"}') == Say("hi")


def _pair(line_max: int = LINE_MAX) -> tuple[Link, socket.socket]:
    ours, theirs = socket.socketpair()
    return Link(ours, line_max=line_max), theirs


def test_a_stranger_cannot_send_more_than_a_hello_before_it_is_admitted():
    """Before a link is admitted (its peer has shown the job's token), a line longer than HELLO_MAX ends the link
    without being parsed; once admitted, lines up to LINE_MAX are read."""
    link, peer = _pair(HELLO_MAX)
    peer.sendall(b"x" * (HELLO_MAX + 1))
    assert [link.receive(), link.receive()] == [[], None] and not link.usable
    link.close()
    peer.close()
    link, peer = _pair(HELLO_MAX)
    link.admit()
    message = encode(Note("y" * (HELLO_MAX * 2)))
    peer.sendall(message)
    received: list[object] = []
    while not received:
        batch = link.receive()
        assert batch is not None
        received += batch
    assert received[0] == Note("y" * (HELLO_MAX * 2))
    link.close()
    peer.close()


def test_what_comes_with_an_awaited_message_is_held_for_the_next_receive():
    """Messages that arrive in one read with the one :meth:`Link.expect` waits for are held, and the next
    :meth:`Link.receive` returns them: a command's stop sent right after an agent's admission was dropped with it,
    and the agent's ranks ran on."""
    link, peer = _pair(LINE_MAX)
    peer.sendall(encode(Note("first")) + encode(Verdict(0)) + encode(Note("after")) + encode(SignalRanks(10)))
    assert link.expect((Verdict,), Deadline(5)) == Verdict(0)
    assert link.held == [Note("after"), SignalRanks(10)]
    assert link.receive() == [Note("after"), SignalRanks(10)] and not link.held
    link.close()
    peer.close()


def test_a_session_record_nested_deeper_than_python_parses_is_unreadable(tmp_path):
    """A corrupt session.json of 100,000 nested brackets is a RecordError (``status`` lists it as unreadable and
    ``cleanup`` goes on), not a RecursionError out of the command."""
    record = tmp_path / "session.json"
    record.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(RecordError):
        SessionRecord.read(record)


def test_the_supervisor_comes_from_mpsrun_not_from_the_working_directory(tmp_path):
    """A job run from a directory that holds another ``mpsrun`` package (a checkout, a stray directory) or a module
    named as one of the standard library's (a project's ``math.py``) still runs its own supervisor on the standard
    library: nothing comes from the working directory, which ``-c`` puts first on the path (it used to win)."""
    foreign = tmp_path / "mpsrun"
    foreign.mkdir()
    (foreign / "__init__.py").write_text("raise SystemExit('the foreign mpsrun was imported')\n")
    (tmp_path / "math.py").write_text("raise SystemExit('the project math.py was imported')\n")
    argv = [*python_without_site("mpsrun.rank.cli"), "--", "true"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MPSRUN_CONTROL")}
    out = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60)
    assert "foreign" not in out.stderr and "project" not in out.stderr
    assert "needs MPSRUN_CONTROL" in out.stderr  # mpsrun's own supervisor, refusing to run without a job
    assert out.returncode == 2


@pytest.mark.parametrize("keep", [False, True])
def test_descriptors_that_come_with_a_message_are_kept_only_where_asked(keep):
    """Open files sent with a message over a Unix socket: a link that keeps descriptors hands them over once
    (``take_descriptors``), and closes any that come after; any other link closes them on arrival, so a stranger on
    the agent's socket cannot make mpsrun hold its files open."""
    ours, theirs = socket.socketpair(socket.AF_UNIX)
    read_end, write_end = os.pipe()
    link = Link(ours, keep_descriptors=keep)
    try:
        before = len(os.listdir("/proc/self/fd"))
        assert Link(theirs).send(Note("hello"), (read_end, write_end))
        assert [type(m) for m in link.receive() or []] == [Note]
        taken = link.take_descriptors()
        assert len(taken) == (2 if keep else 0) and len(os.listdir("/proc/self/fd")) == before + len(taken)
        for fd in taken:
            os.close(fd)
        assert Link(theirs).send(Note("again"), (read_end,)) and link.receive() is not None
        assert len(os.listdir("/proc/self/fd")) == before and link.take_descriptors() == []
    finally:
        for fd in (read_end, write_end):
            os.close(fd)
        link.close()
        theirs.close()


def test_a_link_outlives_its_peers_process_not_only_its_end_of_the_link(tmp_path):
    """``outlive_peer`` returns once the peer's process has ended, not when the peer's end of the link closes: a
    process's descriptors close a moment before it is gone, and a node's last rank that ended in that moment left
    its node keeper running (seen in CI). The peer here closes its end, then lives on a while: the wait lasts until
    it has ended."""
    path = tmp_path / "peer.sock"
    peer = subprocess.Popen([sys.executable, "-c", (
        "import socket, sys, time\n"
        "s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen(); print('ready', flush=True)\n"
        "c, _ = s.accept(); c.close(); s.close(); time.sleep(1.0)"), str(path)], stdout=subprocess.PIPE, text=True)
    assert peer.stdout is not None and peer.stdout.readline() == "ready\n"
    link = connect(f"unix:{path}")
    link.outlive_peer(Deadline(60))
    assert link.closed and peer.poll() is not None  # ended (a zombie until now), not merely closed its end
    peer.stdout.close()
