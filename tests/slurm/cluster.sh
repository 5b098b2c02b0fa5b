#!/usr/bin/env bash
# cluster.sh — a real SLURM cluster on this one host, for the tests in tests/slurm.
#
#   bash tests/slurm/cluster.sh up      # install (first time), start munge, slurmctld, slurmd -N node1..nodeN
#   bash tests/slurm/cluster.sh down    # stop the daemons this script started (pid files only)
#   bash tests/slurm/cluster.sh env     # print 'export SLURM_CONF=...' for an interactive shell
#
# Debian's slurm-wlm (22.05) emulates N compute nodes with one slurmd per node, each on its own port. All nodes
# share this host's name, so code tells them apart by SLURMD_NODENAME, never by hostname. `up` and `down` are
# idempotent: `up` on a healthy cluster with an unchanged config does nothing.
#
# Everything the cluster writes lives under $ZT_SLURM_ROOT (default /tmp/zerotrain-slurm), including slurm.conf:
# clients and daemons find it through SLURM_CONF, so /etc/slurm is left alone. The only system-wide changes are
# the Debian packages, munge's key, and one marked /etc/hosts line per node name (the rendezvous code must be
# able to resolve node1, exactly as on a real cluster; `down --purge` removes them).
#
# Tunables (environment): ZT_SLURM_ROOT, ZT_SLURM_NODES (2), ZT_SLURM_CPUS_PER_NODE (8: may exceed real cores,
# so small jobs can run side by side), ZT_SLURM_MEM_PER_NODE (MB, 8000).
set -euo pipefail

ROOT=${ZT_SLURM_ROOT:-/tmp/zerotrain-slurm}
NODES=${ZT_SLURM_NODES:-2}
CPUS=${ZT_SLURM_CPUS_PER_NODE:-8}
MEM=${ZT_SLURM_MEM_PER_NODE:-8000}
export SLURM_CONF=$ROOT/etc/slurm.conf
MARK="# zerotrain-test-slurm"
HOST=$(hostname -s)
T0=$(date +%s.%N)

log() { echo "[cluster.sh $(date +%T)] $*" >&2; }
elapsed() { awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}'; }
pid_alive() { [ -f "$1" ] && kill -0 "$(cat "$1" 2>/dev/null)" 2>/dev/null; }
node_names() { seq -f "node%g" 1 "$NODES"; }

stop_pidfile() {  # stop one daemon we started, found by its pid file (never by name)
  local f=$1 i
  if pid_alive "$f"; then
    kill "$(cat "$f")" 2>/dev/null || true
    for i in $(seq 1 40); do pid_alive "$f" || break; sleep 0.25; done
    if pid_alive "$f"; then kill -9 "$(cat "$f")" 2>/dev/null || true; fi
  fi
  rm -f "$f"
}

down() {
  local f
  for f in "$ROOT"/run/slurmd-*.pid "$ROOT"/run/slurmctld.pid; do [ -e "$f" ] && stop_pidfile "$f"; done
  if [ -f "$ROOT/run/munged.started" ]; then  # only stop munged if we started it
    stop_pidfile /run/munge/munged.pid
    rm -f "$ROOT/run/munged.started"
  fi
  if [ "${1:-}" = "--purge" ]; then
    rm -rf "$ROOT"
    sed -i "/$MARK/d" /etc/hosts 2>/dev/null || true
  fi
  log "down ${1:-}"
}

install_packages() {
  local pkgs="slurmctld slurmd slurm-client munge" missing p
  missing=$(for p in $pkgs; do dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q 'ok installed' || echo "$p"; done)
  [ -z "$missing" ] && return 0
  # shellcheck disable=SC2086  # $missing is a word list
  log "installing:" $missing
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # The image's policy-rc.d forbids service starts during install ('invoke-rc.d ... denied' is expected):
  # we start the daemons ourselves below.
  # shellcheck disable=SC2086
  apt-get install -y -qq --no-install-recommends $missing >/dev/null
  log "packages installed ($(elapsed)s)"
}

start_munge() {
  munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return 0
  if [ ! -s /etc/munge/munge.key ]; then
    mungekey --create --keyfile=/etc/munge/munge.key 2>/dev/null \
      || dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
  fi
  chown munge:munge /etc/munge/munge.key
  chmod 400 /etc/munge/munge.key
  install -d -o munge -g munge -m 755 /run/munge
  install -d -o munge -g munge -m 700 /var/lib/munge /var/log/munge
  rm -f /run/munge/munged.pid
  runuser -u munge -- /usr/sbin/munged
  touch "$ROOT/run/munged.started"
  local i
  for i in $(seq 1 40); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return 0; sleep 0.25; done
  log "munged failed to start"; exit 1
}

