"""What mpsrun knows of MPI launchers: finding mpiexec, telling its flavour, building its command line."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Sequence

from mpsrun.config import values
from mpsrun.errors import ConfigError
from mpsrun.runtime.interrupts import uninterrupted
from mpsrun.runtime.processes import kill_group

__all__ = [
    "FLAVOURS",
    "detect_flavour",
    "find_mpiexec",
    "flavour_of_version",
    "host_arguments",
    "mpiexec_command",
]

FLAVOURS = ("openmpi", "mpich", "intel", "unknown")


def find_mpiexec(explicit: str | None = None) -> str | None:
    """The mpiexec to use: ``explicit`` (``--mpiexec``, checked when it was parsed) if given, else the name of the
    first of mpiexec and mpirun on PATH. Started by name, not by absolute path, Open MPI leaves the ranks' PATH and
    LD_LIBRARY_PATH as they are (by absolute path it puts its own directories first), so an ``explicit`` absolute
    path that PATH finds under its name is started by that name."""
    if explicit:
        name = os.path.basename(explicit)
        found = shutil.which(name)
        # The same directory, not just the same file: a launcher finds its helpers beside the path it was run by.
        return name if found and os.path.abspath(found) == os.path.abspath(explicit) else explicit
    return next((name for name in ("mpiexec", "mpirun") if shutil.which(name)), None)


def flavour_of_version(text: str) -> str:
    """Tell the MPI implementation from ``mpiexec --version`` output."""
    lowered = text.lower()
    if "open mpi" in lowered or "openrte" in lowered or "open-mpi" in lowered:
        return "openmpi"
    if "intel(r) mpi" in lowered or "intel mpi" in lowered:
        return "intel"
    if "hydra" in lowered or "mpich" in lowered:
        return "mpich"
    return "unknown"


def detect_flavour(mpiexec: str) -> str:
    """The flavour from ``mpiexec --version``.

    It runs in a process group of its own: on a timeout or an interrupt the whole group is killed, so a wrapper
    script's children are not left behind.
    """
    probe = None
    try:
        with uninterrupted():  # a signal while it starts waits until the probe is ours to kill (it leaked 1 in 20)
            probe = subprocess.Popen([mpiexec, "--version"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        output, _ = probe.communicate(timeout=20)
    except BaseException as exc:
        if probe is not None:
            kill_group(probe.pid, signal.SIGKILL)
            probe.communicate()
        if isinstance(exc, (subprocess.TimeoutExpired, OSError)):
            return "unknown"
        raise
    return flavour_of_version(output)


def mpiexec_command(
    mpiexec: str,
    flavour: str,
    nranks: int,
    rank_command: Sequence[str],
    extra_args: Sequence[str] = (),
    *,
    as_root: bool | None = None,
    oversubscribe: bool = True,
    export: Sequence[str] = (),
) -> list[str]:
    """The full mpiexec command line, with what the flavour needs added.

    Open MPI refuses to run as root without ``--allow-run-as-root`` and refuses more
    ranks than slots (by default one per physical core) without ``--oversubscribe``, which only
    allows more and changes nothing for fewer: ranks that share GPUs often outnumber the cores
    (``oversubscribe=False`` leaves the slots to a host file). It passes a variable to ranks on
    other hosts only when named with ``-x`` (``export``). Hydra passes the whole environment.
    """
    as_root = (os.geteuid() == 0) if as_root is None else as_root
    argv = [mpiexec, "-n", str(nranks)]
    if flavour == "openmpi":
        if as_root and "--allow-run-as-root" not in extra_args:
            argv.append("--allow-run-as-root")
        if oversubscribe and "--oversubscribe" not in extra_args:
            argv.append("--oversubscribe")
        for name in export:
            argv += ["-x", name]
    return [*argv, *extra_args, *rank_command]


def host_arguments(flavour: str, hosts: Sequence[str] = (), hostfile: str | None = None) -> list[str]:
    """The flavour's way to name the hosts: Open MPI ``--host``/``--hostfile``, MPICH/Intel ``-hosts``/``-f``."""
    if flavour == "openmpi":
        return ["--hostfile", hostfile] if hostfile else ["--host", ",".join(hosts)]
    if flavour in ("mpich", "intel"):
        for line in values.hostfile_lines(hostfile) if hostfile else ():
            if "=" in line:  # Hydra answers with nine lines of its own errors
                raise ConfigError(f"host file {hostfile!r}: {line!r} is Open MPI's form; the mpiexec of MPICH and "
                                  "Intel MPI takes host or host:N lines", setting="--hostfile", value=hostfile)
        return ["-f", hostfile] if hostfile else ["-hosts", ",".join(hosts)]
    raise ConfigError(
        "--hosts/--hostfile: cannot tell how this mpiexec takes hosts (not Open MPI, MPICH or Intel MPI); "
        "pass them with --mpiexec-arg",
        setting="--hosts",
    )
