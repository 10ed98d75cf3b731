#!/usr/bin/env bash
# A 3-node RabbitMQ cluster for tests/cluster/ (docs/operations.md, "Running against a
# cluster"), beside the machine's default broker on 127.0.0.1:5672, which it never touches.
#
# Each node is the Debian rabbitmq-server (3.10.8) in its own Linux network namespace
# (orc-n1..orc-n3), attached to a bridge (orc-br0, 10.77.0.1/24) in the root namespace:
#   node N = rabbit@10.77.0.1N (long names), AMQP 10.77.0.1N:5672, stream 10.77.0.1N:5552
#   (advertised as that address, so the stream protocol's metadata names reachable hosts),
#   Erlang distribution 25672, its own epmd.
# Its own namespace gives each node its own addresses, so a node can be partitioned from
# the other two (blackhole routes between the nodes; the node stays reachable from the
# host, as the minority side of a real partition is for a client next to it).
# Data, logs and configuration are under $OUTBOX_TEST_CLUSTER_STATE
# (/var/lib/outbox-test-rabbitmq-cluster), with a shared Erlang cookie. The cluster
# pauses its minority on a partition (cluster_partition_handling = pause_minority) and
# notices a dead peer within about 10 s (net_ticktime = 10). guest may log in over the
# bridge (loopback_users = none): test credentials only.
#
# Node 4 (orc-n4, rabbit@10.77.0.14, AMQP 10.77.0.14:5672) is a standalone node on the
# same bridge, never joined to the cluster, whose only difference is a lowered
# `frame_max = 16384` (the AMQP 0-9-1 frame size it negotiates; the default is 131072):
# the broker with small frames of the tests of oversized and split frames
# (tests/faults/amqp_edges). `start-small-frames` starts it; `stop` stops it too.
#
# Commands:
#   start               start (and, the first time, join) the three nodes; idempotent
#   start-small-frames  start node 4 (standalone, frame_max = 16384); idempotent
#   stop [--purge]      stop every node, remove the namespaces and bridge (--purge: data too)
#   status              each node's state and the running cluster members
#   env                 the test environment (OUTBOX_TEST_CLUSTER_*), as NAME=value lines
#   kill N              SIGKILL node N's Erlang VM
#   pause N | resume N  SIGSTOP / SIGCONT node N's Erlang VM
#   restart N           stop node N cleanly and start it again
#   start-node N        start node N (after kill or stop) and wait until it runs
#   partition N         cut node N off from the other two (it stays reachable from here)
#   heal                undo every partition
#   leader NAME         the number (1-3) of the node leading quorum queue or stream NAME
#   ctl N ARGS...       rabbitmqctl against node N
#   rss                 the three VMs' resident memory, in MB (each, then the total)
set -euo pipefail

STATE="${OUTBOX_TEST_CLUSTER_STATE:-/var/lib/outbox-test-rabbitmq-cluster}"
BRIDGE=orc-br0
SUBNET_PREFIX=10.77.0
HOST_IP="$SUBNET_PREFIX.1"
NODES=(1 2 3)
# The standalone node with a lowered frame_max (not a cluster member).
SMALL_NODE=4
SMALL_FRAME_MAX=16384
ALL_NODES=(1 2 3 "$SMALL_NODE")
RMQ_BIN=/usr/lib/rabbitmq/bin
AMQP_PORT=5672
STREAM_PORT=5552
COOKIE_HOME="$STATE/home"

log() { printf 'rabbitmq-cluster: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

[ "$(id -u)" = 0 ] || die "must run as root (it creates network namespaces)"
[ -x "$RMQ_BIN/rabbitmq-server" ] || die "$RMQ_BIN/rabbitmq-server is missing: install the Debian package rabbitmq-server"
command -v ip >/dev/null 2>&1 || die "the ip command (iproute2) is missing"

check_n() {
  case "${1:-}" in 1|2|3) ;; *) die "node number must be 1, 2 or 3 (got '${1:-}')" ;; esac
}
# Node numbers that `ctl`, `kill`, `pause`, `resume`, `restart` and `start-node` also
# accept: node 4 too.
check_any() {
  case "${1:-}" in 1|2|3|"$SMALL_NODE") ;; *) die "node number must be 1 to $SMALL_NODE (got '${1:-}')" ;; esac
}
ns() { printf 'orc-n%s' "$1"; }
node_ip() { printf '%s.1%s' "$SUBNET_PREFIX" "$1"; }
node_name() { printf 'rabbit@%s' "$(node_ip "$1")"; }
node_dir() { printf '%s/n%s' "$STATE" "$1"; }

