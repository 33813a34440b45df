#!/usr/bin/env bash
# Everything we check on the GPU test machine, in one run (logs under $OUT).
# Usage there: OUT=/some/dir bash tools/gpu_check.sh [study]
set -u -o pipefail
OUT=${OUT:-/tmp/mpsrun-gpu-check}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} MPSRUN_REQUIRE_GPU=1 PYTHONUNBUFFERED=1
if [ "${1:-}" = study ]; then
  python3 benchmarks/study.py "$OUT" "${@:2}" 2>&1 | tee "$OUT/study.log"
  exit $?
fi
{
  nvidia-smi -L; nvidia-smi --query-gpu=compute_mode,driver_version --format=csv
  command -v nvidia-cuda-mps-control mpiexec; mpiexec --version | head -2
} 2>&1 | tee "$OUT/machine.log"
python3 -m pytest -m gpu -v -s -p no:cacheprovider -o addopts="" --timeout 600 tests 2>&1 | tee "$OUT/gpu-tier.log"
gpu_rc=$?
python3 -m pytest -q -p no:cacheprovider -m "not gpu" tests 2>&1 | tail -5 | tee "$OUT/cpu-tiers.log"
{
  echo "== mpsrun -np 4 -v python3 examples/sim.py"; python3 -m mpsrun -np 4 -v python3 examples/sim.py; echo "rc=$?"
  echo "== --mps off"; python3 -m mpsrun -np 4 --mps off python3 examples/sim.py; echo "rc=$?"
  echo "== per-rank limits"; python3 -m mpsrun -np 2 -v --thread-percentage 25,75 python3 examples/per_rank_limits.py; echo "rc=$?"
  echo "== examples/pool.py"; python3 examples/pool.py; echo "rc=$?"
  echo "== leftover MPS processes:"; ps -eo pid,ppid,stat,cmd | grep -E "nvidia-cuda-mps" | grep -v grep || echo none
  echo "== leftover session dirs:"; ls -A /tmp/mpsrun-0 2>/dev/null || echo none
} 2>&1 | tee "$OUT/examples.log"
exit $gpu_rc
