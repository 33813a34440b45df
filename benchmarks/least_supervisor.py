"""The least a rank supervisor written in Python starts with: the floor of mpsrun's per-rank cost under mpiexec.

    python3 -S benchmarks/least_supervisor.py [--import MODULE] [--wait-for-daemon] COMMAND [ARGS...]

An interpreter without ``site``, the modules any supervisor that speaks a JSON protocol over a socket and forwards
signals needs (os, signal, socket, json), then COMMAND as its child, signals passed on, and its exit code.
benchmarks/overhead.py starts ranks under it (the variants named ``least supervisor``): what each rank pays for a
supervisor interpreter and nothing else of mpsrun's. ``--import MODULE`` imports that module of this tree first
(``mpsrun.rank.cli``: what mpsrun's own supervisor imports), to tell its imports' cost from the rest of mpsrun's.
``--wait-for-daemon``: the rank starts only once its MPS daemon's control socket is there
(``$CUDA_MPS_PIPE_DIRECTORY/control``), as a rank must not run CUDA before (benchmarks/least_command.py).
"""

import json  # noqa: F401 - imported for its cost: a supervisor's messages are JSON lines
import os
import signal
import socket  # noqa: F401 - imported for its cost: a supervisor reaches its agent over a socket
import sys
import time

command = sys.argv[1:]
if command[:1] == ["--import"]:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __import__(command[1])
    command = command[2:]
if command[:1] == ["--wait-for-daemon"]:
    control, deadline = os.path.join(os.environ["CUDA_MPS_PIPE_DIRECTORY"], "control"), time.monotonic() + 10
    while not os.path.exists(control):
        if time.monotonic() > deadline:
            sys.exit("least_supervisor.py: the MPS daemon did not come up within 10 s")
        time.sleep(0.001)
    command = command[1:]
child = os.fork()
if child == 0:
    os.execvp(command[0], command)
for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, lambda number, _frame: os.kill(child, number))
_, status = os.waitpid(child, 0)
sys.exit(os.waitstatus_to_exitcode(status))