# The environment of every rabbitmq-server / rabbitmqctl run for node N: nothing of
# the machine's broker (its rabbitmq-env.conf names rabbit@localhost and binds the
# distribution to 127.0.0.1), everything in the node's own directory.
node_env() {
  local n="$1" d
  d="$(node_dir "$n")"
  printf '%s\n' \
    "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
    "HOME=$COOKIE_HOME" \
    "LANG=C.UTF-8" "LC_ALL=C.UTF-8" \
    "RABBITMQ_CONF_ENV_FILE=$d/rabbitmq-env.conf" \
    "RABBITMQ_NODENAME=$(node_name "$n")" \
    "RABBITMQ_USE_LONGNAME=true" \
    "RABBITMQ_NODE_PORT=$AMQP_PORT" \
    "RABBITMQ_DIST_PORT=25672" \
    "RABBITMQ_CONFIG_FILE=$d/rabbitmq.conf" \
    "RABBITMQ_ADVANCED_CONFIG_FILE=$d/advanced.config" \
    "RABBITMQ_MNESIA_BASE=$d/mnesia" \
    "RABBITMQ_LOG_BASE=$d/log" \
    "RABBITMQ_PID_FILE=$d/rabbit.pid" \
    "RABBITMQ_ENABLED_PLUGINS_FILE=$d/enabled_plugins" \
    "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS=+sbwt none +sbwtdcpu none +sbwtdio none"
}

# ctl N ARGS: rabbitmqctl against node N, from the root namespace (over the bridge).
ctl() {
  local n="$1"; shift
  local envs
  mapfile -t envs < <(node_env "$n")
  # A paused node never answers: every call has a deadline (CTL_TIMEOUT seconds).
  env -i "${envs[@]}" timeout "${CTL_TIMEOUT:-120}" "$RMQ_BIN/rabbitmqctl" -q -l -n "$(node_name "$n")" "$@"
}

# The Erlang VM of node N (beam.smp in its namespace), or nothing.
beam_pid() {
  local n="$1" pid
  [ -e "/run/netns/$(ns "$n")" ] || return 0
  for pid in $(ip netns pids "$(ns "$n")" 2>/dev/null); do
    if [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = beam.smp ]; then
      printf '%s\n' "$pid"
      return 0
    fi
  done
}

node_up() { CTL_TIMEOUT=10 ctl "$1" await_startup --timeout 2 >/dev/null 2>&1; }

# ---------------------------------------------------------------- network
setup_network() {
  if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
    ip link add "$BRIDGE" type bridge
  fi
  # (Output captured first: grep -q closing the pipe early fails the pipeline.)
  case "$(ip addr show dev "$BRIDGE")" in *"inet $HOST_IP/24"*) ;; *) ip addr add "$HOST_IP/24" dev "$BRIDGE" ;; esac
  ip link set "$BRIDGE" up
  local n
  for n in "${ALL_NODES[@]}"; do
    local name veth
    name="$(ns "$n")"
    veth="orc-v$n"
    [ -e "/run/netns/$name" ] || ip netns add "$name"
    ip -n "$name" link set lo up
    if ! ip link show "$veth" >/dev/null 2>&1; then
      ip link add "$veth" type veth peer name eth0 netns "$name"
      ip link set "$veth" master "$BRIDGE"
    fi
    ip link set "$veth" up
    case "$(ip -n "$name" addr show dev eth0)" in
      *"inet $(node_ip "$n")/24"*) ;;
      *) ip -n "$name" addr add "$(node_ip "$n")/24" dev eth0 ;;
    esac
    ip -n "$name" link set eth0 up
  done
}

teardown_network() {
  local n
  for n in "${ALL_NODES[@]}"; do
    ip link del "orc-v$n" >/dev/null 2>&1 || true
    ip netns del "$(ns "$n")" >/dev/null 2>&1 || true
  done
  ip link del "$BRIDGE" >/dev/null 2>&1 || true
}

