#!/usr/bin/env bash
# The quick start: runs the relay's main job end to end on this machine.
#   1. prepares a local Postgres with wal_level=logical (the cluster that
#      scripts/test-services.sh manages, port 55432) and checks the local RabbitMQ;
#   2. builds outbox-relay (release; QUICKSTART_PROFILE=debug builds and uses a debug
#      build instead, e.g. where a release build does not fit on the disk);
#   3. creates a database `outbox_demo` with the outbox table (sql/outbox.sql) and
#      the relay's least-privileged role `outbox_demo_relay` (sql/role.sql);
#   4. `outbox-relay slot create` (publication + slot);
#   5. starts `outbox-relay run`, inserts sample events in a few transactions (and one
#      rolled-back one, which is never published), and shows them arriving in the
#      queue `outbox_demo`;
#   6. stops the relay with SIGTERM (clean stop, exit 0) and prints `outbox-relay status`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$(pwd)"
WORK="$ROOT/target/quickstart"
mkdir -p "$WORK"

step() { printf '\n==> %s\n' "$*"; }

step "preparing Postgres (wal_level=logical) and RabbitMQ"
bash scripts/test-services.sh >/dev/null
. target/test-services.env
PGPORT="$OUTBOX_TEST_PG_PORT"
psql_demo() { psql -XAtq -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$PGPORT" -U postgres "$@"; }

step "building outbox-relay"
PROFILE="${QUICKSTART_PROFILE:-release}"
case "$PROFILE" in
  release) PROFILE_FLAG=(--release) ;;
  debug) PROFILE_FLAG=() ;;
  *) echo "QUICKSTART_PROFILE must be release or debug, not $PROFILE" >&2; exit 2 ;;
esac
cargo build "${PROFILE_FLAG[@]}" --locked -p outbox-relay --bin outbox-relay --example watch_queue 2>&1 | tail -n 1
BIN="$ROOT/target/$PROFILE/outbox-relay"

step "creating database outbox_demo with the outbox table"
psql_demo -d postgres -c "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = 'outbox_demo' AND NOT active" >/dev/null
psql_demo -d postgres -c "DROP DATABASE IF EXISTS outbox_demo WITH (FORCE)"
psql_demo -d postgres -c "CREATE DATABASE outbox_demo"
psql_demo -d outbox_demo -f sql/outbox.sql
# The relay connects as the least-privileged role of sql/role.sql, not as postgres.
psql_demo -d postgres -c "DROP ROLE IF EXISTS outbox_demo_relay"
psql_demo -d outbox_demo -v relay_role=outbox_demo_relay -f sql/role.sql

cat > "$WORK/outbox-relay.toml" <<TOML
[postgres]
url = "postgresql://outbox_demo_relay@127.0.0.1:$PGPORT/outbox_demo"
slot = "outbox_demo"
publication = "outbox_relay"
tables = ["public.outbox"]

[rabbitmq]
url = "amqp://guest:guest@127.0.0.1:5672/%2f"
exchange = "outbox_demo"

[relay]
metrics_listen = "127.0.0.1:9187"
TOML
echo "config: $WORK/outbox-relay.toml"

step "outbox-relay check / slot create"
"$BIN" --config "$WORK/outbox-relay.toml" slot create
"$BIN" --config "$WORK/outbox-relay.toml" check

step "starting the relay and a queue watcher"
"$ROOT/target/$PROFILE/examples/watch_queue" amqp://guest:guest@127.0.0.1:5672/%2f outbox_demo outbox_demo 4 60 &
WATCH=$!
"$BIN" --config "$WORK/outbox-relay.toml" run 2> "$WORK/relay.log" &
RELAY=$!
trap 'kill $RELAY $WATCH 2>/dev/null || true' EXIT
sleep 2

step "inserting sample events"
psql_demo -d outbox_demo <<'SQL'
BEGIN;
INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
  VALUES ('order', 'o-1001', 'created', '{"total": 42.5, "currency": "EUR"}');
INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers)
  VALUES ('order', 'o-1001', 'paid', '{"method": "card"}', '{"tenant": "acme"}');
COMMIT;
BEGIN;
INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
  VALUES ('order', 'o-1002', 'never-published', '{}');
ROLLBACK;
INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
  VALUES ('customer', 'c-7', 'registered', '{"email": "ada@example.com"}');
INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
  VALUES ('order', 'o-1001', 'shipped', '{"carrier": "dhl"}');
SQL
echo "inserted 4 committed events and 1 rolled back"

step "messages arriving in queue outbox_demo"
wait $WATCH

step "metrics (excerpt)"
curl -s http://127.0.0.1:9187/metrics | grep -E '^outbox_relay_(events_(published|acked)_total|acked_lsn|confirmed_lsn)' || true

step "stopping the relay (SIGTERM)"
kill -TERM $RELAY
code=0; wait $RELAY || code=$?
trap - EXIT
echo "relay exited with code $code"
tail -n 3 "$WORK/relay.log"

step "outbox-relay status"
"$BIN" --config "$WORK/outbox-relay.toml" status
[ "$code" = 0 ]
