#!/usr/bin/env bash
# Issue 35 exploration, part 2 (GPU machine, after explore1). Logs to $OUT.
set -u
export PYTHONUNBUFFERED=1 MPSRUN_TMPDIR=/tmp/ms
mkdir -p /tmp/ms
LIB=$(bash tools/nccl_wheel.sh lib 2>/dev/null)
M="python3 -m mpsrun"
run() {  # label, then mpsrun args
  local label=$1; shift
  local start=$(python3 -c "import time;print(time.time())")
  "$@" > /tmp/o.run 2>&1; local rc=$?
  local wall=$(python3 -c "import time;print(round(time.time()-$start,2))")
  local res=$(grep -c '"right": true' /tmp/o.run)
  local secs=$(grep -o '"seconds": [0-9.]*' /tmp/o.run | awk '{print $2}' | sort -n | tail -1)
  echo "$label rc=$rc wall=$wall right=$res slowest=$secs"
  [ $rc -ne 0 ] && grep -vE "^\[?RESULT" /tmp/o.run | cut -c1-250 | tail -6
  rm -rf /tmp/ms/*
}
echo "== MAX_CTAS matrix under MPS (64 MiB x 20)"
for n in 2 4 8; do
  for c in 1 2 4 8 16 32; do
    run "n=$n ctas=$c" env NCCL_MULTI_RANK_GPU_ENABLE=1 NCCL_MAX_CTAS=$c $M -np $n --gpus 0 --mps on --timeout 40 \
      -x LD_PRELOAD=$LIB python3 examples/torch_allreduce.py (then benchmarks/allreduce_rank.py)
  done
done
echo "== without MPS (multi-rank only)"
for n in 2 4 8; do
  run "n=$n off" env NCCL_MULTI_RANK_GPU_ENABLE=1 $M -np $n --gpus 0 --mps off --timeout 60 -x LD_PRELOAD=$LIB \
    python3 examples/torch_allreduce.py (then benchmarks/allreduce_rank.py)
done
echo "== gloo under MPS"
run "n=4 gloo" $M -np 4 --gpus 0 --mps on --timeout 60 python3 examples/torch_allreduce.py (then benchmarks/allreduce_rank.py) --backend gloo
echo "== the failing case under Open MPI (mpiexec launcher), n=4, multi-rank only"
NCCL_MULTI_RANK_GPU_ENABLE=1 $M -np 4 --gpus 0 --mps on --launcher mpiexec --timeout 40 -v --keep-logs -x LD_PRELOAD=$LIB \
  python3 examples/torch_allreduce.py (then benchmarks/allreduce_rank.py) --iterations 5 > /tmp/o.mpi 2>&1; echo "rc=$?"
grep -vE "^RESULT" /tmp/o.mpi | cut -c1-250 | tail -30
for f in $(find /tmp/ms -type f -name '*log*' ! -name 'nccl*'); do echo "-- $f"; grep -v "^$" "$f" | tail -20; done
rm -rf /tmp/ms/*
echo "== DDP tutorial, unmodified, 4 ranks on GPU 0, NCCL 2.31 (LOCAL_RANK 1-3: expected invalid ordinal)"
cd .ext/ddp
NCCL_MULTI_RANK_GPU_ENABLE=1 NCCL_MAX_CTAS=2 python3 -m mpsrun -np 4 --gpus 0 --timeout 60 -x LD_PRELOAD=$LIB python3 multigpu_torchrun.py 2 1 2>&1 | grep -vE "Epoch" | cut -c1-200 | tail -8; echo "rc=$?"
echo "== with LOCAL_RANK forced 0 through a wrapper (would the script then run?)"
NCCL_MULTI_RANK_GPU_ENABLE=1 NCCL_MAX_CTAS=2 python3 -m mpsrun -np 4 --gpus 0 --timeout 90 -x LD_PRELOAD=$LIB env LOCAL_RANK=0 python3 multigpu_torchrun.py 2 1 2>&1 | cut -c1-200 | tail -8; echo "rc=$?"
ls -la snapshot.pt; rm -f snapshot.pt
cd ../..
echo "== leftovers"; ps -eo pid,stat,cmd | grep -E "nvidia-cuda-mps|mpsrun|allreduce" | grep -v grep || echo none