# ---------------------------------------------------------------- configuration
write_config() {
  local n="$1" d
  d="$(node_dir "$n")"
  mkdir -p "$d/mnesia" "$d/log"
  : > "$d/rabbitmq-env.conf"
  printf '[rabbitmq_stream].\n' > "$d/enabled_plugins"
  cat > "$d/rabbitmq.conf" <<EOF
# Written by outbox-relay scripts/rabbitmq-cluster.sh (test cluster, node $n)
listeners.tcp.default = $AMQP_PORT
stream.listeners.tcp.default = $STREAM_PORT
stream.advertised_host = $(node_ip "$n")
stream.advertised_port = $STREAM_PORT
loopback_users = none
cluster_partition_handling = pause_minority
disk_free_limit.absolute = 50MB
log.console = false
log.file.level = info
EOF
  if [ "$n" = "$SMALL_NODE" ]; then
    printf 'frame_max = %s\n' "$SMALL_FRAME_MAX" >> "$d/rabbitmq.conf"
  fi
  cat > "$d/advanced.config" <<'EOF'
[{kernel, [{net_ticktime, 10}]}].
EOF
}

write_cookie() {
  mkdir -p "$COOKIE_HOME"
  if [ ! -s "$COOKIE_HOME/.erlang.cookie" ]; then
    (umask 077; head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$COOKIE_HOME/.erlang.cookie")
  fi
  chmod 400 "$COOKIE_HOME/.erlang.cookie"
}

# ---------------------------------------------------------------- nodes
launch_node() {
  local n="$1" envs
  [ -n "$(beam_pid "$n")" ] && return 0
  write_config "$n"
  mapfile -t envs < <(node_env "$n")
  # setsid: the node outlives this script and is in no terminal's process group.
  ip netns exec "$(ns "$n")" setsid env -i "${envs[@]}" "$RMQ_BIN/rabbitmq-server" \
    >>"$(node_dir "$n")/log/startup.log" 2>&1 </dev/null &
}

wait_node() {
  local n="$1" i
  for i in $(seq 1 120); do
    if node_up "$n"; then return 0; fi
    [ -n "$(beam_pid "$n")" ] || { sleep 1; [ -n "$(beam_pid "$n")" ] || die "node $n exited while starting (see $(node_dir "$n")/log)"; }
    sleep 0.5
  done
  die "node $n did not start within 60 s (see $(node_dir "$n")/log)"
}

# The nodes the cluster (as node 1 sees it) has as members.
members() {
  ctl 1 cluster_status --formatter json 2>/dev/null |
    python3 -c 'import json,sys; print("\n".join(json.load(sys.stdin).get("disk_nodes", [])))'
}
running_members() {
  ctl "$1" cluster_status --formatter json 2>/dev/null |
    python3 -c 'import json,sys; print("\n".join(json.load(sys.stdin).get("running_nodes", [])))'
}

cmd_start() {
  local started n
  started=$(date +%s)
  mkdir -p "$STATE"
  write_cookie
  setup_network
  for n in "${NODES[@]}"; do launch_node "$n"; done
  # Clustered nodes wait for each other while they boot: wait for all three together.
  for n in "${NODES[@]}"; do wait_node "$n"; done
  local m
  m="$(members)"
  for n in 2 3; do
    if ! grep -qx "$(node_name "$n")" <<<"$m"; then
      log "joining node $n to $(node_name 1)"
      # (The CLI reports the join's transient errors on stderr: kept in join.log.)
      {
        ctl "$n" stop_app && ctl "$n" reset && ctl "$n" join_cluster "$(node_name 1)" &&
          ctl "$n" start_app
      } >>"$STATE/join.log" 2>&1 || die "node $n could not join the cluster (see $STATE/join.log)"
      wait_node "$n"
    fi
  done
  local running
  running="$(running_members 1 | wc -l)"
  [ "$running" = 3 ] || die "the cluster runs $running of 3 nodes"
  log "3 nodes running ($(( $(date +%s) - started )) s)"
}

# start-small-frames: node 4, standalone, frame_max lowered; idempotent. A node that
# runs with another frame_max (an older configuration) is restarted with this one.
cmd_start_small_frames() {
  local n="$SMALL_NODE" cur
  mkdir -p "$STATE"
  write_cookie
  setup_network
  if [ -n "$(beam_pid "$n")" ]; then
    cur="$(CTL_TIMEOUT=15 ctl "$n" eval 'application:get_env(rabbit, frame_max).' 2>/dev/null || true)"
    if [ "$cur" != "{ok,$SMALL_FRAME_MAX}" ]; then
      log "node $n runs with frame_max $cur: restarting it with $SMALL_FRAME_MAX"
      stop_node "$n"
    fi
  fi
  launch_node "$n"
  wait_node "$n"
  log "node $n (standalone, frame_max $SMALL_FRAME_MAX) running"
}

stop_node() {
  local n="$1" pid i
  pid="$(beam_pid "$n")"
  [ -n "$pid" ] || return 0
  kill -CONT "$pid" 2>/dev/null || true
  ctl "$n" stop >/dev/null 2>&1 || true
  for i in $(seq 1 60); do
    [ -n "$(beam_pid "$n")" ] || return 0
    sleep 0.5
  done
  log "node $n did not stop within 30 s: killing it"
  kill -KILL "$pid" 2>/dev/null || true
}

cmd_stop() {
  local purge="${1:-}" n pid
  if [ -n "$purge" ] && [ "$purge" != --purge ]; then die "usage: stop [--purge]"; fi
  cmd_heal >/dev/null 2>&1 || true
  # Stop the three in parallel (a clustered node's stop waits for nothing of its peers).
  for n in "${ALL_NODES[@]}"; do stop_node "$n" & done
  wait
  # What else runs in the namespaces (epmd, the VM's port programs).
  for n in "${ALL_NODES[@]}"; do
    if [ -e "/run/netns/$(ns "$n")" ]; then
      for pid in $(ip netns pids "$(ns "$n")" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null || true; done
    fi
  done
  sleep 0.2
  teardown_network
  if [ "$purge" = --purge ]; then
    rm -rf "$STATE"
    log "stopped and purged $STATE"
  else
    log "stopped"
  fi
}

cmd_status() {
  local n pid
  for n in "${NODES[@]}"; do
    pid="$(beam_pid "$n")"
    if [ -z "$pid" ]; then
      echo "node $n $(node_name "$n"): down"
    elif [ "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" = T ]; then
      echo "node $n $(node_name "$n"): paused (pid $pid)"
    elif node_up "$n"; then
      echo "node $n $(node_name "$n"): running (pid $pid)"
    else
      echo "node $n $(node_name "$n"): not ready (pid $pid)"
    fi
  done
  for n in "${NODES[@]}"; do
    if node_up "$n"; then
      echo "running members (as node $n sees them): $(running_members "$n" | tr '\n' ' ')"
      return 0
    fi
  done
  echo "no node answers"
  return 1
}

cmd_env() {
  local amqp="" stream="" n
  for n in "${NODES[@]}"; do
    amqp="$amqp${amqp:+,}amqp://guest:guest@$(node_ip "$n"):$AMQP_PORT/%2f"
    stream="$stream${stream:+,}rabbitmq-stream://guest:guest@$(node_ip "$n"):$STREAM_PORT/%2f"
  done
  echo "OUTBOX_TEST_CLUSTER_AMQP_URLS=$amqp"
  echo "OUTBOX_TEST_CLUSTER_STREAM_URLS=$stream"
  echo "OUTBOX_TEST_SMALL_FRAME_AMQP=amqp://guest:guest@$(node_ip "$SMALL_NODE"):$AMQP_PORT/%2f"
  echo "OUTBOX_TEST_SMALL_FRAME_MAX=$SMALL_FRAME_MAX"
  echo "OUTBOX_TEST_CLUSTER_SCRIPT=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/rabbitmq-cluster.sh"
}

signal_node() {
  local sig="$1" n="$2" pid
  check_any "$n"
  pid="$(beam_pid "$n")"
  [ -n "$pid" ] || die "node $n is not running"
  kill "-$sig" "$pid"
}

cmd_start_node() {
  local n="$1"
  check_any "$n"
  launch_node "$n"
  wait_node "$n"
}

cmd_restart() {
  local n="$1"
  check_any "$n"
  stop_node "$n"
  cmd_start_node "$n"
}

# partition N: blackhole routes between node N and the other two, both ways. The host
# (10.77.0.1) still reaches every node.
cmd_partition() {
  local n="$1" m
  check_n "$n"
  for m in "${NODES[@]}"; do
    [ "$m" = "$n" ] && continue
    ip -n "$(ns "$n")" route replace blackhole "$(node_ip "$m")/32"
    ip -n "$(ns "$m")" route replace blackhole "$(node_ip "$n")/32"
  done
}

cmd_heal() {
  local n m
  for n in "${NODES[@]}"; do
    [ -e "/run/netns/$(ns "$n")" ] || continue
    for m in "${NODES[@]}"; do
      ip -n "$(ns "$n")" route del blackhole "$(node_ip "$m")/32" >/dev/null 2>&1 || true
    done
  done
}

# leader NAME: asks the first node that answers which node leads queue/stream NAME
# (in the default vhost). Evaluated on the node itself: list_queues would stream
# other nodes' answers to the CLI's own Erlang node, which the nodes cannot reach
# from their namespaces. A quorum queue's leader comes from Raft (ra:members), a
# stream's from its writer process as the stream coordinator recorded it.
cmd_leader() {
  local name="$1" n leader
  case "$name" in *[!A-Za-z0-9._-]*|"") die "leader: unexpected queue name '$name'" ;; esac
  local expr="case rabbit_amqqueue:lookup(rabbit_misc:r(<<\"/\">>, queue, <<\"$name\">>)) of
    {ok, Q} -> case amqqueue:get_pid(Q) of
      {RaName, N} when is_atom(N) -> case ra:members({RaName, N}) of {ok, _, {_, L}} -> L; _ -> N end;
      P when is_pid(P) -> node(P);
      _ -> none end;
    _ -> none end."
  for n in "${NODES[@]}"; do
    [ -n "$(beam_pid "$n")" ] || continue
    [ "$(awk '{print $3}' "/proc/$(beam_pid "$n")/stat" 2>/dev/null)" = T ] && continue
    leader="$(CTL_TIMEOUT=15 ctl "$n" eval "$expr" 2>/dev/null)" || continue
    case "$leader" in
      "'rabbit@$SUBNET_PREFIX.1"[123]"'") echo "${leader:(-2):1}"; return 0 ;;
    esac
  done
  die "no node knows a leader of $name"
}

