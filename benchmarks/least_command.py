"""The least Python command that runs a job under MPS through mpiexec: the floor of ``mpsrun --launcher mpiexec``.

    python3 [-S] benchmarks/least_command.py MPIEXEC [FLAGS...] -n N -- COMMAND [ARGS...]

What any such command must do, and nothing more: its own pipe and log directories; the control daemon started
(``nvidia-cuda-mps-control -d``) and, without waiting for it, mpiexec with every rank under
benchmarks/least_supervisor.py, which starts its rank once the daemon's control socket is there; then ``quit``, the
daemon's end, the directories removed. As mpsrun does, the daemon comes up while mpiexec starts its ranks. The exit
code is mpiexec's. benchmarks/overhead.py runs it as ``least command`` (with ``site``, as an installed command
starts) and ``least command -S``.
"""

import os
import shutil
import subprocess
import sys
import time

CONTROL = "nvidia-cuda-mps-control"
SUPERVISOR = [sys.executable, "-S", os.path.join(os.path.dirname(os.path.abspath(__file__)), "least_supervisor.py"),
              "--wait-for-daemon"]


def gone(pid: int) -> bool:
    """Whether ``pid`` has exited (a daemonized process may stay a zombie: init need not reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def main() -> int:
    split = sys.argv.index("--")
    launcher, command = sys.argv[1:split], sys.argv[split + 1:]
    root = f"/tmp/least-command-{os.getpid()}"
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": f"{root}/pipe", "CUDA_MPS_LOG_DIRECTORY": f"{root}/log"}
    for path in (root, f"{root}/pipe", f"{root}/log"):
        os.mkdir(path, 0o700)
    try:
        starting = subprocess.Popen([CONTROL, "-d"], env=env)  # it returns once the daemon has forked off: meanwhile,
        code = subprocess.run([*launcher, *SUPERVISOR, *command], env=env).returncode  # mpiexec starts the ranks
        if starting.wait() != 0:
            raise SystemExit(f"{CONTROL} -d failed")
        with open(f"{root}/pipe/{CONTROL}.pid") as pid_file:
            daemon = int(pid_file.read())
        subprocess.run([CONTROL], input=b"quit\n", env=env, stdout=subprocess.DEVNULL, check=True)
        deadline = time.monotonic() + 10
        while not gone(daemon) and time.monotonic() < deadline:
            time.sleep(0.002)
    finally:
        shutil.rmtree(root)
    return code


if __name__ == "__main__":
    sys.exit(main())
