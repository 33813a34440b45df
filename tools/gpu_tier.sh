#!/usr/bin/env bash
# The GPU tier in parts that each fit one call to the GPU machine, and carry NCCL's wheel along (tools/nccl_wheel.sh):
# part K (1-5) first moves .nccl/pK out of the tree (when carried), part 5 joins the wheel and runs the tests that need
# NCCL 2.30+. Logs go to $OUT/tier-K.log. Usage there: OUT=DIR bash tools/gpu_tier.sh K
#   1: the contract, faults, sessions and gates, 4 workers taking tests one at a time (each job has its own
#      daemons; nothing there times or counts what other jobs do)
#   2: launch, shared arrays, binding and memory, each rank's account and top, the bench, fidelity, docs,
#      environment, one at a time (they read the GPU's free memory and every process of the machine)
#   3: farms, failure words, whole output lines
#   4: frameworks      5: PyTorch's environment with NCCL 2.30+
set -u -o pipefail
part=$1
OUT=${OUT:-/tmp/mpsrun-gpu-tier}
mkdir -p "$OUT"
[ -d ".nccl/p$part" ] && bash tools/nccl_wheel.sh take "$part" >/dev/null
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 MPSRUN_REQUIRE_GPU=1
python3 -m compileall -q mpsrun tests examples benchmarks
run() { python3 -m pytest -m gpu -v -p no:cacheprovider -o addopts="" --timeout 300 "$@" 2>&1 | tee -a "$OUT/tier-$part.log"; }
case "$part" in
  1) { nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,compute_mode --format=csv; } > "$OUT/machine.log"
     run -n 4 --dist load tests/test_gpu_contract.py tests/test_gpu_faults.py tests/test_gpu_session.py \
       tests/test_gpu_gate.py ;;
  2) run tests/test_gpu_launch.py tests/test_gpu_shared.py tests/test_gpu_bind_memory.py tests/test_gpu_account.py \
       tests/test_bench.py \
       tests/test_fake_fidelity.py tests/test_docs.py tests/test_environment.py ;;
  3) run tests/test_gpu_farm.py tests/test_failure_words.py tests/test_output_lines.py ;;
  4) run tests/test_frameworks.py ;;
  5) bash tools/nccl_wheel.sh join > "$OUT/nccl-join.log" 2>&1
     MPSRUN_TEST_NCCL_LIB=$(bash tools/nccl_wheel.sh lib) run tests/test_torch_environment.py ;;
esac
rc=${rc:-$?}
{ echo "== leftovers after part $part"; ps -eo pid,stat,cmd | grep -E "nvidia-cuda-mps|mpsrun" | grep -v grep
  ls -A /tmp/mpsrun-0 2>/dev/null; } >> "$OUT/tier-$part.log"
exit "$rc"
