"""A fake CUDA program for tests without a GPU.

``init()`` does what CUDA's first call does about MPS: it tries the control daemon
named by ``CUDA_MPS_PIPE_DIRECTORY`` (default /tmp/nvidia-mps) and, when none
answers, silently runs WITHOUT MPS, as real CUDA does. Either way it registers a
context on its GPU in the fake NVML (``$MPSRUN_FAKE_NVML/procs``), type "M+C" for an
MPS client and "C" otherwise, so mpsrun's checks see what NVML would show.

As a program: ``python fakecuda.py [--hold S] [--exit N] [--fault] [--report FILE]``
initialises (or not, for ``--no-cuda-rank``; in a child, for ``--in-child``), then "runs kernels" for S seconds (checking with the server between
kernels, like a real client's next CUDA call, on the connection it keeps to its daemon), then exits with N.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fake_mps_client import attach, send

#: Device memory NVML lists for a context with nothing allocated, and for the MPS server (MiB, recorded on the H100,
#: driver 580: clients that held 0.5, 1, 1.5 and 2 GiB were listed with 1030, 1542, 2054 and 2566 MiB, the server with
#: 66). A fake client allocates 12 MiB unless told.
CONTEXT_MIB, SERVER_MIB, DEFAULT_ALLOC_MIB = 518, 66, 12


class Context:
    def __init__(self, device: int = 0, alloc_mib: int = DEFAULT_ALLOC_MIB) -> None:
        self.pid = os.getpid()
        self.pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps"
        chosen = _visible_uuid(device)
        queues = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "2")
        reply, self.connection, self.news = attach(f"__client_attach {self.pid} {chosen} {queues}", self.pipe, 5)
        if reply is not None and reply.startswith("noqueues"):  # as measured on the H100, at cudaSetDevice
            raise SystemExit(_fail("cudaErrorMemoryAllocation: out of memory"))
        if reply is not None and reply.startswith("busy"):
            raise SystemExit(_fail("cudaErrorDevicesUnavailable: CUDA-capable device(s) is/are busy or unavailable"))
        if reply is not None and reply.startswith("nodevice"):
            raise SystemExit(_fail("cudaErrorInvalidDevice: invalid device ordinal"))
        if reply is not None and reply.startswith("ok"):
            _, server, uuid = reply.split()
            self.mps, self.server, self.uuid = True, int(server), uuid
        else:
            self.mps, self.server, self.uuid = False, 0, chosen
            if self.connection is not None:
                self.connection.close()
        nvml_dir = os.environ.get("MPSRUN_FAKE_NVML")
        if nvml_dir:
            entry = os.path.join(nvml_dir, "procs", str(self.pid))
            os.makedirs(os.path.dirname(entry), exist_ok=True)
            with open(entry, "w") as stream:
                stream.write(json.dumps({"uuid": self.uuid, "type": "M+C" if self.mps else "C",
                                         "mib": CONTEXT_MIB + alloc_mib}))
            atexit.register(_remove, entry)

    def kernel(self) -> None:
        """One 'kernel launch': an MPS client learns here that it was terminated or faulted, from what its daemon
        sent on the client's connection (a real client hears from its server, which a stopped daemon does not stop)."""
        if not self.mps:
            return
        assert self.connection is not None
        try:
            chunk = self.connection.recv(64)
        except BlockingIOError:
            chunk = None
        if chunk is not None:
            self.news += chunk or b"gone\n"  # an end of the connection: the daemon is gone
        state = self.news.partition(b"\n")[0] if b"\n" in self.news else b""
        if state == b"terminated":
            raise SystemExit(_fail("cudaErrorMpsClientTerminated",
                                   "Returning 810 (CUDA_ERROR_MPS_CLIENT_TERMINATED) from cuCtxSynchronize_v2"))
        if state == b"fault":
            raise SystemExit(_fail("cudaErrorIllegalAddress",
                                   "Returning 700 (CUDA_ERROR_ILLEGAL_ADDRESS) from cuCtxSynchronize_v2"))
        if state:
            raise SystemExit(_fail("cudaErrorMpsRpcFailure",
                                   "Returning 806 (CUDA_ERROR_MPS_RPC_FAILURE) from cuCtxSynchronize_v2"))

    def fault(self) -> None:
        send(f"__client_fault {self.pid}", self.pipe, timeout=5)
        raise SystemExit(_fail("cudaErrorIllegalAddress",
                               "Returning 700 (CUDA_ERROR_ILLEGAL_ADDRESS) from cuCtxSynchronize_v2"))


