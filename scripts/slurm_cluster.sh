#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, to test `srun`/`sbatch` launches for real
# (tests/test_slurm.py) or to try the job scripts in scripts/slurm/ by hand.
#
#   scripts/slurm_cluster.sh start    # configure, start munged + slurmctld + slurmd, wait idle
#   scripts/slurm_cluster.sh stop     # stop the three daemons this script started (pid files)
#   scripts/slurm_cluster.sh status   # exit 0 when the node answers and is usable
#   eval "$(scripts/slurm_cluster.sh env)"   # SLURM_CONF for sbatch/srun/sinfo in this shell
#
# Everything (slurm.conf, munge key and socket, state, logs, pid files) lives under
# $HYFI_SLURM_DIR (default /tmp/hyfi-slurm-$UID): nothing is written to /etc, and the
# system's own munge or slurm, if any, is left alone. Needs the Debian packages slurm-wlm and
# munge (apt-get install -y slurm-wlm munge). Why these settings:
#   - NodeName is this host's `hostname -s` with CPUs=4 and SlurmdParameters=config_overrides:
#     a 2-core machine then still runs a 4-task job (the node claims 4 CPUs), and
#     OverSubscribe=FORCE lets a second job share the node rather than queue.
#   - no cgroups (ProctrackType=proctrack/linuxproc, TaskPlugin=task/none): containers and
#     sandboxes rarely delegate cgroup v2 controllers, and the tests need none.
#   - MpiDefault=none: hyfi-imaging reads ranks from SLURM's own variables under srun.
#   - ports $HYFI_SLURM_PORT (default 6817) and +1, so a cluster can run beside another.
# Exit status: 0 done; 1 a daemon did not start or the node never became idle (the log's tail
# is printed); 2 bad usage or a missing package.
set -euo pipefail

DIR=${HYFI_SLURM_DIR:-/tmp/hyfi-slurm-$(id -u)}
PORT=${HYFI_SLURM_PORT:-6817}
HOST=$(hostname -s)
USER_NAME=$(id -un)
CONF=$DIR/slurm.conf
WAIT_S=${HYFI_SLURM_WAIT_S:-60}

need() {
  for cmd in "$@"; do
    if ! command -v "$cmd" >/dev/null 2>&1 && [ ! -x "/usr/sbin/$cmd" ]; then
      echo "slurm_cluster: $cmd is not installed; install it with: apt-get install -y slurm-wlm munge" >&2
      exit 2
    fi
  done
}

sbin() {  # a daemon from PATH, else /usr/sbin (not on a non-root user's PATH)
  command -v "$1" 2>/dev/null || echo "/usr/sbin/$1"
}

alive() {  # alive PIDFILE: the pid it names runs
  [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}

write_conf() {
  mkdir -p "$DIR/munge" "$DIR/ctld" "$DIR/spool"
  chmod 700 "$DIR" "$DIR/munge"
  if [ ! -s "$DIR/munge/munge.key" ]; then
    if ! "$(sbin mungekey)" --create --keyfile="$DIR/munge/munge.key" 2>/dev/null; then
      dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
    fi
    chmod 600 "$DIR/munge/munge.key"
  fi
  cat >"$CONF" <<EOF
# Written by scripts/slurm_cluster.sh: a one-node test cluster (see that script).
ClusterName=hyfi
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=$USER_NAME
SlurmdUser=$USER_NAME
AuthType=auth/munge
CredType=cred/munge
# cred_expire: a requeued job waits this long before it may start again (default 120 s).
AuthInfo=socket=$DIR/munge/munge.socket,cred_expire=5
StateSaveLocation=$DIR/ctld
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
# bf_interval=1: a requeued job starts within a second of its delay (cred_expire) passing.
SchedulerParameters=bf_interval=1
MailProg=/bin/true
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=300
NodeName=$HOST NodeAddr=127.0.0.1 NodeHostname=$HOST CPUs=4 RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
}

node_state() {  # the node's state as sinfo says it (empty when the controller is not up)
  alive "$DIR/slurmctld.pid" || return 0
  SLURM_CONF=$CONF sinfo -h -N -n "$HOST" -o '%T' 2>/dev/null | head -1 || true
}

fail() {
  echo "slurm_cluster: $1" >&2
  for log in "$DIR/munged.log" "$DIR/slurmctld.log" "$DIR/slurmd.log"; do
    [ -f "$log" ] && { echo "--- tail of $log" >&2; tail -n 8 "$log" >&2; }
  done
  exit 1
}

start() {
  need munged slurmctld slurmd sinfo sbatch srun
  write_conf
  if ! alive "$DIR/slurmctld.pid" && ! alive "$DIR/slurmd.pid"; then
    rm -f "$DIR"/*.log # a fresh start: the logs then tell about this run only
  fi
  if ! alive "$DIR/munged.pid"; then
    # -f: munged refuses to run as root or with a world-readable /tmp parent otherwise.
    "$(sbin munged)" -f --socket="$DIR/munge/munge.socket" --key-file="$DIR/munge/munge.key" \
      --pid-file="$DIR/munged.pid" --log-file="$DIR/munged.log" \
      --seed-file="$DIR/munge/munged.seed" || fail "munged did not start"
  fi
  if ! alive "$DIR/slurmctld.pid"; then
    # -c: a clean start, no jobs or node states from an earlier cluster in this directory.
    SLURM_CONF=$CONF "$(sbin slurmctld)" -c -f "$CONF" || fail "slurmctld did not start"
  fi
  if ! alive "$DIR/slurmd.pid"; then
    SLURM_CONF=$CONF "$(sbin slurmd)" -f "$CONF" || fail "slurmd did not start"
  fi
  local state="" waited=0
  while [ "$waited" -lt "$WAIT_S" ]; do
    state=$(node_state)
    case "$state" in
    idle* | mixed* | allocated*) break ;;
    down* | drain*) SLURM_CONF=$CONF scontrol update nodename="$HOST" state=resume 2>/dev/null || true ;;
    esac
    sleep 1
    waited=$((waited + 1))
  done
  case "$state" in
  idle* | mixed* | allocated*) ;;
  *) fail "node $HOST is '${state:-not listed}' after ${WAIT_S} s, not idle" ;;
  esac
  echo "slurm_cluster: node $HOST is $state; use it with: export SLURM_CONF=$CONF"
}

stop() {
  # Only the daemons whose pid files this script's start wrote: slurmd, slurmctld, munged
  # (told together, then waited for: slurmctld takes seconds to save its state).
  local pids=()
  for name in slurmd slurmctld munged; do
    if alive "$DIR/$name.pid"; then
      pids+=("$(cat "$DIR/$name.pid")")
      kill "${pids[-1]}" 2>/dev/null || true
    fi
  done
  for _ in $(seq 100); do
    local left=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && left=1; done
    [ "$left" = 0 ] && break
    sleep 0.1
  done
  for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && kill -9 "$pid" 2>/dev/null; done
  rm -f "$DIR/slurmd.pid" "$DIR/slurmctld.pid" "$DIR/munged.pid"
  echo "slurm_cluster: stopped (state in $DIR)"
}

case "${1:-}" in
start) start ;;
stop) stop ;;
status)
  state=$(node_state)
  case "$state" in idle* | mixed* | allocated*) echo "$state" ;; *) echo "${state:-down}"; exit 1 ;; esac
  ;;
env) echo "export SLURM_CONF=$CONF" ;;
*)
  echo "usage: $0 start|stop|status|env   (state in \$HYFI_SLURM_DIR, default $DIR)" >&2
  exit 2
  ;;
esac
