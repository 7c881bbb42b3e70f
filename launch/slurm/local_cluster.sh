#!/usr/bin/env bash
# A real two-node SLURM cluster on one machine, for tests and CI: Debian's slurmctld, slurmd
# and munge, each "node" a network namespace with its own address, hostname and /etc/hosts.
#
#   launch/slurm/local_cluster.sh check          # can this machine? (prints why not; exit 1)
#   launch/slurm/local_cluster.sh up DIR         # install if needed, start; DIR/on NODE CMD...
#   launch/slurm/local_cluster.sh down DIR       # stop what 'up' started, remove namespaces
#
# Nodes node1 (10.77.0.1, runs slurmctld too) and node2 (10.77.0.2) sit on a bridge inside a
# third namespace; the addresses exist only there.  `DIR/on node1 sbatch ...` runs a command
# "on" a node (nsenter + unshare: `ip netns exec` would remount /sys and break slurmd).
# Needs root, apt-get (or the packages installed) and network namespaces.
set -euo pipefail
CMD="${1:-}"
DIR="${2:-}"
NODES=(node1 node2)

why_not() {
  [ "$(id -u)" = 0 ] || { echo "not root"; return; }
  command -v nsenter >/dev/null && command -v unshare >/dev/null \
    || { echo "nsenter/unshare missing"; return; }
  if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || \
     ! command -v munged >/dev/null || ! command -v ip >/dev/null; then
    command -v apt-get >/dev/null || { echo "slurm/iproute2 not installed and no apt-get"; return; }
  fi
  # Network namespaces: probed with unshare (no iproute2 needed before the install).
  unshare --net true 2>/dev/null || { echo "cannot create network namespaces"; return; }
}

install_packages() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && \
     command -v munged >/dev/null && command -v sbatch >/dev/null && command -v ip >/dev/null; then
    return
  fi
  echo "[local-cluster] installing slurmctld slurmd slurm-client munge iproute2 (apt)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get -o Acquire::Retries=1 -o Acquire::http::Timeout=20 update -qq >/dev/null
  apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge \
    iproute2 >/dev/null
}

start_munge() {
  # One munged for the machine (the socket is a file, shared by every namespace).
  if [ -S /run/munge/munge.socket.2 ] && munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    return
  fi
  install -d -o munge -g munge -m0755 /run/munge
  [ -f /etc/munge/munge.key ] || { mungekey -c 2>/dev/null || create-munge-key -f; }
  runuser -u munge -- /usr/sbin/munged
  echo started > "$DIR/munged.started"
}

write_conf() {
  local ncpu mem
  ncpu=$(nproc)
  mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 4 ))
  cat > "$DIR/hosts" <<HOSTS
127.0.0.1 localhost
10.77.0.1 node1
10.77.0.2 node2
HOSTS
  mkdir -p "$DIR/state" "$DIR/spool" "$DIR/log"
  cat > "$DIR/slurm.conf" <<CONF
ClusterName=megalite
SlurmctldHost=node1(10.77.0.1)
AuthType=auth/munge
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/log/jobcomp.txt
MailProg=/bin/true
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
NodeName=node1 NodeAddr=10.77.0.1 CPUs=$ncpu RealMemory=$mem State=UNKNOWN
NodeName=node2 NodeAddr=10.77.0.2 CPUs=$ncpu RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
  # DIR/on NODE CMD...: run CMD inside NODE's namespace with its hostname and /etc/hosts.
  cat > "$DIR/on" <<ON
#!/usr/bin/env bash
node="\$1"; shift
ns="\$(cat "$DIR/netns-prefix")-\$node"
export SLURM_CONF="$DIR/slurm.conf"
exec nsenter --net="/run/netns/\$ns" unshare --uts --mount --propagation private \\
  bash -c 'hostname "\$0"; mount --bind "$DIR/hosts" /etc/hosts; exec "\$@"' "\$node" "\$@"
ON
  chmod +x "$DIR/on"
}

make_network() {
  local prefix="megalite-$$"
  echo "$prefix" > "$DIR/netns-prefix"
  ip netns add "$prefix-br" || return 1
  ip -n "$prefix-br" link add br0 type bridge
  ip -n "$prefix-br" link set br0 up
  local i=1
  for node in "${NODES[@]}"; do
    ip netns add "$prefix-$node"
    ip -n "$prefix-br" link add "p$i" type veth peer name eth0 netns "$prefix-$node"
    ip -n "$prefix-br" link set "p$i" master br0 up
    ip -n "$prefix-$node" addr add "10.77.0.$i/24" dev eth0
    ip -n "$prefix-$node" link set eth0 up
    ip -n "$prefix-$node" link set lo up
    i=$((i + 1))
  done
}

wait_idle() {
  for _ in $(seq 1 100); do
    if "$DIR/on" node1 sinfo -h -o "%T %D" 2>/dev/null | grep -q "^idle 2$"; then return 0; fi
    sleep 0.2
  done
  echo "[local-cluster] nodes did not become idle:" >&2
  "$DIR/on" node1 sinfo >&2 || true
  tail -n 20 "$DIR"/log/*.log >&2 || true
  return 1
}

case "$CMD" in
  check)
    reason="$(why_not)"
    if [ -n "$reason" ]; then echo "$reason"; exit 1; fi
    echo "ok" ;;
  up)
    [ -n "$DIR" ] || { echo "usage: $0 up DIR" >&2; exit 2; }
    reason="$(why_not)"
    if [ -n "$reason" ]; then echo "cannot run a local SLURM cluster: $reason" >&2; exit 3; fi
    start=$(date +%s.%N)
    mkdir -p "$DIR"; DIR="$(cd "$DIR" && pwd)"
    install_packages || { echo "cannot run a local SLURM cluster: installing slurm with apt-get failed" >&2; exit 4; }
    write_conf
    start_munge
    make_network || { echo "cannot run a local SLURM cluster: network namespaces failed" >&2
                      "$0" down "$DIR"; exit 3; }
    "$DIR/on" node1 slurmctld
    for node in "${NODES[@]}"; do "$DIR/on" "$node" slurmd -N "$node"; done
    wait_idle
    echo "[local-cluster] up in $(echo "$(date +%s.%N) - $start" | bc 2>/dev/null || echo '?') s: $DIR" ;;
  down)
    [ -n "$DIR" ] && [ -d "$DIR" ] || exit 0
    for pidfile in "$DIR"/slurmd-*.pid "$DIR/slurmctld.pid"; do
      [ -f "$pidfile" ] && kill "$(cat "$pidfile")" 2>/dev/null || true
    done
    sleep 0.5
    if [ -f "$DIR/munged.started" ] && [ -f /run/munge/munged.pid ]; then
      kill "$(cat /run/munge/munged.pid)" 2>/dev/null || true
    fi
    if [ -f "$DIR/netns-prefix" ]; then
      prefix="$(cat "$DIR/netns-prefix")"
      for ns in "${NODES[@]/#/$prefix-}" "$prefix-br"; do ip netns del "$ns" 2>/dev/null || true; done
    fi ;;
  *)
    sed -n '2,12p' "$0"; exit 2 ;;
esac