cmd_rss() {
  local n pid kb total=0
  for n in "${NODES[@]}"; do
    pid="$(beam_pid "$n")"
    kb=0
    [ -n "$pid" ] && kb="$(awk '/^VmRSS:/ {print $2}' "/proc/$pid/status" 2>/dev/null || echo 0)"
    echo "node $n: $((kb / 1024)) MB"
    total=$((total + kb))
  done
  echo "total: $((total / 1024)) MB"
}

cmd="${1:-}"
[ $# -gt 0 ] && shift
case "$cmd" in
  start) cmd_start ;;
  start-small-frames) cmd_start_small_frames ;;
  stop) cmd_stop "${1:-}" ;;
  status) cmd_status ;;
  env) cmd_env ;;
  kill) signal_node KILL "${1:-}" ;;
  pause) signal_node STOP "${1:-}" ;;
  resume) signal_node CONT "${1:-}" ;;
  restart) cmd_restart "${1:-}" ;;
  start-node) cmd_start_node "${1:-}" ;;
  partition) cmd_partition "${1:-}" ;;
  heal) cmd_heal ;;
  leader) [ $# -ge 1 ] || die "usage: leader QUEUE_OR_STREAM"; cmd_leader "$1" ;;
  ctl) n="${1:-}"; check_any "$n"; shift; ctl "$n" "$@" ;;
  rss) cmd_rss ;;
  *) die "usage: $0 start|start-small-frames|stop [--purge]|status|env|kill N|pause N|resume N|restart N|start-node N|partition N|heal|leader NAME|ctl N ARGS...|rss" ;;
esac