def _fail(error: str, logged: str = "") -> int:
    """Say a CUDA error as a program does, and write CUDA's own line for it where CUDA_LOG_FILE says, as CUDA 12.9
    and later do (lines recorded on an H100, driver 580)."""
    if logged and os.environ.get("CUDA_LOG_FILE"):
        stamp = time.strftime("%H:%M:%S.000")
        with open(os.environ["CUDA_LOG_FILE"], "a") as log:
            log.write(f"[{stamp}][{os.getpid()}][CUDA][E] No CUDA context is current to the calling thread\n"
                      f"[{stamp}][{os.getpid()}][CUDA][E] Returning 201 (CUDA_ERROR_INVALID_CONTEXT) from "
                      f"cuCtxGetDevice_v2\n[{stamp}][{os.getpid()}][CUDA][E] {logged}\n")
    print(f"CUDA error: {error}", file=sys.stderr, flush=True)
    return 1


def _visible_uuid(device: int = 0) -> str:
    """The UUID of CUDA device ``device`` as this process numbers them (CUDA_VISIBLE_DEVICES, else every GPU)."""
    nvml_dir = os.environ.get("MPSRUN_FAKE_NVML")
    gpus = []
    if nvml_dir:
        with open(os.path.join(nvml_dir, "gpus.json")) as stream:
            gpus = json.load(stream)
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = [v.strip() for v in value.split(",")] if value else [str(i) for i in range(max(1, len(gpus)))]
    if device >= len(visible):
        raise SystemExit(_fail("cudaErrorInvalidDevice: invalid device ordinal",
                               f"Invalid device number {device} provided, must be in the range of 0 to "
                               f"{len(visible) - 1}"))
    if visible[device].startswith("GPU-"):
        return visible[device]
    index = int(visible[device]) if visible[device].isdigit() else 0
    return gpus[index]["uuid"] if index < len(gpus) else "GPU-none"


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _lines(path: str) -> int:
    try:
        with open(path) as log:
            return sum(1 for _ in log)
    except OSError:
        return 0


def init(device: int = 0, alloc_mib: int = DEFAULT_ALLOC_MIB) -> Context:
    return Context(device, alloc_mib)


def _mine(values: str, rank: int) -> int:
    """This rank's item of a list given per rank (or the one value)."""
    items = values.split(",")
    return int(items[rank] if len(items) > 1 else items[0])


def _device(choice: str) -> int:
    """``N``, ``local`` (LOCAL_RANK) or ``local%N`` (LOCAL_RANK modulo N), as codes that pick their device do."""
    if not choice.startswith("local"):
        return int(choice)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    return local % int(choice[6:]) if choice.startswith("local%") else local


#: The program's options: each one's type (None: a flag) and default. Parsed by hand: argparse (and pathlib) were
#: most of a fake rank's start, and the suite starts thousands of them.
OPTIONS: dict[str, tuple[type | None, object]] = {
    "--hold": (float, 0.0),  # seconds of 'kernels' before exiting
    "--exit": (int, 0),  # exit code (for --fail-rank, or everyone)
    "--fail-rank": (int, None),  # only this rank exits, at once, with --exit
    "--kill-rank": (int, None),  # this rank SIGKILLs itself
    "--fault": (None, False),  # trigger a fatal GPU fault
    "--fault-rank": (int, None),  # this rank triggers a fatal GPU fault
    "--alloc": (str, str(DEFAULT_ALLOC_MIB)),  # device memory to hold, MiB: one value, or one per rank (512,1024)
    "--report": (str, None),  # write what this process saw to this JSON file
    "--report-dir": (str, None),  # write <RANK>.json here
    "--no-cuda-rank": (int, None),  # this rank never initialises CUDA
    "--device": (str, "0"),  # a number, local (LOCAL_RANK) or local%N (LOCAL_RANK modulo N), as codes choose
    "--in-child": (None, False),  # CUDA is used by a child process for --hold seconds
    "--until-file": (str, ""),  # hold also until this file exists
    "--until-looks": (int, 0),  # hold also until NVML was asked this many times for the GPU's processes (counted
    # in $FAKE_NVML_LOOK_LOG) since this process's context began
}


