"""The least a rank supervisor written in Python starts with: the floor of mpsrun's per-rank cost under mpiexec.

    python3 -S benchmarks/least_supervisor.py [--import MODULE] COMMAND [ARGS...]

An interpreter without ``site``, the modules any supervisor that speaks a JSON protocol over a socket and forwards
signals needs (os, signal, socket, json), then COMMAND as its child, signals passed on, and its exit code.
benchmarks/overhead.py starts ranks under it (the variants named ``+least supervisor``): what each rank pays for a
supervisor interpreter and nothing else of mpsrun's. ``--import MODULE`` imports that module of this tree first
(``mpsrun.rank.cli``: what mpsrun's own supervisor imports), to tell its imports' cost from the rest of mpsrun's.
"""

import json  # noqa: F401 - imported for its cost: a supervisor's messages are JSON lines
import os
import signal
import socket  # noqa: F401 - imported for its cost: a supervisor reaches its agent over a socket
import sys

command = sys.argv[1:]
if command[:1] == ["--import"]:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __import__(command[1])
    command = command[2:]
child = os.fork()
if child == 0:
    os.execvp(command[0], command)
for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, lambda number, _frame: os.kill(child, number))
_, status = os.waitpid(child, 0)
sys.exit(os.waitstatus_to_exitcode(status))
