"""One rank of a ``torch.distributed`` all-reduce of a CUDA tensor: is it right, and how long does it take.

    mpsrun -np 4 python examples/torch_allreduce.py [--backend nccl|gloo] [--mib 64] [--iterations 20]

Each rank fills a tensor with ``rank + 1``, all-reduces it (the sum is known), then times ``--iterations`` more
all-reduces between barriers, and prints one line: ``RESULT {json}`` with its rank, whether the sum was right, the
seconds, and the NCCL it loaded (read from the library mapped into this process: ``torch.cuda.nccl.version()``
says the version torch was built with, not the one ``LD_PRELOAD`` put in its place).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time

import torch
import torch.distributed as dist


def loaded_nccl() -> str | None:
    """The version of the NCCL this process's calls go to, as NCCL itself reports it (None: none loaded). A preloaded
    library is first in the global scope, where torch's calls are bound, though torch's own is mapped too."""
    try:
        get_version = ctypes.CDLL(None).ncclGetVersion
    except AttributeError:  # torch's own only, loaded where a global lookup does not see it
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "libnccl" in line and line.split()[-1][:1] == "/"})
        if not paths:
            return None
        get_version = ctypes.CDLL(paths[0]).ncclGetVersion
    version = ctypes.c_int()
    if get_version(ctypes.byref(version)) != 0:
        return None
    code = version.value  # 2.31.2 is 23102 (since 2.9: major * 10000 + minor * 100 + patch)
    return f"{code // 10000}.{code // 100 % 100}.{code % 100}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="nccl", choices=("nccl", "gloo"))
    parser.add_argument("--mib", type=float, default=64.0)
    parser.add_argument("--iterations", type=int, default=20)
    args = parser.parse_args()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    torch.cuda.set_device(device)
    dist.init_process_group(args.backend, device_id=device if args.backend == "nccl" else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    values = torch.full((int(args.mib * 2**20) // 4,), float(rank + 1), device=device)
    dist.all_reduce(values)
    right = bool((values == world * (world + 1) / 2).all())
    dist.barrier()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.iterations):
        dist.all_reduce(values)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    dist.barrier()
    sys.stdout.write("RESULT " + json.dumps({"rank": rank, "world": world, "right": right, "seconds": round(seconds, 4),
                                "backend": args.backend, "nccl": loaded_nccl(), "device": str(device)}) + "\n")
    sys.stdout.flush()  # one write a line: ranks share the job's output
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
