"""What the processes of one job must agree on: the signals, the waits, and the variables that link them.

A job's processes are the ``mpsrun`` command (the job's controller), node keepers, rank supervisors and
reapers, often on several hosts. Each wait below is named once, with the waits it must outlast beside it.
"""

from __future__ import annotations

import signal

# -- signals -----------------------------------------------------------------------------------------------
#: Signals that stop a job (forwarded to every rank, then teardown): exit 128+N.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: Signals passed on to the ranks and nothing more.
PASS_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)
#: Every signal a supervisor or controller takes and forwards to the ranks.
FORWARDED_SIGNALS = STOP_SIGNALS + PASS_SIGNALS
#: One Ctrl-C can reach a rank twice (from the terminal and from the launcher) within this.
SAME_INTERRUPT = 0.25

# -- variables -------------------------------------------------------------------------------------------
#: Where a rank supervisor (or node keeper) reaches its controller (``unix:PATH`` or ``tcp:HOST:PORT``).
CONTROL_VARIABLE = "MPSRUN_CONTROL"
#: The job's secret: a peer's first message must carry it.
TOKEN_VARIABLE = "MPSRUN_CONTROL_TOKEN"  # noqa: S105 - the variable's name, not a secret
#: Under ``--hosts``, the job's configuration as JSON, for every host's ``mpsrun --per-node``.
CONFIG_VARIABLE = "MPSRUN_CONTROL_CONFIG"
#: Names the job for the node sessions of its ranks (the local ranks of one job share one).
JOB_ID_VARIABLE = "MPSRUN_JOB_ID"
#: Variables that link a supervisor to its controller: never passed on to the rank's command.
CONTROL_VARIABLES = (CONTROL_VARIABLE, TOKEN_VARIABLE, CONFIG_VARIABLE)
#: A Python rank's socket (a path in the session directory) on which mpsrun's runner tells the rank's supervisor that it
#: is about to call MPI_Abort (:mod:`mpsrun.rank.pyrun`): the MPI launcher then ends every process of the job at once.
ABORT_SOCKET_VARIABLE = "MPSRUN_ABORT_SOCKET"
#: Who started a Python rank, for its runner (:mod:`mpsrun.rank.pyrun`), which says why when rank 0 is alone in its
#: MPI world: the local launcher (each rank an MPI world of its own), asked for (``local``) or for want of an mpiexec
#: (``no-mpiexec``), or an MPI launcher (``mpi``).
WORLD_VARIABLE = "MPSRUN_WORLD"
#: A UNIX socket's path must fit the kernel's sun_path, 108 bytes with its terminating NUL (Linux).
SOCKET_PATH_MOST = 108
#: The job's (or node's) private session directory, in every rank (mpsrun.shared keeps its handles there).
SESSION_DIR_VARIABLE = "MPSRUN_SESSION_DIR"
#: Overrides the host name in node sessions' names (tests simulate several nodes on one machine).
NODE_ID_VARIABLE = "MPSRUN_NODE_ID"
#: What an MPI launcher may rewrite in its ranks' environment that the caller's values must win for: Open MPI
#: started by absolute path puts its own bin and lib directories first (measured on the H100 machine), so a
#: wrapper script's ``python3`` became the system's instead of the caller's virtual environment's.
LAUNCHER_REWRITES = ("PATH", "LD_LIBRARY_PATH")
#: What MPI launchers and batch systems set for their own processes (by prefix): theirs to set in a rank, even
#: where the caller has a value (a rank's SLURM_PROCID is not the batch step's).
LAUNCHER_PREFIXES = ("OMPI_", "PMI", "HYDRA_", "HYDI_", "MPI_LOCAL", "OPAL_", "PRTE_", "SLURM_", "MPIR_", "I_MPI_",
                     "PALS_", "MV2_", "GFORTRAN_UNBUFFERED_PRECONNECTED", "HFI_", "IPATH_", "HWLOC_")
#: torch.distributed's ``env://`` rendezvous (rank 0's host, one port per job), set as torchrun sets them.
RENDEZVOUS_VARIABLES = ("MASTER_ADDR", "MASTER_PORT")
#: Where session directories go (else $XDG_RUNTIME_DIR, else /tmp).
TMPDIR_VARIABLE = "MPSRUN_TMPDIR"

