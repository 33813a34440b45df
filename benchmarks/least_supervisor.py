"""The least a rank supervisor written in Python starts with: the floor of mpsrun's per-rank cost under mpiexec.

    python3 -S benchmarks/least_supervisor.py COMMAND [ARGS...]

An interpreter without ``site``, the modules any supervisor that speaks a JSON protocol over a socket and forwards
signals needs (os, signal, socket, json), then COMMAND as its child, signals passed on, and its exit code.
benchmarks/overhead.py starts every rank of ``script+mpiexec`` under it (the variant ``script+mpiexec+least
supervisor``): what MPS by hand with mpiexec costs once each rank pays for a supervisor interpreter, and nothing else
of mpsrun's.
"""

import json  # noqa: F401 - imported for its cost: a supervisor's messages are JSON lines
import os
import signal
import socket  # noqa: F401 - imported for its cost: a supervisor reaches its agent over a socket
import sys

child = os.fork()
if child == 0:
    os.execvp(sys.argv[1], sys.argv[1:])
for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, lambda number, _frame: os.kill(child, number))
_, status = os.waitpid(child, 0)
sys.exit(os.waitstatus_to_exitcode(status))
