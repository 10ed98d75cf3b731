#!/usr/bin/env bash
# Measures, on each cluster of scripts/pg-versions.sh, the facts docs/compatibility.md
# tabulates: whether a logical slot's confirmed_flush_lsn survives a fast restart and
# an immediate crash (moved by consuming changes and by pg_replication_slot_advance),
# pg_replication_slot_advance at and past the ends, which pgoutput protocol versions
# the server accepts, and the pg_replication_slots columns.
#
#   [REPEAT=5] scripts/pg-compat-measure.sh [MAJOR…]
#
# It RESTARTS AND CRASHES those clusters: do not run it while tests use them. It
# creates and drops its own database (compat_measure) and slots.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PV="$ROOT/scripts/pg-versions.sh"
majors="${*:-14 15 16 17 18}"
REPEAT="${REPEAT:-5}" # runs of each restart case
bash "$PV" start $majors
eval "$(bash "$PV" env | sed 's/^/export /')"
DATA_BASE="$(bash "$PV" env | sed -n 's/^OUTBOX_TEST_PG_VERSIONS_DIR=//p')/data"

q() { # q PORT SQL: one value per line
  psql -XAtq -v ON_ERROR_STOP=1 -h 127.0.0.1 -U postgres -p "$1" -d compat_measure -c "$2"
}
q_err() { # q_err PORT SQL: the result, or the server's error message
  psql -XAtq -v ON_ERROR_STOP=1 -h 127.0.0.1 -U postgres -p "$1" -d compat_measure -c "$2" 2>&1 |
    sed 's/^psql:[^E]*ERROR: */ERROR: /' | head -n1 || true
}
pg_ctl_as() { # pg_ctl_as MAJOR ARGS…
  local bin="OUTBOX_TEST_PG$1_BIN"
  runuser -u postgres -- "${!bin}/pg_ctl" -D "$DATA_BASE/$1" "${@:2}" >/dev/null
}
wait_up() {
  for _ in $(seq 1 120); do
    psql -XAtq -h 127.0.0.1 -U postgres -p "$1" -d postgres -c 'select 1' >/dev/null 2>&1 && return 0
    sleep 0.25
  done
  return 1
}
restart() { # restart MAJOR PORT fast|immediate|checkpoint+immediate
  if [ "$3" = checkpoint+immediate ]; then
    psql -XAtq -h 127.0.0.1 -U postgres -p "$2" -d postgres -c CHECKPOINT >/dev/null
  fi
  if [ "$3" = fast ]; then
    pg_ctl_as "$1" restart -m fast -w -t 60 -l "$DATA_BASE/../log/$1.log"
  else
    pg_ctl_as "$1" stop -m immediate -w -t 60
    pg_ctl_as "$1" start -w -t 60 -l "$DATA_BASE/../log/$1.log"
  fi
  wait_up "$2"
}
flush() { q "$1" "SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = '$2'"; }

# survives MAJOR PORT HOW MOVE: creates a slot, moves it past 100 committed rows,
# restarts (HOW = fast | immediate) and prints "kept" or how far it went back. MOVE:
#   stream  - a walsender confirms the position (pg_recvlogical, as the relay does:
#             standby status updates on a replication connection)
#   consume - pg_logical_slot_get_binary_changes
#   advance - pg_replication_slot_advance
survives() {
  local major="$1" port="$2" how="$3" move="$4" slot="m_${4}" created moved after
  q "$port" "SELECT pg_drop_replication_slot('$slot') FROM pg_replication_slots WHERE slot_name = '$slot'" >/dev/null
  created="$(q "$port" "SELECT lsn FROM pg_create_logical_replication_slot('$slot', 'pgoutput')")"
  q "$port" "INSERT INTO outbox (v) SELECT 'x' FROM generate_series(1, 100)" >/dev/null
  if [ "$move" = stream ]; then
    local target
    target="$(q "$port" "SELECT pg_current_wal_lsn()")"
    pg_recvlogical -h 127.0.0.1 -p "$port" -U postgres -d compat_measure --slot "$slot" \
      --start -o proto_version=1 -o publication_names=p -f /dev/null \
      --fsync-interval=1 -s 1 >/dev/null 2>&1 &
    local pid=$! i
    for i in $(seq 1 100); do
      [ "$(q "$port" "SELECT confirmed_flush_lsn >= '$target' FROM pg_replication_slots WHERE slot_name = '$slot'")" = t ] && break
      sleep 0.1
    done
    kill "$pid"; wait "$pid" 2>/dev/null || true
    sleep 0.5
  elif [ "$move" = consume ]; then
    q "$port" "SELECT count(*) FROM pg_logical_slot_get_binary_changes('$slot', NULL, NULL,
               'proto_version', '1', 'publication_names', 'p')" >/dev/null
  else
    q "$port" "SELECT pg_replication_slot_advance('$slot', pg_current_wal_lsn())" >/dev/null
  fi
  moved="$(flush "$port" "$slot")"
  restart "$major" "$port" "$how"
  after="$(flush "$port" "$slot")"
  if [ "$after" = "$moved" ]; then
    echo "kept"
  elif [ "$after" = "$created" ]; then
    echo "lost: back to the creation point ($(q "$port" "SELECT pg_wal_lsn_diff('$moved', '$after')") bytes)"
  else
    echo "lost: back $(q "$port" "SELECT pg_wal_lsn_diff('$moved', '$after')") bytes"
  fi
  q "$port" "SELECT pg_drop_replication_slot('$slot')" >/dev/null
}

