#!/bin/bash
# mpsrun tune on a GPU machine (docs/benchmarks.md, "`mpsrun tune` on the H100"): calibrate each workload, tune it
# and run its recommendation three times.   OUT=DIR bash benchmarks/tune_h100.sh small fill montecarlo
# montecarlo needs CuPy's examples/finance/monte_carlo.py and black_scholes.py (not part of this repository) in
# $CUPY_FINANCE (default: _ab/cupy_finance).
set -u
export PYTHONPATH=$PWD
exec > >(tee -a "$OUT/tune.log") 2>&1
date; nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv
python3 -c "import cupy, sys; print('python', sys.version.split()[0], 'cupy', cupy.__version__)"
K=$PWD/benchmarks/tune_kernels.py; B=$PWD/benchmarks/tune_check.py; MC=${CUPY_FINANCE:-$PWD/_ab/cupy_finance}/monte_carlo.py
MC_ARGS="--n-options 8 --n-threads-per-option 1024"
run() { local name=$1; shift; echo "=== $name: $*"; timeout 280 python3 $B "$OUT/tune-$name.json" "$@"; echo "=== $name exit $?"; }
for w in "$@"; do
  case $w in
    small)
      L=$(python3 $K small --calibrate 1.0); echo "calibrated: small --launches $L (about 1 s alone)"
      python3 $K small --launches $L
      run small --ranks 1,2,4,8 --repeats 3 --budget 200 -- python3 $K small --launches $L ;;
    fill)
      L=$(python3 $K fill --calibrate 2.0); echo "calibrated: fill --launches $L (about 2 s alone), split over the ranks"
      python3 $K fill --launches $L
      run fill --ranks 1,2,4,8 --repeats 3 --budget 200 --scaling strong -- python3 $K fill --launches $L --split ;;
    montecarlo)
      python3 $MC $MC_ARGS --n-samples-per-thread 1000 > /dev/null  # compiles the kernels once (cached)
      T=$(python3 $MC $MC_ARGS --n-samples-per-thread 100000 | sed -n 's/.*Monte Carlo method):\t\(.*\) sec/\1/p')
      N=$(python3 -c "print(max(1000, int(100000 * 1.0 / $T)))")
      echo "monte_carlo: 100000 samples/thread took $T s alone; using $N"
      python3 $MC $MC_ARGS --n-samples-per-thread $N
      run montecarlo --ranks 1,2,4,8 --repeats 3 --budget 170 -- python3 $MC $MC_ARGS --n-samples-per-thread $N ;;
  esac
done
echo "left under /tmp: $(ls /tmp | grep -c mpsrun)"; date
