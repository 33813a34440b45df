#!/usr/bin/env bash
# MPS started by a shell script, as a site's wrapper does it: the reference mpsrun's start-up is measured against
# (benchmarks/overhead.py). Its own pipe and log directories, the control daemon, a poll until it answers, the
# ranks (started here, or by mpiexec), then quit and wait for the daemon to be gone, and the directories removed.
#
#   bash benchmarks/mps_by_script.sh N local|mpiexec COMMAND [ARGS...]
#
# Under "mpiexec" the ranks are "$MPIEXEC" (default mpiexec) -n N COMMAND; add flags through MPIEXEC_FLAGS.
set -euo pipefail
n=$1 how=$2
shift 2
root=$(mktemp -d /tmp/mps-script.XXXXXX)
trap 'rm -rf "$root"' EXIT  # also when the daemon cannot start
export CUDA_MPS_PIPE_DIRECTORY=$root/pipe CUDA_MPS_LOG_DIRECTORY=$root/log
mkdir "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d
until echo get_server_list | nvidia-cuda-mps-control >/dev/null 2>&1; do sleep 0.002; done
daemon=$(cat "$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid")
status=0
if [ "$how" = mpiexec ]; then
  # shellcheck disable=SC2086  # the flags are words
  "${MPIEXEC:-mpiexec}" ${MPIEXEC_FLAGS:-} -n "$n" "$@" || status=$?
else
  pids=()
  for ((rank = 0; rank < n; rank++)); do
    RANK=$rank WORLD_SIZE=$n "$@" &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
fi
echo quit | nvidia-cuda-mps-control
while [ -e "/proc/$daemon" ] && [ "$(cut -d' ' -f3 "/proc/$daemon/stat" 2>/dev/null)" != Z ]; do sleep 0.002; done
rm -rf "$root"
exit "$status"
