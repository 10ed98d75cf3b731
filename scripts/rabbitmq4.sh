#!/usr/bin/env bash
# The second broker of the test matrix: RabbitMQ 4.x from Debian 13's package, beside the
# machine's 3.10 node (Debian 12 ships 3.10 only; 4.x needs Debian 13's Erlang 27 and libc,
# so it lives in a Debian 13 root made with debootstrap, never in the system).
#
#   root        $OUTBOX_TEST_RABBITMQ4_STATE/root (/var/lib/outbox-test-rabbitmq4/root), built
#               once (about a minute) and kept: CI's clean clones reuse it
#   node        outbox4@<short hostname>, Erlang distribution on 25682, the host's epmd
#   ports       AMQP 5682, AMQPS 5681, stream 5562, stream TLS 5561, management HTTP 15682
#               and HTTPS 15681, all on 127.0.0.1 (TLS with the 3.10 node's test CA and
#               server certificate, copied into the root, so one CA file verifies both)
#   plugins     stream, management, consistent-hash exchange, EXTERNAL (certificate login)
#   rabbitmqctl $OUTBOX_TEST_RABBITMQ4_STATE/bin/rabbitmqctl runs the root's CLI against the
#               node (the 3.10 CLI cannot talk to a 4.x node)
#
# Commands:
#   start   build the root (first time), configure and start the node; idempotent
#   stop    stop the node
#   env     the environment of a test run against this broker (scripts/test.sh's 4.x pass)
#   ctl ARGS...  rabbitmqctl against the node
set -euo pipefail

STATE="${OUTBOX_TEST_RABBITMQ4_STATE:-/var/lib/outbox-test-rabbitmq4}"
ROOT="$STATE/root"
MIRROR="${OUTBOX_TEST_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
NODE="outbox4@$(hostname -s)"
DIST_PORT=25682
AMQP_PORT=5682
AMQPS_PORT=5681
STREAM_PORT=5562
STREAM_TLS_PORT=5561
MANAGEMENT_PORT=15682
MANAGEMENT_TLS_PORT=15681
# The 3.10 node's test CA and server certificate (scripts/test-services.sh).
HOST_CERTS=/etc/rabbitmq/outbox-test-certs
CTL="$STATE/bin/rabbitmqctl"