# -- waits, in seconds -----------------------------------------------------------------------------------
#: A supervisor waits this long for its welcome: the controller may be starting the MPS daemons meanwhile.
WELCOME_TIMEOUT = 300.0
#: A supervisor waits this long for its verdict after its rank ended; it then waits for its node's other ranks and a
#: node keeper's teardown (LINGER_TIMEOUT), shorter.
VERDICT_TIMEOUT = 300.0
#: A rank waits this long after its verdict for its node's other ranks (they leave their launcher together) and the
#: node keeper's teardown (a hanging quit, then SIGTERM, SIGKILL).
LINGER_TIMEOUT = 60.0
#: A rank's output still open after its process group is gone (a writer that left the group).
DRAIN_TIMEOUT = 2.0
#: A rank's output is passed on in whole lines; to a terminal, a partial line (a prompt, a progress bar) is passed on
#: once it has waited this long. Well above the time between a print's text and its newline under unbuffered output.
PARTIAL_LINE_WAIT = 0.5
#: The ranks' output lock is held only across a write to the job's output: one held this long while the output has
#: room is held by no writer of the job (a process a rank left running), and is given up.
OUTPUT_LOCK_PATIENCE = 2.0
#: An MPI launcher that ended while ranks ran: how long their own reports (relayed by node keepers under --hosts)
#: may still come before the launcher's status is the job's.
LAUNCHER_REPORT_WAIT = 2.0
#: A stopping signal a node keeper relays from its ranks is heard this much later: when a host dies, the MPI launcher
#: stops the other hosts' ranks too, and the dead host's lost link, a moment behind, is the cause to say.
RELAYED_INTERRUPT_WAIT = 0.5
#: A rank that reported its MPI_Abort: how long its launcher gets to end the job's other ranks (at once, measured with
#: MPICH's Hydra and Open MPI) before mpsrun stops those left, unless the rank's supervisor is gone sooner.
ABORT_WAIT = 2.0
#: After SIGKILL, how long a rank's supervisor gets to report before the rank is given up as lost.
KILL_WAIT = 10.0
#: Detaching the ranks from MPS before they are signalled: each control command's deadline, and the time after
#: which no more are sent. Below KILL_WAIT, so a daemon that stopped answering holds the stop up for less than the
#: ranks' supervisors give their controller.
DETACH_TIMEOUT = 5.0
#: A control command of the job's watch (a server's state once its first client is in): it runs in the controller's
#: loop, which must stay free for its ranks and timers, so a daemon that stops answering is found within this.
WATCH_COMMAND_TIMEOUT = 2.0
#: How long a node keeper keeps its session for ranks the launcher said would come.
LATE_WAIT = 30.0
#: How long a node keeper waits for its first rank before it gives up.
IDLE_TIMEOUT = 60.0
#: How long the job's controller waits for the hosts' node keepers to end their sessions.
NODE_CLOSE_WAIT = 60.0
#: At least this long, for an abandoned launch's MPI launcher to start (and end) the ranks it refused.
ABANDON_WAIT = 5.0
#: How long a rank waits for its node keeper to start (bounded by --timeout when one is given).
KEEPER_START_TIMEOUT = 120.0
#: A node keeper's wait for the job's controller to answer its hello (under --hosts).
UPSTREAM_TIMEOUT = 30.0
#: Connecting to a controller.
CONNECT_TIMEOUT = 10.0
#: A TCP link between hosts (a node keeper's to the job's controller) that has been silent this long is probed,
#: every LINK_PROBE_EVERY s, and taken for lost after LINK_PROBES unanswered probes, or once data it sent has gone
#: unacknowledged for LINK_LOST_AFTER s: a host cut off the network sends no FIN, and its job would wait forever.
LINK_IDLE, LINK_PROBE_EVERY, LINK_PROBES, LINK_LOST_AFTER = 5, 2, 3, 15.0
#: A peer's hello, sent right after it connects, read before it is turned away.
HELLO_WAIT = 1.0
#: Each MPS daemon's start (to answer, and its server to come up) and stop (quit, then signals).
DAEMON_START_TIMEOUT = 30.0
DAEMON_STOP_TIMEOUT = 10.0
#: Holding this user's lock on the session root (node sessions start and end under it).
LOCK_TIMEOUT = 60.0
#: When the launchers ask for each MPS server, after the last rank has started (see job.backends).
SERVER_AFTER = 0.25
#: NVML is sampled this often: two looks in a row find a rank off MPS.
WATCH_INTERVAL = 0.2
#: How often a job samples its ranks' device memory from NVML (a rank's peak is its largest sample).
USAGE_INTERVAL = 0.5
#: Clients an MPS server accepts on Volta and later (documented; the H100 with driver 580
#: logged "Maximum number of clients (48) reached" for the 49th).
MPS_CLIENT_LIMIT = 48
#: The most hardware work queues CUDA gives a process (``CUDA_DEVICE_MAX_CONNECTIONS``), and so ``--queues``' most.
MOST_QUEUES = 32
