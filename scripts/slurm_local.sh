#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for tests/test_slurm.py and for trying
# `zerograph slurm` (docs/slurm.md) without a real cluster.
#
#   scripts/slurm_local.sh start [DIR]   install slurm-wlm + munge from Debian if absent (needs root),
#                                        write DIR/slurm.conf, start munged, slurmctld and slurmd;
#                                        prints `export SLURM_CONF=DIR/slurm.conf` (eval it)
#   scripts/slurm_local.sh stop  [DIR]   cancel this cluster's jobs, stop the three daemons it started
#   scripts/slurm_local.sh env   [DIR]   print the export line again
#
# DIR defaults to $ZG_SLURM_DIR or /tmp/zg-slurm; everything (config, munge key and socket, state,
# logs, pid files) lives there, and the daemons listen on free ports, so it never touches a real
# Slurm or munge on the same machine (their /etc files and sockets are not used).
#
# The cluster: one node named after this host (its CPUs and memory as `slurmd -C` detects them,
# no GPUs), partitions `cpu` (default) and `gpu` on that node (`gpu` has no GPUs: it exists so
# the guide's GPU commands can be checked with --dry-run), select/cons_tres with CR_CPU (each
# logical CPU a slot), proctrack/linuxproc and task/none (no cgroups in a container), no
# accounting database (sacct does not work: job states come from squeue/scontrol, kept for
# MinJobAge = 1 h), SlurmUser=root, KillWait=5 s between a cancelled job's SIGTERM and SIGKILL.
set -euo pipefail

cmd=${1:-}
DIR=${2:-${ZG_SLURM_DIR:-/tmp/zg-slurm}}
CONF=$DIR/slurm.conf
HOST=$(hostname -s)

die() { echo "slurm_local.sh: $*" >&2; exit 1; }

install_slurm() {
  local missing=()
  for exe in slurmctld slurmd sbatch munged; do command -v "$exe" >/dev/null || missing+=("$exe"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  [ "$(id -u)" -eq 0 ] || die "${missing[*]} not installed; as root: apt-get install -y slurm-wlm munge"
  command -v apt-get >/dev/null || die "${missing[*]} not installed and no apt-get: install Slurm and munge"
  echo "installing slurm-wlm and munge (missing: ${missing[*]})" >&2
  export DEBIAN_FRONTEND=noninteractive
  if ! apt-get install -y -q --no-install-recommends slurm-wlm munge >"$DIR/apt.log" 2>&1; then
    apt-get update -q >>"$DIR/apt.log" 2>&1 || true
    apt-get install -y -q --no-install-recommends slurm-wlm munge >>"$DIR/apt.log" 2>&1 \
      || die "apt-get install slurm-wlm munge failed (see $DIR/apt.log)"
  fi
}

free_port() {  # a TCP port nothing listens on now, from 20000-59999
  local p
  for _ in $(seq 200); do
    p=$((20000 + RANDOM % 40000))
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then echo "$p"; return; fi
  done
  die "no free TCP port found"
}

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

start() {
  mkdir -p "$DIR"
  DIR=$(cd "$DIR" && pwd)
  CONF=$DIR/slurm.conf
  if alive "$DIR/slurmctld.pid" && alive "$DIR/slurmd.pid" && SLURM_CONF=$CONF sinfo -h >/dev/null 2>&1; then
    echo "export SLURM_CONF=$CONF"; return 0   # already running
  fi
  stop_daemons quiet
  install_slurm
  mkdir -p "$DIR/munge" "$DIR/state" "$DIR/spool" "$DIR/log"
  chmod 700 "$DIR/munge"
  if [ ! -s "$DIR/munge/munge.key" ]; then
    dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
    chmod 400 "$DIR/munge/munge.key"
  fi
  munged --force --key-file="$DIR/munge/munge.key" --socket="$DIR/munge/munge.socket" \
    --pid-file="$DIR/munged.pid" --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/munged.seed" \
    || die "munged did not start (see $DIR/log/munged.log)"

  local node ctld_port slurmd_port
  node=$(slurmd -C | head -1 | sed "s/^NodeName=[^ ]*/NodeName=$HOST/")
  ctld_port=$(free_port); slurmd_port=$(free_port)
  cat >"$CONF" <<EOF
# written by scripts/slurm_local.sh: a one-node test cluster (no GPUs)
ClusterName=zgtest
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge/munge.socket
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
PlugStackConfig=$DIR/plugstack.conf
ReturnToService=2
MinJobAge=3600
KillWait=5
InactiveLimit=0
$node NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=cpu Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
PartitionName=gpu Nodes=$HOST Default=NO MaxTime=INFINITE State=UP
EOF
  : >"$DIR/plugstack.conf"
  export SLURM_CONF=$CONF
  slurmctld -f "$CONF" || die "slurmctld did not start (see $DIR/log/slurmctld.log)"
  slurmd -f "$CONF" -N "$HOST" || die "slurmd did not start (see $DIR/log/slurmd.log)"
  local state=""
  for _ in $(seq 150); do
    state=$(sinfo -h -N -n "$HOST" -o %t 2>/dev/null | head -1 || true)
    case "$state" in
      idle*|mix*|alloc*) echo "export SLURM_CONF=$CONF"; return 0 ;;
      down*|drain*) scontrol update nodename="$HOST" state=resume >/dev/null 2>&1 || true ;;
    esac
    sleep 0.2
  done
  die "node $HOST not idle after 30 s (state: ${state:-none}; logs in $DIR/log)"
}

stop_daemons() {
  export SLURM_CONF=$CONF
  if alive "$DIR/slurmctld.pid"; then
    scancel --full --quiet $(squeue -h -o %i 2>/dev/null) 2>/dev/null || true
    for _ in $(seq 50); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.2; done
  fi
  local f pid
  for f in slurmd slurmctld munged; do
    if alive "$DIR/$f.pid"; then
      pid=$(cat "$DIR/$f.pid")
      kill "$pid"
      for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
    fi
    rm -f "$DIR/$f.pid"
  done
  [ "${1:-}" = quiet ] || echo "stopped the test cluster in $DIR" >&2
}

case "$cmd" in
  start) start ;;
  stop) [ -d "$DIR" ] && stop_daemons ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  *) echo "usage: $0 start|stop|env [DIR]" >&2; exit 2 ;;
esac