log() { printf 'rabbitmq4: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

[ "$(id -u)" = 0 ] || die "must run as root (it builds and enters a chroot)"

in_root() { chroot "$ROOT" env HOME=/var/lib/rabbitmq LANG=C.UTF-8 "$@"; }

build_root() {
  [ -f "$ROOT/.outbox-ready" ] && return 0
  command -v debootstrap >/dev/null 2>&1 || {
    log "installing debootstrap"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null ||
      { apt-get update -qq >/dev/null; DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null; }
  }
  log "building a Debian 13 root with rabbitmq-server in $ROOT (once; about a minute)"
  umount "$ROOT/proc" 2>/dev/null || true
  rm -rf "$ROOT"
  mkdir -p "$ROOT"
  debootstrap --variant=minbase --include=rabbitmq-server trixie "$ROOT" "$MIRROR" \
    >"$STATE/debootstrap.log" 2>&1 || die "debootstrap failed (see $STATE/debootstrap.log)"
  mount_proc
  in_root rabbitmq-plugins enable --offline rabbitmq_stream rabbitmq_management \
    rabbitmq_consistent_hash_exchange rabbitmq_auth_mechanism_ssl >/dev/null
  touch "$ROOT/.outbox-ready"
}

mount_proc() { mountpoint -q "$ROOT/proc" || mount -t proc proc "$ROOT/proc"; }

write_config() {
  mkdir -p "$ROOT/etc/rabbitmq/certs" "$STATE/bin"
  [ -f "$HOST_CERTS/server.crt" ] || die "$HOST_CERTS holds no test certificates: run scripts/test-services.sh"
  cp "$HOST_CERTS/ca.crt" "$HOST_CERTS/server.crt" "$HOST_CERTS/server.key" "$ROOT/etc/rabbitmq/certs/"
  chmod 644 "$ROOT/etc/rabbitmq/certs/"*.crt
  chmod 600 "$ROOT/etc/rabbitmq/certs/server.key"
  # The node runs as the root's rabbitmq user (its start script drops root).
  in_root chown -R rabbitmq:rabbitmq /etc/rabbitmq/certs
  cat > "$ROOT/etc/rabbitmq/rabbitmq-env.conf" <<EOF
# Written by outbox-relay scripts/rabbitmq4.sh
NODENAME=$NODE
DIST_PORT=$DIST_PORT
EOF
  cat > "$ROOT/etc/rabbitmq/rabbitmq.conf" <<EOF
# Written by outbox-relay scripts/rabbitmq4.sh: the test matrix's RabbitMQ 4.x node
listeners.tcp.default = 127.0.0.1:$AMQP_PORT
listeners.ssl.default = 127.0.0.1:$AMQPS_PORT
stream.listeners.tcp.1 = 127.0.0.1:$STREAM_PORT
stream.listeners.ssl.1 = 127.0.0.1:$STREAM_TLS_PORT
stream.advertised_host = localhost
management.tcp.port = $MANAGEMENT_PORT
management.tcp.ip = 127.0.0.1
management.ssl.port = $MANAGEMENT_TLS_PORT
management.ssl.ip = 127.0.0.1
management.ssl.cacertfile = /etc/rabbitmq/certs/ca.crt
management.ssl.certfile = /etc/rabbitmq/certs/server.crt
management.ssl.keyfile = /etc/rabbitmq/certs/server.key
ssl_options.cacertfile = /etc/rabbitmq/certs/ca.crt
ssl_options.certfile = /etc/rabbitmq/certs/server.crt
ssl_options.keyfile = /etc/rabbitmq/certs/server.key
ssl_options.verify = verify_peer
ssl_options.fail_if_no_peer_cert = false
auth_mechanisms.1 = PLAIN
auth_mechanisms.2 = AMQPLAIN
auth_mechanisms.3 = EXTERNAL
ssl_cert_login_from = common_name
EOF
  cat > "$CTL" <<EOF
#!/bin/sh
# Written by outbox-relay scripts/rabbitmq4.sh: rabbitmqctl against the RabbitMQ 4.x test node.
exec chroot "$ROOT" env HOME=/var/lib/rabbitmq LANG=C.UTF-8 rabbitmqctl -n "$NODE" "\$@"
EOF
  chmod 755 "$CTL"
}

node_ok() { "$CTL" -q await_startup --timeout 5 >/dev/null 2>&1; }
# The node's Erlang VMs: its command line does not name the node (RabbitMQ 4 sets the
# name at runtime), so they are told apart from the 3.10 nodes' by their root.
node_pids() {
  local p
  for p in $(pgrep -x beam.smp 2>/dev/null); do
    [ "$(readlink "/proc/$p/root" 2>/dev/null)" = "$ROOT" ] && echo "$p"
  done
  return 0
}
port_ok() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

cmd_start() {
  mkdir -p "$STATE"
  build_root
  mount_proc
  # A changed configuration needs a restart: compare with what the running node read.
  local before after
  before="$(cat "$ROOT/etc/rabbitmq/rabbitmq.conf" "$ROOT/etc/rabbitmq/rabbitmq-env.conf" 2>/dev/null || true)"
  write_config
  after="$(cat "$ROOT/etc/rabbitmq/rabbitmq.conf" "$ROOT/etc/rabbitmq/rabbitmq-env.conf")"
  if node_ok && [ "$before" != "$after" ]; then
    log "configuration changed; restarting $NODE"
    cmd_stop
  fi
  if ! node_ok && [ -n "$(node_pids)" ]; then
    # Running with its app stopped (a test's stop_app whose process was killed).
    log "starting the RabbitMQ app of $NODE"
    "$CTL" -q start_app >/dev/null 2>&1 || true
    for _ in $(seq 1 60); do node_ok && break; sleep 1; done
    node_ok || { log "$NODE does not answer; killing it"; kill -9 $(node_pids) 2>/dev/null || true; sleep 2; }
  fi
  if ! node_ok; then
    log "starting RabbitMQ 4 node $NODE"
    setsid chroot "$ROOT" env HOME=/var/lib/rabbitmq LANG=C.UTF-8 rabbitmq-server \
      >"$STATE/server.log" 2>&1 < /dev/null &
    for _ in $(seq 1 120); do node_ok && break; sleep 1; done
    node_ok || die "RabbitMQ 4 did not start (see $STATE/server.log and $ROOT/var/log/rabbitmq/)"
  fi
  # The test run's memory-alarm tests restore the watermark on drop; a killed test
  # process cannot, so put back the default if it was left at 0.
  if "$CTL" -q environment 2>/dev/null | grep -qE '\{vm_memory_high_watermark,\s*(\{relative,\s*)?0(\.0)?\}'; then
    log "memory alarm left set on $NODE; restoring the default watermark"
    "$CTL" -q set_vm_memory_high_watermark 0.6 >/dev/null
  fi
  if ! "$CTL" -q list_users 2>/dev/null | grep -q '^outbox-relay-external\b'; then
    "$CTL" -q add_user outbox-relay-external "unused-$(openssl rand -hex 16)" >/dev/null
    "$CTL" -q clear_password outbox-relay-external >/dev/null
  fi
  "$CTL" -q set_permissions -p / outbox-relay-external '.*' '.*' '.*' >/dev/null
  local p
  for p in $AMQP_PORT $AMQPS_PORT $STREAM_PORT $STREAM_TLS_PORT $MANAGEMENT_PORT $MANAGEMENT_TLS_PORT; do
    for _ in $(seq 1 60); do port_ok "$p" && break; sleep 1; done
    port_ok "$p" || die "RabbitMQ 4 port $p does not accept connections"
  done
  log "RabbitMQ $("$CTL" -q eval 'rabbit_misc:version().' 2>/dev/null | tr -d '"') ready as $NODE"
}

cmd_stop() {
  "$CTL" -q shutdown >/dev/null 2>&1 || true
  for _ in $(seq 1 30); do [ -z "$(node_pids)" ] && break; sleep 1; done
  local left
  left="$(node_pids)"
  [ -z "$left" ] || kill -9 $left 2>/dev/null || true
}

cmd_env() {
  cat <<EOF
OUTBOX_TEST_BROKER=rabbitmq-4
OUTBOX_TEST_RABBITMQCTL=$CTL
OUTBOX_TEST_AMQP=amqp://guest:guest@127.0.0.1:$AMQP_PORT/%2f
OUTBOX_TEST_AMQPS=amqps://guest:guest@localhost:$AMQPS_PORT/%2f
OUTBOX_TEST_MANAGEMENT_URL=http://127.0.0.1:$MANAGEMENT_PORT
OUTBOX_TEST_MANAGEMENT_TLS_URL=https://localhost:$MANAGEMENT_TLS_PORT
OUTBOX_TEST_STREAM_URL=rabbitmq-stream://guest:guest@127.0.0.1:$STREAM_PORT/%2f
OUTBOX_TEST_STREAM_TLS_URL=rabbitmq-stream+tls://guest:guest@localhost:$STREAM_TLS_PORT/%2f
EOF
}

cmd="${1:-}"
shift || true
case "$cmd" in
  start) cmd_start ;;
  stop) cmd_stop ;;
  env) cmd_env ;;
  ctl) exec "$CTL" "$@" ;;
  *) die "usage: $0 start|stop|env|ctl ARGS..." ;;
esac
