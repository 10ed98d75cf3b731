#!/usr/bin/env bash
# Prepares every service the test suite needs, idempotently, on a fresh machine or one
# where they already run:
#   * a Postgres cluster of the tests' own ("outbox_test", port 55432 by default) with
#     wal_level=logical, TLS (a CA and server certificate generated here) and pg_hba
#     lines for SCRAM/md5/password test roles; started if stopped;
#   * the machine's RabbitMQ on 127.0.0.1:5672 (guest/guest); started if stopped;
#   * a 3-node RabbitMQ cluster in network namespaces (scripts/rabbitmq-cluster.sh,
#     OUTBOX_TEST_CLUSTER_*), for tests/cluster/;
#   * beside it, a standalone RabbitMQ node with frame_max = 16384 (node 4 of
#     scripts/rabbitmq-cluster.sh, OUTBOX_TEST_SMALL_FRAME_AMQP), for
#     tests/faults/amqp_edges;
#   * RabbitMQ 4.x from Debian 13's package in a debootstrap root, beside the 3.10 node
#     on ports of its own (scripts/rabbitmq4.sh), for the broker matrix's second pass
#     (scripts/test.sh; its environment in target/rabbitmq4.env);
#   * the build tools and the checks' tools (installed from Debian when missing).
# Prints the environment the tests read (OUTBOX_TEST_PG_*), and writes it to
# target/test-services.env as well.
set -euo pipefail

PORT="${OUTBOX_TEST_PG_PORT:-55432}"
NAME="${OUTBOX_TEST_PG_CLUSTER:-outbox_test}"
FAULT_PORT="${OUTBOX_TEST_FAULT_PG_PORT:-55433}"
FAULT_NAME="outbox_fault"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

log() { printf 'test-services: %s\n' "$*" >&2; }

need_pkg() {
  local bin="$1" pkg="$2"
  if ! command -v "$bin" >/dev/null 2>&1; then
    log "installing $pkg"
    if [ -z "${APT_UPDATED:-}" ]; then apt-get update -qq >/dev/null; APT_UPDATED=1; fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$pkg" >/dev/null
  fi
}

# The build: the C parts of dependencies (ring's assembly, jemalloc, the relay's
# allocator) need a C compiler and make.
need_pkg cc gcc
need_pkg make make
need_pkg pg_createcluster postgresql
need_pkg openssl openssl
# tests/security/metrics_endpoint.rs fetches the HTTPS metrics endpoint with curl.
need_pkg curl curl
need_pkg rabbitmqctl rabbitmq-server
# The 3-node cluster's network namespaces and bridge (scripts/rabbitmq-cluster.sh).
need_pkg ip iproute2
# For the checks and tests that run Python (PyYAML, kubernetes-validate, the
# CloudEvents SDK, installed by pip on first use) and render the diagrams.
need_pkg python3 python3
if ! python3 -m pip --version >/dev/null 2>&1; then
  need_pkg pip3 python3-pip
fi
need_pkg dot graphviz

VERSION="$(ls /usr/lib/postgresql | sort -V | tail -n 1)"
PGBIN="/usr/lib/postgresql/$VERSION/bin"

# make_test_certs DIR CA_NAME OWNER: once, a test CA and a server certificate for
# localhost / 127.0.0.1 signed by it, in DIR, readable by OWNER only where secret.
make_test_certs() {
  local DIR="$1" CA_NAME="$2" OWNER="$3"
  [ -f "$DIR/server.crt" ] && return 0
  log "generating a test CA and server certificate in $DIR"
  mkdir -p "$DIR"
  openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=$CA_NAME" \
    -keyout "$DIR/ca.key" -out "$DIR/ca.crt" >/dev/null 2>&1
  openssl req -newkey rsa:2048 -nodes -subj "/CN=localhost" \
    -keyout "$DIR/server.key" -out "$DIR/server.csr" >/dev/null 2>&1
  printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\n' > "$DIR/san.ext"
  openssl x509 -req -in "$DIR/server.csr" -CA "$DIR/ca.crt" -CAkey "$DIR/ca.key" \
    -CAcreateserial -days 3650 -extfile "$DIR/san.ext" -out "$DIR/server.crt" >/dev/null 2>&1
  chown -R "$OWNER:$OWNER" "$DIR"
  chmod 600 "$DIR/server.key" "$DIR/ca.key"
  chmod 644 "$DIR/ca.crt" "$DIR/server.crt"
  chmod 755 "$DIR"
}

