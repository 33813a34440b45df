#!/usr/bin/env bash
# A capture of `mpsrun top`'s live view on the GPU machine (issue 38): tmux runs top in a 150x24 terminal while a
# 4-rank CuPy job holds 0.5, 1, 1.5 and 2 GiB on GPU 0; the pane is captured as text to $OUT/top-live.txt.
# Usage there: OUT=DIR bash tools/top_capture.sh
set -u -o pipefail
OUT=${OUT:-/tmp/mpsrun-top-capture}
mkdir -p "$OUT"
command -v tmux > /dev/null || { echo "no tmux on this machine" > "$OUT/top-live.txt"; exit 3; }
export PYTHONPATH=$PWD
held=$(mktemp -d)
python3 -m mpsrun -np 4 --gpus 0 --mps on --launcher local --thread-percentage auto python3 -c "
import os, time, cupy
held = cupy.zeros(int('512,1024,1536,2048'.split(',')[int(os.environ['RANK'])]) << 20, dtype=cupy.uint8)
x = cupy.random.rand(2048, 2048, dtype=cupy.float32)
open(os.path.join('$held', os.environ['RANK']), 'w').close()
while not os.path.exists(os.path.join('$held', 'go')):
    x = x @ x; x /= x.max(); cupy.cuda.Device().synchronize()
" > "$OUT/top-capture-job.log" 2>&1 &
job=$!
for _ in $(seq 1 600); do [ "$(ls "$held" | wc -l)" -ge 4 ] && break; sleep 0.1; done
tmux new-session -d -s mpsrun-top -x 150 -y 24 "python3 -m mpsrun top"
sleep 4
tmux capture-pane -p -t mpsrun-top > "$OUT/top-live.txt"
tmux send-keys -t mpsrun-top q
touch "$held/go"
wait "$job"
echo "job exit $?" >> "$OUT/top-capture-job.log"
tmux kill-session -t mpsrun-top 2> /dev/null
rm -rf "$held"
