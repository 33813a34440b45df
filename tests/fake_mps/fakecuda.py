"""A fake CUDA program for tests without a GPU.

``init()`` does what CUDA's first call does about MPS: it tries the control daemon
named by ``CUDA_MPS_PIPE_DIRECTORY`` (default /tmp/nvidia-mps) and, when none
answers, silently runs WITHOUT MPS, as real CUDA does. Either way it registers a
context on its GPU in the fake NVML (``$MPSRUN_FAKE_NVML/procs``), type "M+C" for an
MPS client and "C" otherwise, so mpsrun's checks see what NVML would show.

As a program: ``python fakecuda.py [--hold S] [--exit N] [--fault] [--report FILE]``
initialises (or not, for ``--no-cuda-rank``; in a child, for ``--in-child``), then "runs kernels" for S seconds (checking with the server between
kernels, like a real client's next CUDA call), then exits with N.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fake_mps_client import send

#: Device memory NVML lists for a context with nothing allocated, and for the MPS server (MiB, recorded on the H100,
#: driver 580: clients that held 0.5, 1, 1.5 and 2 GiB were listed with 1030, 1542, 2054 and 2566 MiB, the server with
#: 66). A fake client allocates 12 MiB unless told.
CONTEXT_MIB, SERVER_MIB, DEFAULT_ALLOC_MIB = 518, 66, 12


class Context:
    def __init__(self, device: int = 0, alloc_mib: int = DEFAULT_ALLOC_MIB) -> None:
        self.pid = os.getpid()
        self.pipe = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps")
        chosen = _visible_uuid(device)
        queues = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "2")
        reply = send(f"__client_connect {self.pid} {chosen} {queues}", self.pipe, timeout=5)
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
        nvml_dir = os.environ.get("MPSRUN_FAKE_NVML")
        if nvml_dir:
            entry = Path(nvml_dir, "procs", str(self.pid))
            entry.parent.mkdir(parents=True, exist_ok=True)
            entry.write_text(json.dumps({"uuid": self.uuid, "type": "M+C" if self.mps else "C",
                                         "mib": CONTEXT_MIB + alloc_mib}))
            atexit.register(entry.unlink, missing_ok=True)

    def kernel(self) -> None:
        """One 'kernel launch': an MPS client learns here that it was terminated or faulted."""
        if not self.mps:
            return
        # (a fake's kernel asks its daemon; a real one's runs on the server, a daemon's SIGSTOP notwithstanding)
        state = send(f"__client_poll {self.pid}", self.pipe, timeout=float(os.environ.get("FAKE_KERNEL_WAIT", "5")))
        if state == "terminated":
            raise SystemExit(_fail("cudaErrorMpsClientTerminated",
                                   "Returning 810 (CUDA_ERROR_MPS_CLIENT_TERMINATED) from cuCtxSynchronize_v2"))
        if state == "fault":
            raise SystemExit(_fail("cudaErrorIllegalAddress",
                                   "Returning 700 (CUDA_ERROR_ILLEGAL_ADDRESS) from cuCtxSynchronize_v2"))
        if state is None:
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
    gpus = json.loads(Path(nvml_dir, "gpus.json").read_text()) if nvml_dir else []
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


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hold", type=float, default=0.0, help="seconds of 'kernels' before exiting")
    parser.add_argument("--exit", type=int, default=0, help="exit code (for --fail-rank, or everyone)")
    parser.add_argument("--fail-rank", type=int, default=None, help="only this rank exits, at once, with --exit")
    parser.add_argument("--kill-rank", type=int, default=None, help="this rank SIGKILLs itself")
    parser.add_argument("--fault", action="store_true", help="trigger a fatal GPU fault")
    parser.add_argument("--fault-rank", type=int, default=None, help="this rank triggers a fatal GPU fault")
    parser.add_argument("--alloc", default=str(DEFAULT_ALLOC_MIB), help="device memory to hold, MiB: one value, or "
                        "one per rank (512,1024)")
    parser.add_argument("--report", help="write what this process saw to this JSON file")
    parser.add_argument("--report-dir", help="write <RANK>.json here")
    parser.add_argument("--no-cuda-rank", type=int, default=None, help="this rank never initialises CUDA")
    parser.add_argument("--device", default="0", help="the CUDA device to use: a number, local (LOCAL_RANK) or "
                        "local%%N (LOCAL_RANK modulo N), as codes that choose their own device do")
    parser.add_argument("--in-child", action="store_true", help="CUDA is used by a child process for --hold seconds")
    parser.add_argument("--until-file", default="", help="hold also until this file exists")
    parser.add_argument("--until-looks", type=int, default=0, help="hold also until NVML was asked this many times "
                        "for the GPU's processes (counted in $FAKE_NVML_LOOK_LOG) since this process's context began")
    args = parser.parse_args()
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
        if args.report:  # a path of the caller's (/dev/stdout, say): written as it is
            Path(report).write_text(json.dumps(info))
        else:  # whole when it appears in the directory: tests read a rank's report as soon as it does
            Path(f"{report}.tmp").write_text(json.dumps(info))
            os.replace(f"{report}.tmp", report)
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
