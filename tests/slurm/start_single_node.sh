#!/usr/bin/env bash
# Start a single-node SLURM cluster on this host for tests/workflow/test_slurm_cluster.py.
#
#   sudo tests/slurm/start_single_node.sh          # install (first time), configure, start
#   sudo tests/slurm/start_single_node.sh --stop   # stop the daemons again
#
# Debian/Ubuntu only (apt-get: slurm-wlm + munge). Needs root and no systemd: the daemons
# are started directly in the background. Idempotent: packages already installed are not
# reinstalled, daemons already running are left alone, and the script ends once `sinfo`
# shows this node idle. The node has this host's real CPUs and memory and is in three
# partitions, all the same node: debug (the default) and the placeholders "cpu" and "gpu"
# of profiles/slurm. No accounting database: sacct does not work, squeue does (jobs stay
# visible for MinJobAge=600 s after they end), so run snakemake with
# `--slurm-status-command squeue`.
set -euo pipefail

CONF_DIR=/etc/slurm
STATE_DIR=/var/lib/slurm
LOG_DIR=/var/log/slurm
RUN_DIR=/run/slurm

log() { printf '[start_single_node] %s\n' "$*"; }

# True while the process in pid file $1 runs (a zombie waiting to be reaped does not count).
pid_alive() {
    [[ -s $1 ]] || return 1
    local state
    state=$(ps -o stat= -p "$(cat "$1")" 2>/dev/null) || return 1
    [[ -n $state && $state != Z* ]]
}

stop_daemons() {
    local pidfile
    for pidfile in "$RUN_DIR/slurmd.pid" "$RUN_DIR/slurmctld.pid" /run/munge/munged.pid; do
        if pid_alive "$pidfile"; then
            log "stopping $(basename "$pidfile" .pid) ($(cat "$pidfile"))"
            kill "$(cat "$pidfile")"
        fi
    done
    for pidfile in "$RUN_DIR/slurmd.pid" "$RUN_DIR/slurmctld.pid" /run/munge/munged.pid; do
        for _ in $(seq 50); do pid_alive "$pidfile" || break; sleep 0.2; done
        rm -f "$pidfile"
    done
}

if [[ ${1:-} == --stop ]]; then
    stop_daemons
    exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
    echo "start_single_node.sh: run as root" >&2
    exit 1
fi

started=$(date +%s%N)
seconds() {
    local ms=$((($(date +%s%N) - started) / 1000000))
    printf '%d.%d' $((ms / 1000)) $((ms % 1000 / 100))
}

# 1. Packages. A policy-rc.d keeps the package scripts from starting the daemons
#    (there is no systemd; we start them ourselves below).
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null \
    || ! command -v sinfo >/dev/null || ! command -v munged >/dev/null; then
    log "installing slurm-wlm and munge"
    export DEBIAN_FRONTEND=noninteractive
    policy=/usr/sbin/policy-rc.d
    own_policy=0
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy"
        chmod +x "$policy"
        own_policy=1
    fi
    apt_install() {
        apt-get install -y -q --no-install-recommends \
            -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold \
            slurm-wlm munge
    }
    apt_install || { apt-get update -q && apt_install; }
    [[ $own_policy -eq 1 ]] && rm -f "$policy"
    log "packages installed after $(seconds) s"
fi

# 2. Munge: a key (the package usually creates one) and its runtime directories.
mkdir -p /etc/munge /var/lib/munge /var/log/munge /run/munge
if [[ ! -s /etc/munge/munge.key ]]; then
    if command -v mungekey >/dev/null; then
        mungekey --create --keyfile=/etc/munge/munge.key
    else
        dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
    fi
fi
chown -R munge:munge /etc/munge /var/lib/munge /var/log/munge /run/munge
chmod 0700 /etc/munge /var/lib/munge /var/log/munge
chmod 0755 /run/munge
chmod 0400 /etc/munge/munge.key
if ! pid_alive /run/munge/munged.pid; then
    log "starting munged"
    runuser -u munge -- /usr/sbin/munged
