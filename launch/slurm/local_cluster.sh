#!/usr/bin/env bash
# A real SLURM cluster on one machine, for tests and CI: Debian's slurmctld, slurmd and
# munge, each "node" a network namespace with its own address, hostname and /etc/hosts.
#
#   launch/slurm/local_cluster.sh check              # can this machine? (prints why not; exit 1)
#   launch/slurm/local_cluster.sh up DIR [NODES] [ctl]  # install if needed, start NODES
#                                                    # (default 2); ctl: slurmctld on a host
#                                                    # "ctl" of its own (10.77.0.250), so that
#                                                    # node1 can die as any other node
#   launch/slurm/local_cluster.sh down DIR           # stop what 'up' started, remove namespaces
#   launch/slurm/local_cluster.sh kill-node DIR NODE # the node dies: SIGKILL all its processes
#                                                    # (its /dev/shm goes with them)
#   launch/slurm/local_cluster.sh start-node DIR NODE  # a (re)booted node: start its slurmd
#   launch/slurm/local_cluster.sh link DIR NODE down|up  # cut / restore the node's network
#
# Nodes node1 (10.77.0.1, runs slurmctld too), node2 (10.77.0.2), ... sit on a bridge inside
# another namespace; the addresses exist only there.  `DIR/on node1 sbatch ...` runs a command
# "on" a node (nsenter + unshare: `ip netns exec` would remount /sys and break slurmd).
# Every cluster has its own namespaces (named after the 'up' process), its own munged (socket
# in DIR) and its own files in DIR, so two clusters on one machine do not meet.
# Needs root, apt-get (or the packages installed) and network namespaces.
set -euo pipefail
CMD="${1:-}"
DIR="${2:-}"

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
  # This cluster's own munged (as root, socket in DIR): stopping it never affects another.
  local key=/etc/munge/munge.key
  [ -f "$key" ] || { mungekey -c 2>/dev/null || create-munge-key -f; }
  /usr/sbin/munged --force --socket="$DIR/munge.socket" --pid-file="$DIR/munged.pid" \
    --log-file="$DIR/log/munged.log" --seed-file="$DIR/munged.seed" --key-file="$key"
}

node_names() { cat "$DIR/nodes"; }

write_conf() {
  local ncpu mem n i
  n="$1"
  ctl_host="node1(10.77.0.1)"
  ncpu=$(nproc)
  mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / (n + 2) ))
  : > "$DIR/nodes"
  echo "127.0.0.1 localhost" > "$DIR/hosts"
  for i in $(seq 1 "$n"); do
    echo "node$i" >> "$DIR/nodes"
    echo "10.77.0.$i node$i" >> "$DIR/hosts"
  done
  if [ "${2:-}" = ctl ]; then
    echo "10.77.0.250 ctl" >> "$DIR/hosts"; echo ctl > "$DIR/ctl"; ctl_host="ctl(10.77.0.250)"
  else
    echo node1 > "$DIR/ctl"
  fi
  mkdir -p "$DIR/state" "$DIR/spool" "$DIR/log"
  cat > "$DIR/slurm.conf" <<CONF
ClusterName=megalite
SlurmctldHost=$ctl_host
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge.socket
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/log/jobcomp.txt
MailProg=/bin/true
SlurmdTimeout=300
InactiveLimit=0
KillWait=5
CONF
  for i in $(seq 1 "$n"); do
    echo "NodeName=node$i NodeAddr=10.77.0.$i CPUs=$ncpu RealMemory=$mem State=UNKNOWN" \
      >> "$DIR/slurm.conf"
  done
  echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP" >> "$DIR/slurm.conf"
  # DIR/on NODE CMD...: run CMD inside NODE's namespace with its hostname and /etc/hosts,
  # and a /dev/shm of its own (a fresh tmpfs): a node's shared memory -- where the peer
  # snapshots live -- is seen by what runs on that node only (slurmd and its jobs), and dies
  # with the node (kill-node); a restarted node (start-node) comes back with an empty one.
  cat > "$DIR/on" <<ON
#!/usr/bin/env bash
node="\$1"; shift
ns="\$(cat "$DIR/netns-prefix")-\$node"
export SLURM_CONF="$DIR/slurm.conf"
exec nsenter --net="/run/netns/\$ns" unshare --uts --mount --propagation private \\
  bash -c 'hostname "\$0"; mount --bind "$DIR/hosts" /etc/hosts
           mount -t tmpfs -o size=25%,mode=1777 "shm-\$0" /dev/shm; exec "\$@"' "\$node" "\$@"
ON
  chmod +x "$DIR/on"
}