def parse_options(argv: list[str]) -> SimpleNamespace:
    """``--name value``, ``--name=value`` and flags, as OPTIONS declares them."""
    found = {name[2:].replace("-", "_"): default for name, (_, default) in OPTIONS.items()}
    words = iter(argv)
    for word in words:
        name, equals, given = word.partition("=")
        if name not in OPTIONS:
            raise SystemExit(f"fakecuda: unknown option {word!r}")
        kind = OPTIONS[name][0]
        found[name[2:].replace("-", "_")] = True if kind is None else kind(given if equals else next(words))
    return SimpleNamespace(**found)


def main() -> int:
    args = parse_options(sys.argv[1:])
    rank = int(os.environ.get("RANK", "0"))
    if args.no_cuda_rank == rank:
        return 0
    if args.in_child:
        child = os.fork()
        if child == 0:
            init()
            time.sleep(args.hold)
            raise SystemExit(0)  # runs the child's atexit (its fake NVML entry goes)
        return os.waitpid(child, 0)[1] and 1
    ctx = init(_device(args.device), _mine(args.alloc, rank))
    report = args.report or (args.report_dir and os.path.join(args.report_dir, f"{rank}.json"))
    if report:
        info = {"pid": ctx.pid, "mps": ctx.mps, "server": ctx.server, "uuid": ctx.uuid, "daemon": str(ctx.pipe),
                "env": {k: v for k, v in os.environ.items()
                        if k.startswith(("CUDA_", "MPSRUN_")) or k in ("RANK", "LOCAL_RANK", "WORLD_SIZE",
                                                                        "LOCAL_WORLD_SIZE")}}
        with open(report if args.report else f"{report}.tmp", "w") as stream:
            stream.write(json.dumps(info))
        if not args.report:  # whole when it appears in the directory: tests read a rank's report as soon as it does
            os.replace(f"{report}.tmp", report)  # (a path of the caller's, /dev/stdout say, is written as it is)
    if args.fault or args.fault_rank == rank:
        if args.fault_rank is not None and args.report_dir:  # every rank a client first, with work in flight
            _wait_for_reports(args.report_dir, int(os.environ.get("WORLD_SIZE", "1")))
        ctx.fault()
    if args.kill_rank == rank:
        os.kill(os.getpid(), 9)
    if args.fail_rank == rank:
        if args.report_dir:  # every rank a client first, so that the others have something to be detached from
            _wait_for_reports(args.report_dir, int(os.environ.get("WORLD_SIZE", "1")))
        ctx.kernel()
        return args.exit
    end = time.monotonic() + args.hold
    looks = os.environ.get("FAKE_NVML_LOOK_LOG", "")
    seen_before = _lines(looks)
    while True:
        ctx.kernel()
        waited = (_lines(looks) - seen_before >= args.until_looks
                  and (not args.until_file or os.path.exists(args.until_file)))
        if time.monotonic() >= end and (waited or time.monotonic() >= end + 30):
            break
        time.sleep(0.02)
    if args.fail_rank is None or args.fail_rank == rank:
        return args.exit
    return 0


def _wait_for_reports(directory: str, count: int, timeout: float = 60.0) -> None:
    """Until ``count`` ranks have written their report to ``directory`` (each is a client by then)."""
    end = time.monotonic() + timeout
    while len([name for name in os.listdir(directory) if name.endswith(".json")]) < count:
        if time.monotonic() > end:
            raise SystemExit(f"fakecuda: fewer than {count} reports in {directory} after {timeout:g} s")
        time.sleep(0.02)


if __name__ == "__main__":
    sys.exit(main())