fi
for _ in $(seq 50); do munge -n >/dev/null 2>&1 && break; sleep 0.1; done
munge -n | unmunge >/dev/null

# 3. slurm.conf for this host: real CPUs and memory as slurmd detects them.
host=$(hostname -s)
# `slurmd -C` prints e.g. "NodeName=vm CPUs=2 Boards=1 SocketsPerBoard=1 ... RealMemory=24105"
hw=$(slurmd -C | head -1)
cpus=$(sed -n 's/.*\bCPUs=\([0-9]*\).*/\1/p' <<<"$hw")
sockets=$(sed -n 's/.*\bSocketsPerBoard=\([0-9]*\).*/\1/p' <<<"$hw")
cores=$(sed -n 's/.*\bCoresPerSocket=\([0-9]*\).*/\1/p' <<<"$hw")
threads=$(sed -n 's/.*\bThreadsPerCore=\([0-9]*\).*/\1/p' <<<"$hw")
memory=$(sed -n 's/.*\bRealMemory=\([0-9]*\).*/\1/p' <<<"$hw")
mkdir -p "$CONF_DIR" "$STATE_DIR/slurmctld" "$STATE_DIR/slurmd" "$LOG_DIR" "$RUN_DIR"
conf=$(
    cat <<EOF
# Written by tests/slurm/start_single_node.sh: one node, no accounting, no cgroups.
ClusterName=single
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
ReturnToService=2
# squeue (no sacct here) must still see a job for a while after it ended.
MinJobAge=600
SlurmctldTimeout=60
SlurmdTimeout=300
InactiveLimit=0
KillWait=10
Waittime=0
StateSaveLocation=$STATE_DIR/slurmctld
SlurmdSpoolDir=$STATE_DIR/slurmd
SlurmctldPidFile=$RUN_DIR/slurmctld.pid
SlurmdPidFile=$RUN_DIR/slurmd.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus SocketsPerBoard=$sockets CoresPerSocket=$cores ThreadsPerCore=$threads RealMemory=$memory State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
PartitionName=cpu Nodes=$host MaxTime=INFINITE State=UP
PartitionName=gpu Nodes=$host MaxTime=INFINITE State=UP
EOF
)
if [[ ! -f $CONF_DIR/slurm.conf ]] || [[ $(cat "$CONF_DIR/slurm.conf") != "$conf" ]]; then
    log "writing $CONF_DIR/slurm.conf (node $host: $cpus CPUs, $memory MB)"
    printf '%s\n' "$conf" >"$CONF_DIR/slurm.conf"
    # A changed configuration needs fresh daemons.
    for pidfile in "$RUN_DIR/slurmd.pid" "$RUN_DIR/slurmctld.pid"; do
        if pid_alive "$pidfile"; then kill "$(cat "$pidfile")"; fi
        for _ in $(seq 50); do pid_alive "$pidfile" || break; sleep 0.2; done
    done
fi

# 4. Daemons (they fork into the background themselves).
if ! pid_alive "$RUN_DIR/slurmctld.pid"; then
    log "starting slurmctld"
    slurmctld -i
fi
if ! pid_alive "$RUN_DIR/slurmd.pid"; then
    log "starting slurmd"
    slurmd
fi

# 5. Wait for the node to be idle (or busy with jobs: mixed/allocated).
for _ in $(seq 120); do
    state=$(sinfo -h -n "$host" -p debug -o '%T' 2>/dev/null || true)
    case $state in
        idle* | mixed* | allocated*) break ;;
        down* | drain*) scontrol update NodeName="$host" State=RESUME >/dev/null 2>&1 || true ;;
    esac
    sleep 0.5
done
sinfo
case $state in
    idle* | mixed* | allocated*) ;;
    *)
        echo "start_single_node.sh: node $host is '$state', not idle; see $LOG_DIR/*.log" >&2
        exit 1
        ;;
esac
log "SLURM ready after $(seconds) s (stop: $0 --stop)"
