#!/usr/bin/env bash
# Issue 35 exploration, part 1 (GPU machine). Logs to $OUT.
set -u
export PYTHONUNBUFFERED=1 MPSRUN_TMPDIR=/tmp/ms
mkdir -p /tmp/ms
python3 -m compileall -q mpsrun benchmarks
nvidia-smi -L
U=$(nvidia-smi --query-gpu=uuid --format=csv,noheader | head -1)
LIB=$(bash tools/nccl_wheel.sh lib 2>/dev/null)
echo "LIB=$LIB"
M="python3 -m mpsrun"
echo "== E2 duplicate visibility"
for v in "0,0" "0,$U" "$U,${U:0:12}" "${U:0:12},$U" "$U"; do
  echo "CVD=$v: $(CUDA_VISIBLE_DEVICES=$v python3 -c 'import torch;print(torch.cuda.device_count())' 2>&1 | tail -1)"
done
echo "== E1 CUDA_LOG_FILE"
CUDA_VISIBLE_DEVICES=$U CUDA_LOG_FILE=/tmp/l1.log python3 -c "import torch; torch.cuda.set_device(1)" 2>&1 | tail -1
echo "-- torch set_device(1) log:"; cat /tmp/l1.log
CUDA_VISIBLE_DEVICES=$U CUDA_LOG_FILE=/tmp/l2.log python3 -c "import torch; torch.zeros(1, device='cuda:1')" 2>&1 | tail -1
echo "-- torch zeros cuda:1 log:"; cat /tmp/l2.log
CUDA_VISIBLE_DEVICES=$U CUDA_LOG_FILE=/tmp/l3.log python3 -c "import cupy; cupy.cuda.Device(1).use(); cupy.ones(1)" 2>&1 | tail -1
echo "-- cupy Device(1) log:"; cat /tmp/l3.log
CUDA_VISIBLE_DEVICES=$U CUDA_LOG_FILE=/tmp/l4.%p.log python3 -c "import torch; torch.cuda.set_device(1)" 2>&1 | tail -1
echo "-- %p:"; ls /tmp/l4* 2>&1
CUDA_LOG_FILE=/tmp/l0.log python3 -c "import torch; x=torch.ones(4,device='cuda'); print(float(x.sum()))"
echo "-- a clean run's log (exists? size):"; ls -la /tmp/l0.log 2>&1; cat /tmp/l0.log 2>/dev/null
echo "== E1b under mpsrun (MPS): 2 ranks set_device(LOCAL_RANK)"
CUDA_LOG_FILE=/tmp/l5.log $M -np 2 --mps on --launcher local python3 -c "import os,torch; torch.cuda.set_device(int(os.environ['LOCAL_RANK'])); print(torch.zeros(1).cuda())"; echo "rc=$?"
echo "-- log:"; cat /tmp/l5.log
echo "== E1c out of memory under a pinned limit"
CUDA_LOG_FILE=/tmp/l6.log $M -np 1 --mps on --mem-limit 2G python3 -c "import torch; x=torch.empty(3<<30, dtype=torch.uint8, device='cuda')" 2>&1 | tail -2; echo "rc=$?"
echo "-- log:"; cat /tmp/l6.log
echo "== E1d terminate_client (mpsrun --timeout on a busy rank)"
CUDA_LOG_FILE=/tmp/l7.log $M -np 1 --mps on --timeout 8 python3 -c "
import torch,time
x=torch.ones(2000,2000,device='cuda'); torch.cuda.synchronize(); print('busy',flush=True)
while True:
    y=x@x
    torch.cuda.synchronize()
" 2>&1 | tail -4; echo "rc=$?"
echo "-- log:"; cat /tmp/l7.log
echo "== E3 NCCL 2.28 (torch's own), 2 ranks on GPU 0"
rm -rf /tmp/ms/*
$M -np 2 --gpus 0 --mps on --keep-logs python3 examples/torch_allreduce.py (then benchmarks/allreduce_rank.py) --iterations 2 2>&1 | tail -5; echo "rc=$?"
for f in $(find /tmp/ms -name 'nccl.*'); do echo "-- $f"; cat "$f"; done
rm -rf /tmp/ms/*
echo "== E4 NCCL 2.31, MULTI_RANK only, under MPS (local launcher)"
for n in 2 3 4 8; do
  echo "--- n=$n"
  start=$(date +%s.%N)
  NCCL_MULTI_RANK_GPU_ENABLE=1 $M -np $n --gpus 0 --mps on --keep-logs --timeout 40 -v -x LD_PRELOAD=$LIB \
    python3 examples/torch_allreduce.py (then benchmarks/allreduce_rank.py) --iterations 5 > /tmp/o.$n 2>&1
  echo "rc=$? wall=$(echo "$(date +%s.%N) - $start" | bc 2>/dev/null || python3 -c "import time;print(time.time()-$start)")"
  grep -E "RESULT|mpsrun|Error|error|terminated" /tmp/o.$n | cut -c1-300 | head -30
  for f in $(find /tmp/ms -name 'nccl.*'); do echo "-- $f"; head -20 "$f"; done
  for f in $(find /tmp/ms -name '*.log' -path '*gpu*' -o -name 'daemon*' -o -name '*control*log'); do :; done
  find /tmp/ms -type f | head -20
  for f in $(find /tmp/ms -type f -name '*log*' ! -name 'nccl*'); do echo "-- $f"; grep -v "^$" "$f" | tail -25; done
  rm -rf /tmp/ms/*
done
echo "== leftovers"; ps -eo pid,stat,cmd | grep -E "nvidia-cuda-mps|mpsrun|allreduce" | grep -v grep || echo none
