#!/usr/bin/env bash
# A real SLURM for the tests: Debian's slurm-wlm on this one host, no accounting, two slurmd
# daemons (nodes pjn1, pjn2; multiple-slurmd) so that `--nodes=2` jobs run, CPU only (the
# sbatch recipe must work without GPUs). Installs what is missing (apt-get, as root), writes
# the config, starts what is not running. Idempotent. Prints "slurm ready" and exits 0 when
# `srun -N2 true` works; otherwise one line on stderr and exit 1 (the tests then skip).
#   tests/slurm_cluster.sh          # bring it up
#   tests/slurm_cluster.sh stop     # stop the daemons it started
set -u
LOG=${SLURM_CLUSTER_LOG:-/tmp/project-slurm.log}
NODES=(pjn1 pjn2)
PORTS=(17101 17102)
fail() { echo "slurm_cluster: $* (log: $LOG)" >&2; exit 1; }
alive() { [[ -f "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null; }
stop() { alive "$1" && kill "$(cat "$1")" 2>/dev/null; rm -f "$1"; }

if [[ "${1:-}" == stop ]]; then
  for n in "${NODES[@]}"; do stop "/run/slurmd-$n.pid"; done
  stop /run/slurmctld.pid
  exit 0
fi
[[ "$(id -u)" == 0 ]] || fail "needs root (installs packages, starts daemons)"
: >>"$LOG"

missing=()
for p in slurm-wlm munge; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if (( ${#missing[@]} )); then
  command -v apt-get >/dev/null || fail "no apt-get to install ${missing[*]}"
  { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"; } \
    >>"$LOG" 2>&1 || fail "apt-get install ${missing[*]} failed"
fi

cpus=$(getconf _NPROCESSORS_ONLN)
mem=$(awk '/MemTotal/ {print int($2 / 1024 / 4)}' /proc/meminfo)  # MB per node
mkdir -p /etc/slurm /var/spool/slurmctld /var/log/slurm /run/munge
for n in "${NODES[@]}"; do mkdir -p "/var/spool/slurmd/$n"; done
conf=$(mktemp)
cat >"$conf" <<EOF
# tests/slurm_cluster.sh: one host, two slurmd daemons, CPU only
ClusterName=project
SlurmctldHost=$(hostname)(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd/%n
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd-%n.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
# Retry pending jobs every 2 s (default 60/30): a job submitted while the previous one's nodes
# are still completing otherwise waits up to a minute.
SchedulerParameters=sched_interval=2,bf_interval=2
JobRequeue=1
ReturnToService=2
MinJobAge=600
KillWait=30
AuthInfo=cred_expire=10
InactiveLimit=0
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
EOF
for i in "${!NODES[@]}"; do
  echo "NodeName=${NODES[$i]} NodeHostname=$(hostname) NodeAddr=127.0.0.1 Port=${PORTS[$i]} CPUs=$cpus RealMemory=$mem State=UNKNOWN"
done >>"$conf"
echo "PartitionName=test Nodes=$(IFS=,; echo "${NODES[*]}") Default=YES MaxTime=INFINITE State=UP" >>"$conf"
if ! cmp -s "$conf" /etc/slurm/slurm.conf; then  # a new config: restart our daemons
  cp "$conf" /etc/slurm/slurm.conf && chmod 644 /etc/slurm/slurm.conf
  : >/etc/slurm/gres.conf
  for n in "${NODES[@]}"; do stop "/run/slurmd-$n.pid"; done
  stop /run/slurmctld.pid
  sleep 1
fi
rm -f "$conf"

chown munge:munge /run/munge
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  [[ -s /etc/munge/munge.key ]] || mungekey -c -f >>"$LOG" 2>&1 || fail "mungekey failed"
  chown munge:munge /etc/munge/munge.key && chmod 600 /etc/munge/munge.key
  runuser -u munge -- /usr/sbin/munged >>"$LOG" 2>&1 || fail "munged did not start"
fi
alive /run/slurmctld.pid || slurmctld >>"$LOG" 2>&1 || fail "slurmctld did not start"
for _ in $(seq 60); do scontrol ping 2>/dev/null | grep -q UP && break; sleep 0.5; done
for n in "${NODES[@]}"; do
  alive "/run/slurmd-$n.pid" || slurmd -N "$n" >>"$LOG" 2>&1 || fail "slurmd -N $n did not start"
done
for _ in $(seq 60); do
  sinfo -h -N -o '%t' 2>/dev/null | grep -qvE '^(idle|mix|alloc)' || break
  for n in "${NODES[@]}"; do scontrol update nodename="$n" state=resume >/dev/null 2>&1; done
  sleep 1
done
timeout 60 srun -N 2 -n 2 true >>"$LOG" 2>&1 || fail "srun -N2 true does not run"
echo "slurm ready: $(sinfo -h -o '%P %D %t')"