add_host_names() {  # node names must resolve (MASTER_ADDR = first node), as on a real cluster
  local n
  for n in $(node_names); do getent hosts "$n" >/dev/null || echo "127.0.0.1 $n $MARK" >>/etc/hosts; done
}

write_conf() {  # to $1
  local i=0 n
  {
    cat <<CONF
$MARK
ClusterName=zerotrain-test
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=slurm
SlurmctldPort=6817
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$ROOT/state
SlurmdSpoolDir=$ROOT/spool/%n
SlurmctldPidFile=$ROOT/run/slurmctld.pid
SlurmdPidFile=$ROOT/run/slurmd-%n.pid
SlurmctldLogFile=$ROOT/log/slurmctld.log
SlurmdLogFile=$ROOT/log/slurmd-%n.log
# No cgroups in this sandbox: plain process tracking, no task binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
# Advertise the configured CPUs even where the host has fewer (else the node goes INVAL).
SlurmdParameters=config_overrides
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1
MpiDefault=none
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=300
KillWait=10
Waittime=0
SlurmctldDebug=info
SlurmdDebug=info
CONF
    for n in $(node_names); do
      i=$((i + 1))
      echo "NodeName=$n NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$((17000 + i)) CPUs=$CPUS Boards=1" \
        "SocketsPerBoard=1 CoresPerSocket=$CPUS ThreadsPerCore=1 RealMemory=$MEM State=UNKNOWN"
    done
    echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO"
  } >"$1"
}

daemons_alive() {
  pid_alive "$ROOT/run/slurmctld.pid" || return 1
  local n
  for n in $(node_names); do pid_alive "$ROOT/run/slurmd-$n.pid" || return 1; done
}

start_slurm() {
  write_conf "$SLURM_CONF.new"
  if cmp -s "$SLURM_CONF.new" "$SLURM_CONF" && daemons_alive; then
    rm -f "$SLURM_CONF.new"
    log "already running with this config"
    return 0
  fi
  local f n
  for f in "$ROOT"/run/slurmd-*.pid "$ROOT/run/slurmctld.pid"; do [ -e "$f" ] && stop_pidfile "$f"; done
  mv "$SLURM_CONF.new" "$SLURM_CONF"
  rm -rf "$ROOT"/state/* "$ROOT"/spool/*  # a fresh cluster: no stale jobs or node states from an earlier session
  /usr/sbin/slurmctld -f "$SLURM_CONF"
  for n in $(node_names); do /usr/sbin/slurmd -f "$SLURM_CONF" -N "$n"; done
}

wait_nodes_idle() {
  local i states bad n
  for i in $(seq 1 120); do
    states=$(sinfo -h -N -o '%N %T' 2>/dev/null || true)
    bad=$(echo "$states" | awk 'NF && $2 !~ /^(idle|mixed|allocated|completing)$/ {print $1}' | sort -u)
    [ -n "$states" ] && [ -z "$bad" ] && return 0
    for n in $bad; do  # nodes left DOWN/DRAIN by an earlier state
      case $(echo "$states" | awk -v n="$n" '$1==n{print $2}') in
        drain* | down* | inval*) scontrol update NodeName="$n" State=RESUME >/dev/null 2>&1 || true ;;
      esac
    done
    sleep 0.25
  done
  log "cluster did not come up; sinfo:"
  sinfo -N -l >&2 || true
  tail -n 20 "$ROOT"/log/slurmctld.log "$ROOT"/log/slurmd-*.log >&2 || true
  exit 1
}

up() {
  [ "$(id -u)" = 0 ] || { log "must run as root (daemons, packages)"; exit 1; }
  install_packages
  mkdir -p "$ROOT"/{etc,state,spool,log,run}
  chown slurm:slurm "$ROOT"/state "$ROOT"/log "$ROOT"/run
  chmod 755 "$ROOT" "$ROOT"/*
  start_munge
  add_host_names
  start_slurm
  wait_nodes_idle
  log "cluster up in $(elapsed)s: $(sinfo -h -N -o '%N:%T' | sort -u | tr '\n' ' ')"
}

case "${1:-up}" in
  up) up ;;
  down) down "${2:-}" ;;
  env) echo "export SLURM_CONF=$SLURM_CONF" ;;
  *) echo "usage: $0 up|down [--purge]|env" >&2; exit 2 ;;
esac