make_network() {
  local prefix="megalite-$$" i=1
  echo "$prefix" > "$DIR/netns-prefix"
  ip netns add "$prefix-br" || return 1
  ip -n "$prefix-br" link add br0 type bridge
  ip -n "$prefix-br" link set br0 up
  for node in $(node_names); do
    ip netns add "$prefix-$node"
    ip -n "$prefix-br" link add "p$i" type veth peer name eth0 netns "$prefix-$node"
    ip -n "$prefix-br" link set "p$i" master br0 up
    ip -n "$prefix-$node" addr add "10.77.0.$i/24" dev eth0
    ip -n "$prefix-$node" link set eth0 up
    ip -n "$prefix-$node" link set lo up
    i=$((i + 1))
  done
  if [ "$(cat "$DIR/ctl")" = ctl ]; then
    ip netns add "$prefix-ctl"
    ip -n "$prefix-br" link add p0 type veth peer name eth0 netns "$prefix-ctl"
    ip -n "$prefix-br" link set p0 master br0 up
    ip -n "$prefix-ctl" addr add 10.77.0.250/24 dev eth0
    ip -n "$prefix-ctl" link set eth0 up
    ip -n "$prefix-ctl" link set lo up
  fi
}

wait_idle() {
  local n
  n=$(node_names | wc -l)
  for _ in $(seq 1 150); do
    if "$DIR/on" node1 sinfo -h -o "%T %D" 2>/dev/null | grep -q "^idle $n$"; then return 0; fi
    sleep 0.2
  done
  echo "[local-cluster] nodes did not become idle:" >&2
  "$DIR/on" node1 sinfo >&2 || true
  tail -n 20 "$DIR"/log/*.log >&2 || true
  return 1
}

# The pids whose network namespace is NODE's: everything running "on" that node.
node_pids() { ip netns pids "$(cat "$DIR/netns-prefix")-$1"; }

node_index() { grep -n "^$1\$" "$DIR/nodes" | cut -d: -f1; }

case "$CMD" in
  check)
    reason="$(why_not)"
    if [ -n "$reason" ]; then echo "$reason"; exit 1; fi
    echo "ok" ;;
  up)
    [ -n "$DIR" ] || { echo "usage: $0 up DIR [NODES]" >&2; exit 2; }
    reason="$(why_not)"
    if [ -n "$reason" ]; then echo "cannot run a local SLURM cluster: $reason" >&2; exit 3; fi
    start=$(date +%s.%N)
    mkdir -p "$DIR"; DIR="$(cd "$DIR" && pwd)"
    install_packages || { echo "cannot run a local SLURM cluster: installing slurm with apt-get failed" >&2; exit 4; }
    write_conf "${3:-2}" "${4:-}"
    start_munge
    make_network || { echo "cannot run a local SLURM cluster: network namespaces failed" >&2
                      "$0" down "$DIR"; exit 3; }
    "$DIR/on" "$(cat "$DIR/ctl")" slurmctld
    for node in $(node_names); do "$DIR/on" "$node" slurmd -N "$node"; done
    wait_idle
    echo "[local-cluster] $(node_names | wc -l) nodes up in $(echo "$(date +%s.%N) - $start" | bc 2>/dev/null || echo '?') s: $DIR" ;;
  down)
    [ -n "$DIR" ] && [ -d "$DIR" ] || exit 0
    if [ -f "$DIR/netns-prefix" ] && [ -f "$DIR/nodes" ]; then
      for node in $(node_names) ctl; do      # slurmd, slurmctld, jobs: all on some node
        [ -e "/run/netns/$(cat "$DIR/netns-prefix")-$node" ] || continue
        pids=$(node_pids "$node")
        [ -n "$pids" ] && kill -TERM $pids 2>/dev/null || true
      done
      sleep 0.5
      for node in $(node_names) ctl; do
        [ -e "/run/netns/$(cat "$DIR/netns-prefix")-$node" ] || continue
        pids=$(node_pids "$node")
        [ -n "$pids" ] && kill -KILL $pids 2>/dev/null || true
      done
    fi
    [ -f "$DIR/munged.pid" ] && kill "$(cat "$DIR/munged.pid")" 2>/dev/null || true
    if [ -f "$DIR/netns-prefix" ]; then
      prefix="$(cat "$DIR/netns-prefix")"
      for node in $(node_names 2>/dev/null) ctl; do ip netns del "$prefix-$node" 2>/dev/null || true; done
      ip netns del "$prefix-br" 2>/dev/null || true
    fi ;;
  kill-node)
    node="${3:?usage: $0 kill-node DIR NODE}"
    pids=$(node_pids "$node")
    [ -n "$pids" ] && kill -KILL $pids 2>/dev/null || true
    echo "[local-cluster] $node: killed $(echo $pids | wc -w) processes" ;;
  start-node)
    node="${3:?usage: $0 start-node DIR NODE}"
    pid="$(cat "$DIR/slurmd-$node.pid" 2>/dev/null || true)"
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then exit 0; fi   # it runs already
    "$DIR/on" "$node" slurmd -N "$node" ;;
  link)
    node="${3:?usage: $0 link DIR NODE down|up}"; state="${4:?down or up}"
    ip -n "$(cat "$DIR/netns-prefix")-br" link set "p$(node_index "$node")" "$state" ;;
  *)
    sed -n '2,21p' "$0"; exit 2 ;;
esac