# make_client_cert DIR NAME CN OWNER: once, a client certificate with common name CN
# signed by DIR's test CA, as DIR/NAME.crt and DIR/NAME.key (0600, OWNER's).
make_client_cert() {
  local DIR="$1" NAME="$2" CN="$3" OWNER="$4"
  [ -f "$DIR/$NAME.crt" ] && return 0
  log "generating client certificate $NAME (CN=$CN) in $DIR"
  openssl req -newkey rsa:2048 -nodes -subj "/CN=$CN" \
    -keyout "$DIR/$NAME.key" -out "$DIR/$NAME.csr" >/dev/null 2>&1
  printf 'extendedKeyUsage=clientAuth\n' > "$DIR/$NAME.ext"
  openssl x509 -req -in "$DIR/$NAME.csr" -CA "$DIR/ca.crt" -CAkey "$DIR/ca.key" \
    -CAcreateserial -days 3650 -extfile "$DIR/$NAME.ext" -out "$DIR/$NAME.crt" >/dev/null 2>&1
  chown "$OWNER:$OWNER" "$DIR/$NAME.crt" "$DIR/$NAME.key"
  chmod 600 "$DIR/$NAME.key"
  chmod 644 "$DIR/$NAME.crt"
}

# ---------------------------------------------------------------- Postgres clusters
# setup_cluster NAME PORT: creates (once), configures and starts a cluster.
setup_cluster() {
local NAME="$1" PORT="$2"
local DATA="/var/lib/postgresql/$VERSION/$NAME"
local CONF="/etc/postgresql/$VERSION/$NAME"
if [ ! -d "$CONF" ]; then
  log "creating cluster $VERSION/$NAME on port $PORT"
  pg_createcluster "$VERSION" "$NAME" --port "$PORT" -- --auth=trust >/dev/null
fi

local CERTS="$CONF/certs"
make_test_certs "$CERTS" "outbox-relay test CA" postgres
# Client certificates for the roles of the cert lines of pg_hba.conf below (the
# tests of sslcert/sslkey/sslpassword); read by the tests, which run as root.
make_client_cert "$CERTS" client-cert outbox_cert_client root
make_client_cert "$CERTS" client-certpw outbox_certpw_client root

cat > "$CONF/conf.d/outbox-test.conf" <<CONFEOF
# Written by outbox-relay scripts/test-services.sh
listen_addresses = '127.0.0.1'
port = $PORT
wal_level = logical
max_replication_slots = 200
max_wal_senders = 200
max_connections = 400
max_prepared_transactions = 20
wal_sender_timeout = '10s'
fsync = off
full_page_writes = off
shared_buffers = '256MB'
max_wal_size = '2GB'
ssl = on
ssl_cert_file = '$CERTS/server.crt'
ssl_key_file = '$CERTS/server.key'
# Client certificates are verified against the test CA (pg_hba.conf cert lines).
ssl_ca_file = '$CERTS/ca.crt'
password_encryption = 'scram-sha-256'
log_min_messages = warning
CONFEOF
chown postgres:postgres "$CONF/conf.d/outbox-test.conf"

cat > "$CONF/pg_hba.conf" <<HBAEOF
# Written by outbox-relay scripts/test-services.sh
local all postgres trust
local all all trust
host all +outbox_auth_scram 127.0.0.1/32 scram-sha-256
host all +outbox_auth_md5 127.0.0.1/32 md5
host all +outbox_auth_password 127.0.0.1/32 password
hostssl all +outbox_auth_tls 127.0.0.1/32 scram-sha-256
hostnossl all +outbox_auth_tls 127.0.0.1/32 reject
hostssl all outbox_cert_client 127.0.0.1/32 cert
hostssl all outbox_certpw_client 127.0.0.1/32 scram-sha-256 clientcert=verify-full
hostnossl all outbox_cert_client,outbox_certpw_client 127.0.0.1/32 reject
host all all 127.0.0.1/32 trust
host all all ::1/128 trust
HBAEOF
chown postgres:postgres "$CONF/pg_hba.conf"

local status_line cur wal
status_line="$(pg_lsclusters --no-header | awk -v v="$VERSION" -v n="$NAME" '$1==v && $2==n {print $4}')"
if [ "$status_line" != "online" ]; then
  log "starting cluster $VERSION/$NAME"
  pg_ctlcluster --skip-systemctl-redirect "$VERSION" "$NAME" start
else
  # Pick up configuration changes (wal_level needs a restart).
  cur="$(su postgres -c "psql -XAtq -p $PORT -h 127.0.0.1 -c 'show wal_level'" 2>/dev/null || true)"
  if [ "$cur" != "logical" ]; then
    pg_ctlcluster --skip-systemctl-redirect "$VERSION" "$NAME" restart -m fast
  else
    su postgres -c "psql -XAtq -p $PORT -h 127.0.0.1 -c 'select pg_reload_conf()'" >/dev/null
  fi
fi

for i in $(seq 1 60); do
  if su postgres -c "psql -XAtq -p $PORT -h 127.0.0.1 -c 'select 1'" >/dev/null 2>&1; then break; fi
  sleep 0.5
done
su postgres -c "psql -XAtq -p $PORT -h 127.0.0.1" >/dev/null <<'SQLEOF'
DO $$ BEGIN
  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'outbox_auth_scram') THEN CREATE ROLE outbox_auth_scram NOLOGIN; END IF;
  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'outbox_auth_md5') THEN CREATE ROLE outbox_auth_md5 NOLOGIN; END IF;
  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'outbox_auth_password') THEN CREATE ROLE outbox_auth_password NOLOGIN; END IF;
  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'outbox_auth_tls') THEN CREATE ROLE outbox_auth_tls NOLOGIN; END IF;
  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'outbox_cert_client') THEN CREATE ROLE outbox_cert_client LOGIN REPLICATION; END IF;
  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'outbox_certpw_client') THEN CREATE ROLE outbox_certpw_client LOGIN REPLICATION; END IF;
