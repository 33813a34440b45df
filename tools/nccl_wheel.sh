#!/usr/bin/env bash
# Carry NCCL's wheel (nvidia-nccl-cu13, ~250 MB) to the GPU test machine, which has no network and takes
# at most 64 MiB of working tree a call: split it here, carry one part a call while the machine stays warm,
# join it there. torch's own wheel ships NCCL 2.28, which refuses several ranks on one GPU; 2.30+ can.
#
# Here (in the repository's root; .nccl/ must be ignored: echo /.nccl/ >> .git/info/exclude):
#   bash tools/nccl_wheel.sh split [VERSION] [PART_MB]   download, split into .nccl/p1 .. .nccl/pN, print N
# There, one call per part, back to back (the machine goes back 30 s after a call), carry=[".nccl/pK"]:
#   bash tools/nccl_wheel.sh take K                      move part K out of the tree into /tmp/nccl-parts
# There, after the last part:
#   bash tools/nccl_wheel.sh join                        join, check the sha256, unpack into /tmp/nccl (the wheel too)
#   bash tools/nccl_wheel.sh lib                         print the unpacked libnccl.so.2 (for LD_PRELOAD)
set -euo pipefail
parts=/tmp/nccl-parts
unpacked=/tmp/nccl
case "${1:-}" in
  split)
    version=${2:-2.31.2}
    size=${3:-50}
    rm -rf .nccl && mkdir -p .nccl/wheel
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_18_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d .nccl/wheel "nvidia-nccl-cu13==$version"
    wheel=$(ls .nccl/wheel/*.whl)
    name=$(basename "$wheel")
    (cd .nccl/wheel && split -b "${size}M" -d -a 2 "$name" part.)
    count=0
    for piece in .nccl/wheel/part.*; do
      count=$((count + 1))
      mkdir -p ".nccl/p$count"
      mv "$piece" ".nccl/p$count/"
      (cd .nccl/wheel && sha256sum "$name") > ".nccl/p$count/SHA256"
    done
    rm "$wheel"
    rmdir .nccl/wheel
    echo "$count parts of $name in .nccl/p1 .. .nccl/p$count"
    ;;
  take)
    mkdir -p "$parts"
    mv ".nccl/p$2"/part.* "$parts/"
    cp ".nccl/p$2/SHA256" "$parts/SHA256"
    ls -l "$parts"
    ;;
  join)
    read -r sum name < "$parts/SHA256"
    cat "$parts"/part.* > "/tmp/$name"
    echo "$sum  /tmp/$name" | sha256sum -c -
    rm -rf "$unpacked" && mkdir -p "$unpacked"
    python3 -m zipfile -e "/tmp/$name" "$unpacked"
    mv "/tmp/$name" "$unpacked/"  # for pip install, where the library should replace torch's own
    rm -rf "$parts"
    ls "$unpacked"/nvidia/nccl/lib/libnccl.so.2
    ;;
  lib)
    ls "$unpacked"/nvidia/nccl/lib/libnccl.so.2
    ;;
  *)
    sed -n '2,14p' "$0"
    exit 2
    ;;
esac
