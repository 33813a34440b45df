#!/usr/bin/env bash
# Session B, part 2: the DDP benchmark, then whether pip's NCCL replaces torch's own. Logs to $OUT.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
LIB=$(bash tools/nccl_wheel.sh lib)
python3 benchmarks/ddp_shared_gpu.py --rounds ${ROUNDS:-3} --nccl $LIB --json $OUT/ddp.json 2>&1 | tee $OUT/ddp.log
echo "== pip install of NCCL 2.31 over torch's own (no LD_PRELOAD)"
python3 -m pip install -q --no-deps --no-index /tmp/nccl/*.whl 2>&1 | tail -2
python3 -m mpsrun -np 4 --gpus 0 --timeout 120 python3 examples/torch_allreduce.py --iterations 2 2>&1 | grep -E "RESULT|^mpsrun" | cut -c1-200