END $$;
SET password_encryption = 'scram-sha-256';
ALTER ROLE outbox_certpw_client PASSWORD 'outbox-certpw-test';
SQLEOF
wal="$(su postgres -c "psql -XAtq -p $PORT -h 127.0.0.1 -c 'show wal_level'")"
[ "$wal" = "logical" ] || { log "cluster is not at wal_level=logical"; exit 1; }

}

setup_cluster "$NAME" "$PORT"
# A second cluster for fault tests that restart or crash Postgres, so that they
# never disturb the tests running on the first one.
setup_cluster "$FAULT_NAME" "$FAULT_PORT"

# ---------------------------------------------------------------- RabbitMQ
rabbit_ok() { rabbitmqctl -q await_startup --timeout 5 >/dev/null 2>&1; }
if ! rabbit_ok; then
  log "starting RabbitMQ"
  if ! pgrep -f 'beam.*rabbit' >/dev/null 2>&1; then
    rabbitmq-server -detached >/dev/null 2>&1 || true
  else
    rabbitmqctl start_app >/dev/null 2>&1 || true
  fi
  for i in $(seq 1 60); do rabbit_ok && break; sleep 1; done
  rabbit_ok || { log "RabbitMQ did not start"; exit 1; }
fi
# A test that sets a memory alarm restores it on drop; a test process killed outright
# cannot, so put back the configured watermark if one was left at 0.
cur_wm="$(rabbitmqctl -q environment 2>/dev/null | grep -o '{vm_memory_high_watermark,[^}]*}' | head -n1 || true)"
if printf '%s' "$cur_wm" | grep -qE ',0(\.0)?}'; then
  conf_wm="$(grep -E '^\s*vm_memory_high_watermark\.relative' /etc/rabbitmq/rabbitmq.conf 2>/dev/null | sed 's/.*=\s*//' | head -n1)"
  log "RabbitMQ memory alarm was left set; restoring watermark ${conf_wm:-0.4}"
  rabbitmqctl -q set_vm_memory_high_watermark "${conf_wm:-0.4}" >/dev/null
fi

# The stream protocol (port 5552) for the stream target's tests. Enabling an enabled
# plugin changes nothing, so this is safe to run again.
STREAM_PORT=5552
if ! rabbitmq-plugins -q is_enabled rabbitmq_stream >/dev/null 2>&1; then
  log "enabling the RabbitMQ stream plugin"
  rabbitmq-plugins -q enable rabbitmq_stream >/dev/null
fi

# The consistent-hash exchange, for the benchmark harness's per-aggregate drain over
# several queues (bench/src/scenarios/drain.rs, `drain-aggregate-hash`). Enabled online.
if ! rabbitmq-plugins -q is_enabled rabbitmq_consistent_hash_exchange >/dev/null 2>&1; then
  log "enabling the RabbitMQ plugin rabbitmq_consistent_hash_exchange"
  rabbitmq-plugins -q enable rabbitmq_consistent_hash_exchange >/dev/null
