#!/usr/bin/env bash
# Everything we check on the GPU test machine, in one run (logs under $OUT).
# Usage there: OUT=/some/dir bash tools/gpu_check.sh [tier|examples|bench|study] [pytest -k expression]
# With no argument: the GPU tier, the examples, then the benchmarks (thread percentage, frameworks under
# --mem-limit auto, start-up overhead, shared arrays). Wheels carried in .whl/ are installed first.
set -u -o pipefail
OUT=${OUT:-/tmp/mpsrun-gpu-check}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} MPSRUN_REQUIRE_GPU=1 PYTHONUNBUFFERED=1
what=${1:-all}
if [ "$what" = study ]; then
  python3 benchmarks/study.py "$OUT" "${@:2}" 2>&1 | tee "$OUT/study.log"
  exit $?
fi
{
  nvidia-smi -L; nvidia-smi --query-gpu=compute_mode,driver_version --format=csv
  command -v nvidia-cuda-mps-control mpiexec; mpiexec --version | head -2
  python3 -c "import psutil, mpi4py; print('psutil', psutil.__version__, 'mpi4py', mpi4py.__version__)"
} 2>&1 | tee "$OUT/machine.log"
rc=0
if [ "$what" = all ] || [ "$what" = tier ]; then
  python3 -m pytest -m gpu -v -p no:cacheprovider -o addopts="" --timeout 600 ${2:+-k "$2"} tests 2>&1 \
    | tee "$OUT/gpu-tier.log"
  rc=$?
fi
if [ "$what" = all ] || [ "$what" = examples ]; then
  {
    echo "== mpsrun -np 4 -v python3 examples/sim.py"; python3 -m mpsrun -np 4 -v python3 examples/sim.py; echo "rc=$?"
    echo "== --launcher mpiexec"; python3 -m mpsrun -np 4 -v --launcher mpiexec python3 examples/sim.py; echo "rc=$?"
    echo "== --mps off"; python3 -m mpsrun -np 4 --mps off python3 examples/sim.py; echo "rc=$?"
    echo "== per-rank limits"; python3 -m mpsrun -np 2 -v --thread-percentage 25,75 python3 examples/per_rank_limits.py
    echo "rc=$?"
    echo "== examples/pool.py"; python3 examples/pool.py; echo "rc=$?"
    echo "== examples/shared_table.py, 8 ranks"; python3 -m mpsrun -np 8 -v python3 examples/shared_table.py; echo "rc=$?"
    echo "== --gpu-bind none, 2 ranks on Device(local_rank)"
    python3 -m mpsrun -np 2 -v --gpu-bind none python3 -c \
      "import os, cupy; d = int(os.environ['LOCAL_RANK']) % cupy.cuda.runtime.getDeviceCount(); cupy.cuda.Device(d).use(); print('rank', os.environ['RANK'], 'on device', d, 'of', cupy.cuda.runtime.getDeviceCount(), float(cupy.ones(8).sum()))"
    echo "rc=$?"
    echo "== leftover MPS processes:"; ps -eo pid,ppid,stat,cmd | grep -E "nvidia-cuda-mps|mpsrun" | grep -v grep || echo none
    echo "== leftover session dirs:"; ls -A /tmp/mpsrun-0 2>/dev/null || echo none
  } 2>&1 | tee "$OUT/examples.log"
fi
if [ "$what" = all ] || [ "$what" = bench ]; then
  python3 benchmarks/atp_check.py --json "$OUT/atp.json" 2>&1 | tee "$OUT/atp.log"
  python3 benchmarks/frameworks.py --json "$OUT/frameworks.json" 2>&1 | tee "$OUT/frameworks.log"
  python3 benchmarks/overhead.py --repeats 5 --json "$OUT/overhead.json" 2>&1 | tee "$OUT/overhead.log"
  python3 benchmarks/shared_memory.py --json "$OUT/shared.json" 2>&1 | tee "$OUT/shared-bench.log"
fi
exit $rc