for major in $majors; do
  port_var="OUTBOX_TEST_PG${major}_PORT"
  port="${!port_var}"
  echo "== Postgres $major (port $port): $(psql -XAtq -h 127.0.0.1 -U postgres -p "$port" -d postgres -c 'show server_version')"
  psql -XAtq -h 127.0.0.1 -U postgres -p "$port" -d postgres \
    -c "DROP DATABASE IF EXISTS compat_measure" -c "CREATE DATABASE compat_measure" >/dev/null
  q "$port" "CREATE TABLE outbox (id serial PRIMARY KEY, v text); CREATE PUBLICATION p FOR TABLE outbox" >/dev/null

  for how in fast immediate checkpoint+immediate; do
    for move in stream consume advance; do
      results=""
      for _ in $(seq 1 "$REPEAT"); do
        results="$results$(survives "$major" "$port" "$how" "$move" | sed 's/ (.*//')"$'\n'
      done
      echo "restart $how, slot moved by $move: $(printf '%s' "$results" | sort | uniq -c | awk '{c=$1; $1=""; printf "%s%s in %d/'"$REPEAT"'", (NR>1?"; ":""), substr($0,2), c}')"
    done
  done

  # pg_replication_slot_advance at the ends.
  q "$port" "SELECT 1 FROM pg_create_logical_replication_slot('m_adv', 'pgoutput')" >/dev/null
  q "$port" "INSERT INTO outbox (v) VALUES ('y')" >/dev/null
  start="$(flush "$port" m_adv)"
  echo "advance to 0/1 (backwards): $(q_err "$port" "SELECT end_lsn = '$start' FROM pg_replication_slot_advance('m_adv', '0/1')" | sed 's/^t$/no-op, returns the current position/')"
  echo "advance past the WAL end: $(q_err "$port" "SELECT CASE WHEN end_lsn <= pg_current_wal_insert_lsn() THEN 'clamped to the WAL end' ELSE 'moved past it' END FROM pg_replication_slot_advance('m_adv', 'FF/0')")"
  q "$port" "SELECT pg_drop_replication_slot('m_adv')" >/dev/null

  # pgoutput protocol versions, then the option each new version brought.
  q "$port" "SELECT 1 FROM pg_create_logical_replication_slot('m_proto', 'pgoutput')" >/dev/null
  peek() {
    local res
    res="$(q_err "$port" "SELECT count(*) FROM pg_logical_slot_peek_binary_changes('m_proto', NULL, NULL, 'publication_names', 'p', $1)")"
    case "$res" in ERROR*) echo "$res" ;; *) echo "accepted" ;; esac
  }
  for proto in 1 2 3 4 5; do
    echo "pgoutput proto_version $proto: $(peek "'proto_version', '$proto'")"
  done
  echo "proto 2 + streaming on: $(peek "'proto_version', '2', 'streaming', 'on'")"
  echo "proto 3 + two_phase on: $(peek "'proto_version', '3', 'two_phase', 'on'")"
  echo "proto 4 + streaming parallel: $(peek "'proto_version', '4', 'streaming', 'parallel'")"
  q "$port" "SELECT pg_drop_replication_slot('m_proto')" >/dev/null

  echo "pg_replication_slots columns: $(q "$port" "SELECT string_agg(attname, ' ' ORDER BY attnum) FROM pg_attribute WHERE attrelid = 'pg_replication_slots'::regclass AND attnum > 0")"
  psql -XAtq -h 127.0.0.1 -U postgres -p "$port" -d postgres -c "DROP DATABASE compat_measure" >/dev/null
done