fi

# The management plugin (HTTP API on 127.0.0.1:15672), read by `check --routes` for
# the broker's own bindings (tests/cli/routes.rs). Enabled online.
MANAGEMENT_PORT=15672
if ! rabbitmq-plugins -q is_enabled rabbitmq_management >/dev/null 2>&1; then
  log "enabling the RabbitMQ plugin rabbitmq_management"
  rabbitmq-plugins -q enable rabbitmq_management >/dev/null
fi

# TLS listeners (AMQPS 5671, stream 5551, management HTTPS 15671) with a test CA, for the tests of
# rabbitmq-stream+tls:// and amqps://. A changed rabbitmq.conf needs a node restart,
# so the block is written (and the node restarted) only when it is missing or differs.
# A client that presents a certificate must have one of the test CA's (verify_peer;
# clients without one are still accepted), and may log in with EXTERNAL as the user
# its certificate's common name names (plugin rabbitmq_auth_mechanism_ssl, enabled
# online, and the user outbox-relay-external, below).
if ! rabbitmq-plugins -q is_enabled rabbitmq_auth_mechanism_ssl >/dev/null 2>&1; then
  log "enabling the RabbitMQ plugin rabbitmq_auth_mechanism_ssl (EXTERNAL)"
  rabbitmq-plugins -q enable rabbitmq_auth_mechanism_ssl >/dev/null
fi
RMQ_CERTS=/etc/rabbitmq/outbox-test-certs
STREAM_TLS_PORT=5551
AMQPS_PORT=5671
# The management API over HTTPS too (check --routes with an https:// management_url).
MANAGEMENT_TLS_PORT=15671
make_test_certs "$RMQ_CERTS" "outbox-relay RabbitMQ test CA" rabbitmq
RMQ_CONF=/etc/rabbitmq/rabbitmq.conf
TLS_BLOCK="# outbox-relay test TLS listeners (scripts/test-services.sh)
listeners.ssl.default = 127.0.0.1:$AMQPS_PORT
stream.listeners.ssl.default = $STREAM_TLS_PORT
ssl_options.cacertfile = $RMQ_CERTS/ca.crt
ssl_options.certfile = $RMQ_CERTS/server.crt
ssl_options.keyfile = $RMQ_CERTS/server.key
ssl_options.verify = verify_peer
ssl_options.fail_if_no_peer_cert = false
auth_mechanisms.1 = PLAIN
auth_mechanisms.2 = AMQPLAIN
auth_mechanisms.3 = EXTERNAL
ssl_cert_login_from = common_name
management.tcp.port = $MANAGEMENT_PORT
management.ssl.port = $MANAGEMENT_TLS_PORT
management.ssl.cacertfile = $RMQ_CERTS/ca.crt
management.ssl.certfile = $RMQ_CERTS/server.crt
management.ssl.keyfile = $RMQ_CERTS/server.key
# end outbox-relay test TLS listeners"
# The block as the file has it now (grep -F with a multi-line pattern would match
# any one of its lines, so compare the whole block).
CUR_BLOCK="$(sed -n '/^# outbox-relay test TLS listeners/,/^# end outbox-relay test TLS listeners/p' "$RMQ_CONF" 2>/dev/null || true)"
if [ "$CUR_BLOCK" != "$TLS_BLOCK" ]; then
  log "configuring RabbitMQ's TLS listeners ($AMQPS_PORT, $STREAM_TLS_PORT) and restarting it"
  touch "$RMQ_CONF"
  # Drop an older version of the block, then append the current one.
  sed -i '/^# outbox-relay test TLS listeners/,/^# end outbox-relay test TLS listeners/d' "$RMQ_CONF"
  printf '%s\n' "$TLS_BLOCK" >> "$RMQ_CONF"
  rabbitmqctl -q shutdown >/dev/null 2>&1 || true
  for i in $(seq 1 30); do pgrep -f 'beam.*rabbit' >/dev/null 2>&1 || break; sleep 1; done
  rabbitmq-server -detached >/dev/null 2>&1 || true
  for i in $(seq 1 90); do rabbit_ok && break; sleep 1; done
  rabbit_ok || { log "RabbitMQ did not start after configuring TLS (see $RMQ_CONF)"; exit 1; }
