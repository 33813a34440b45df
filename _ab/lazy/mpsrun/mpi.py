"""What mpsrun knows of MPI launchers: finding mpiexec, telling its flavour, building its command line."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from collections.abc import Sequence

from mpsrun.errors import ConfigError

__all__ = [
    "FLAVOURS",
    "detect_flavour",
    "find_mpiexec",
    "flavour_of_version",
    "host_arguments",
    "mpi4py_available",
    "mpiexec_command",
]

FLAVOURS = ("openmpi", "mpich", "intel", "unknown")


def find_mpiexec(explicit: str | None = None) -> str | None:
    """The mpiexec to use: ``explicit`` if given (must exist), else ``mpiexec`` on PATH."""
    if explicit:
        found = shutil.which(explicit)
        if found is None:
            raise ConfigError(f"--mpiexec {explicit}: no such executable", setting="--mpiexec", value=explicit)
        return found
    return shutil.which("mpiexec") or shutil.which("mpirun")


def mpi4py_available() -> bool:
    return importlib.util.find_spec("mpi4py") is not None


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
    try:
        result = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return flavour_of_version(result.stdout + result.stderr)


def mpiexec_command(
    mpiexec: str,
    flavour: str,
    nranks: int,
    rank_command: Sequence[str],
    extra_args: Sequence[str] = (),
    *,
    as_root: bool | None = None,
    cores: int | None = None,
    export: Sequence[str] = (),
) -> list[str]:
    """The full mpiexec command line, with what the flavour needs added.

    Open MPI refuses to run as root without ``--allow-run-as-root`` and refuses more
    ranks than slots (cores) without ``--oversubscribe``; it passes a variable to ranks on
    other hosts only when named with ``-x`` (``export``). Hydra passes the whole environment.
    """
    as_root = (os.geteuid() == 0) if as_root is None else as_root
    argv = [mpiexec, "-n", str(nranks)]
    if flavour == "openmpi":
        if as_root and "--allow-run-as-root" not in extra_args:
            argv.append("--allow-run-as-root")
        if (cores is None or nranks > cores) and "--oversubscribe" not in extra_args:
            argv.append("--oversubscribe")
        for name in export:
            argv += ["-x", name]
    return [*argv, *extra_args, *rank_command]


def host_arguments(flavour: str, hosts: Sequence[str] = (), hostfile: str | None = None) -> list[str]:
    """The flavour's way to name the hosts: Open MPI ``--host``/``--hostfile``, MPICH/Intel ``-hosts``/``-f``."""
    if flavour == "openmpi":
        return ["--hostfile", hostfile] if hostfile else ["--host", ",".join(hosts)]
    if flavour in ("mpich", "intel"):
        return ["-f", hostfile] if hostfile else ["-hosts", ",".join(hosts)]
    raise ConfigError(
        "--hosts/--hostfile: cannot tell how this mpiexec takes hosts (not Open MPI, MPICH or Intel MPI); "
        "pass them with --mpiexec-arg",
        setting="--hosts",
    )
