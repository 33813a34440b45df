"""DistributedDataParallel training written as torchrun scripts are: LOCAL_RANK is the rank's CUDA device.

    mpsrun -np 2 --gpu-bind none python examples/ddp_train.py            # one rank per GPU, as under torchrun
    mpsrun -np 4 --local-rank device python examples/ddp_train.py        # four ranks sharing one GPU (NCCL >= 2.30)
    mpsrun -np 4 python examples/ddp_train.py --backend gloo --device 0  # any NCCL: gloo, device 0 of each rank

A small MLP (512-1024-1024-10) on synthetic data, ``--batch`` samples a rank a step. After ``--warmup`` steps each
rank times ``--steps`` more and prints one line, ``RESULT {json}``: its rank, samples a second, the last loss, and
whether every replica's weights are still the same (DDP's all-reduce kept them so).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="nccl", choices=("nccl", "gloo"))
    parser.add_argument("--device", type=int, default=None, help="the CUDA device (default: LOCAL_RANK)")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    args = parser.parse_args()
    device = int(os.environ["LOCAL_RANK"]) if args.device is None else args.device
    torch.cuda.set_device(device)
    dist.init_process_group(args.backend)
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same first weights in every replica (DDP also broadcasts rank 0's)
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    ddp = DistributedDataParallel(model.to(device), device_ids=[device])
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    generator = torch.Generator(device=f"cuda:{device}").manual_seed(rank)  # each rank its own data
    inputs = torch.randn(args.batch, 512, device=device, generator=generator)
    labels = torch.randint(0, 10, (args.batch,), device=device, generator=generator)

    def step() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(ddp(inputs), labels)
        loss.backward()
        optimizer.step()
        return loss

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    checksum = torch.stack([p.detach().double().sum() for p in model.parameters()]).sum().reshape(1)
    spread = checksum.clone()
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    lowest = checksum.clone()
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN)
    sys.stdout.write("RESULT " + json.dumps({"rank": rank, "world": dist.get_world_size(), "backend": args.backend,
                                "samples_per_s": round(args.batch * args.steps / seconds, 1),
                                "loss": round(float(loss), 4), "replicas_equal": bool(spread == lowest)}) + "\n")
    sys.stdout.flush()  # one write a line: ranks share the job's output
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