fi
# The user EXTERNAL logs in as (no password: only its certificate), and its client
# certificate signed by the broker's test CA.
make_client_cert "$RMQ_CERTS" client-external outbox-relay-external root
if ! rabbitmqctl -q list_users 2>/dev/null | grep -q '^outbox-relay-external\b'; then
  log "creating the RabbitMQ user outbox-relay-external (EXTERNAL only)"
  rabbitmqctl -q add_user outbox-relay-external "unused-$(openssl rand -hex 16)" >/dev/null
  rabbitmqctl -q clear_password outbox-relay-external >/dev/null
fi
rabbitmqctl -q set_permissions -p / outbox-relay-external '.*' '.*' '.*' >/dev/null
port_ok() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
stream_ok() { port_ok "$STREAM_PORT" && port_ok "$STREAM_TLS_PORT"; }
for i in $(seq 1 60); do stream_ok && break; sleep 1; done
stream_ok || { log "RabbitMQ stream ports $STREAM_PORT/$STREAM_TLS_PORT do not accept connections"; exit 1; }
# The management plugin, enabled online above, opens its listener a moment later.
for i in $(seq 1 60); do port_ok "$MANAGEMENT_PORT" && break; sleep 1; done
port_ok "$MANAGEMENT_PORT" || { log "RabbitMQ management port $MANAGEMENT_PORT does not accept connections"; exit 1; }
for i in $(seq 1 60); do port_ok "$MANAGEMENT_TLS_PORT" && break; sleep 1; done
port_ok "$MANAGEMENT_TLS_PORT" || { log "RabbitMQ management TLS port $MANAGEMENT_TLS_PORT does not accept connections"; exit 1; }

mkdir -p "$ROOT/target"
cat > "$ROOT/target/test-services.env" <<ENVEOF
OUTBOX_TEST_PG_PORT=$PORT
OUTBOX_TEST_PG_CLUSTER=$VERSION/$NAME
OUTBOX_TEST_PG_CA=/etc/postgresql/$VERSION/$NAME/certs/ca.crt
OUTBOX_TEST_FAULT_PG_PORT=$FAULT_PORT
OUTBOX_TEST_FAULT_PG_CLUSTER=$VERSION/$FAULT_NAME
OUTBOX_TEST_PG_BIN=$PGBIN
OUTBOX_TEST_AMQP=amqp://guest:guest@127.0.0.1:5672/%2f
OUTBOX_TEST_MANAGEMENT_URL=http://127.0.0.1:$MANAGEMENT_PORT
OUTBOX_TEST_MANAGEMENT_TLS_URL=https://localhost:$MANAGEMENT_TLS_PORT
OUTBOX_TEST_STREAM_URL=rabbitmq-stream://guest:guest@127.0.0.1:$STREAM_PORT/%2f
OUTBOX_TEST_STREAM_TLS_URL=rabbitmq-stream+tls://guest:guest@localhost:$STREAM_TLS_PORT/%2f
OUTBOX_TEST_AMQPS=amqps://guest:guest@localhost:$AMQPS_PORT/%2f
OUTBOX_TEST_RABBITMQ_CA=$RMQ_CERTS/ca.crt
OUTBOX_TEST_RABBITMQ_CLIENT_CERT=$RMQ_CERTS/client-external.crt
OUTBOX_TEST_RABBITMQ_CLIENT_KEY=$RMQ_CERTS/client-external.key
OUTBOX_TEST_PG_CLIENT_CERTS=/etc/postgresql/$VERSION/$NAME/certs
ENVEOF
# The 3-node RabbitMQ cluster of tests/cluster/, beside the broker above (which it does
# not touch): started (joined the first time), and its URLs added to the environment.
bash "$ROOT/scripts/rabbitmq-cluster.sh" start
bash "$ROOT/scripts/rabbitmq-cluster.sh" start-small-frames
bash "$ROOT/scripts/rabbitmq-cluster.sh" env >> "$ROOT/target/test-services.env"
# The broker matrix's RabbitMQ 4.x node (after the 3.10 node's test certificates exist:
# it serves the same ones). Its environment overrides the 3.10 broker's variables.
bash "$ROOT/scripts/rabbitmq4.sh" start
bash "$ROOT/scripts/rabbitmq4.sh" env > "$ROOT/target/rabbitmq4.env"
cat "$ROOT/target/test-services.env"
log "ready"
