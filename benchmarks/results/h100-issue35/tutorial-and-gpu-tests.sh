#!/usr/bin/env bash
# Session B, part 1: probes, the unmodified tutorial, the new GPU tests. Logs to $OUT.
set -u
export PYTHONUNBUFFERED=1 MPSRUN_TMPDIR=/tmp/ms PYTHONPATH=$PWD
mkdir -p /tmp/ms
python3 -m compileall -q mpsrun examples benchmarks tests
LIB=$(bash tools/nccl_wheel.sh lib)
export MPSRUN_TEST_NCCL_LIB=$LIB
M="python3 -m mpsrun"
echo "== NVML cores and compute capability, torch's SM count"
python3 -c "
import pynvml, torch; pynvml.nvmlInit(); h = pynvml.nvmlDeviceGetHandleByIndex(0)
print('cores', pynvml.nvmlDeviceGetNumGpuCores(h), 'cc', pynvml.nvmlDeviceGetCudaComputeCapability(h), 'torch SMs', torch.cuda.get_device_properties(0).multi_processor_count)
from mpsrun.mps import gpus; print(gpus.list_gpus()[0])"
echo "== NCCL 2.31 told not to share (caller sets NCCL_MULTI_RANK_GPU_ENABLE=0)"
NCCL_MULTI_RANK_GPU_ENABLE=0 $M -np 2 --gpus 0 --keep-logs --timeout 60 -x LD_PRELOAD=$LIB python3 examples/torch_allreduce.py --iterations 1 2>&1 | grep "^mpsrun"; echo "rc=${PIPESTATUS[0]}"
for f in $(find /tmp/ms -name 'nccl.*'); do echo "-- $f"; cat "$f"; done; rm -rf /tmp/ms/*
echo "== the variables a sharing rank gets (4 ranks, -v)"
$M -np 4 --gpus 0 -v python3 -c "import os; print(os.environ['RANK'], *(f'{k}={v}' for k, v in sorted(os.environ.items()) if k.startswith(('NCCL_', 'GROUP_', 'ROLE_', 'TORCHELASTIC_', 'CUDA_LOG'))))" 2>&1 | sort | head -12
cd .ext/ddp
echo "== the DDP tutorial, unmodified, 4 ranks on GPU 0, defaults, NCCL 2.31 (expected: the one line)"
$M -np 4 --gpus 0 --timeout 120 -x LD_PRELOAD=$LIB python3 multigpu_torchrun.py 2 1 2>&1 | grep "^mpsrun"; echo "rc=${PIPESTATUS[0]}"
echo "== the same with --local-rank device"
$M -np 4 --gpus 0 --local-rank device --timeout 120 -x LD_PRELOAD=$LIB python3 multigpu_torchrun.py 2 1 2>&1 | tail -3; echo "rc=${PIPESTATUS[0]}"; ls -la snapshot.pt; rm -f snapshot.pt
echo "== the same with torch's NCCL 2.28 (expected: the one line)"
$M -np 4 --gpus 0 --local-rank device --timeout 120 python3 multigpu_torchrun.py 2 1 2>&1 | grep "^mpsrun"; echo "rc=${PIPESTATUS[0]}"
cd ../..
echo "== GPU tests of issue 35"
python3 -m pytest -m gpu -v -p no:cacheprovider -o addopts="" --timeout 600 tests/test_torch_environment.py tests/test_failure_words.py tests/test_frameworks.py 2>&1 | tee $OUT/gpu-35.log | grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed|^E " | head -60
echo "== leftovers"; ps -eo pid,stat,cmd | grep -E "nvidia-cuda-mps|mpsrun" | grep -v grep || echo none
