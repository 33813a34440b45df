#!/usr/bin/env bash
# Start a one-node Slurm cluster (munged, slurmctld, slurmd) for the tests; prints the slurm.conf path.
# Usage: ci/slurm/start.sh DIR    (stop it with ci/slurm/stop.sh DIR)
set -euo pipefail
dir=$(realpath "$1")
here=$(dirname "$(realpath "$0")")
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null || ! command -v sbatch >/dev/null; then
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmctld slurmd slurm-client munge >/dev/null
fi
mkdir -p "$dir/state" "$dir/spool"
host=$(hostname -s)
sed -e "s|@HOST@|$host|g" -e "s|@DIR@|$dir|g" -e "s|@CPUS@|$(nproc)|g" \
    -e "s|@PORT@|${SLURMCTLD_PORT:-16817}|g" -e "s|@DPORT@|${SLURMD_PORT:-16818}|g" \
    "$here/slurm.conf.in" > "$dir/slurm.conf"
if [ ! -s /etc/munge/munge.key ]; then
  mkdir -p /etc/munge
  dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  chown munge:munge /etc/munge/munge.key
  chmod 0400 /etc/munge/munge.key
fi
mkdir -p /run/munge /var/log/munge /var/lib/munge
chown munge:munge /run/munge /var/log/munge /var/lib/munge
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then   # no munged answering (a stale socket is replaced)
  rm -f /run/munge/munge.socket.2 /run/munge/munge.socket.2.lock
  runuser -u munge -- /usr/sbin/munged --force
fi
slurmctld -f "$dir/slurm.conf"
slurmd -f "$dir/slurm.conf"
export SLURM_CONF="$dir/slurm.conf"
for _ in $(seq 1 120); do
  if [ "$(sinfo -h -o %T 2>/dev/null | head -1)" = "idle" ]; then
    echo "$dir/slurm.conf"
    exit 0
  fi
  sleep 0.5
done
echo "slurm did not come up; logs:" >&2
tail -n 20 "$dir/slurmctld.log" "$dir/slurmd.log" >&2 || true
exit 1
