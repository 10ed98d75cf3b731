#!/usr/bin/env bash
# Builds the Debian package (scripts/build-deb.sh, DEB_PROFILE=dev: the debug binary
# the tests use, stripped) and installs it the way a user would, in a fresh Debian 12
# container (podman, scripts/lib/podman-ci.sh):
#   - `dpkg -i`, then the files are where Debian expects them (binary, man page,
#     bash/zsh/fish completions, /etc/outbox-relay/outbox-relay.toml, the unit);
#   - `outbox-relay --version` names the version and the git commit;
#   - `outbox-relay check` against the tests' Postgres (a database and slot of its
#     own, dropped on exit) and RabbitMQ, with the packaged configuration file and
#     URLs from the environment: every line ok, exit 0;
#   - `systemd-analyze verify` on the unit (and its hardening settings are present);
#   - the unit started by systemd (PID 1 of the container): ready on /readyz, running
#     as the package's system user, `systemctl reload` (ExecReload, SIGHUP) rereads
#     the file in the same process, then `systemctl stop` is a clean stop (exit 0);
#   - `dpkg -r` removes the binary and leaves the configuration file.
# Needs the test services (scripts/test-services.sh). Prints how long each step took.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
CI_NAME=check-deb
# shellcheck source=scripts/lib/podman-ci.sh
. scripts/lib/podman-ci.sh

PG_PORT="${OUTBOX_TEST_PG_PORT:-55432}"
AMQP="${OUTBOX_TEST_AMQP:-amqp://guest:guest@127.0.0.1:5672/%2f}"
TEST_IMAGE=localhost/outbox-relay-ci/deb-test:bookworm
DB="outbox_deb_check_$$"
SLOT="outbox_deb_check_$$"
CONTAINER="outbox_deb_check_$$"
METRICS_PORT=59198
T0=$SECONDS

psql_admin() { su postgres -c "psql -XAtq -v ON_ERROR_STOP=1 -h 127.0.0.1 -p $PG_PORT $*"; }
cleanup() {
  local rc=$?
  podman rm -f -t 2 "$CONTAINER" >/dev/null 2>&1 || true
  psql_admin "-d postgres -c \"select pg_drop_replication_slot('$SLOT') from pg_replication_slots where slot_name = '$SLOT'\"" >/dev/null 2>&1 || true
  psql_admin "-d postgres -c 'drop database if exists $DB'" >/dev/null 2>&1 || true
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

build() { DEB="$(DEB_PROFILE=dev bash scripts/build-deb.sh)"; }
ci_time "build the .deb (cargo deb)" build
[ -f "$DEB" ] || { ci_log "FAILED: no package at '$DEB'"; exit 1; }

prepare() {
  ci_podman_setup
  ci_apt curl:curl
  ci_base_image
  # A fresh Debian 12 with systemd (for systemd-analyze) and nothing of the relay,
  # installing documentation as a full system does (the base image, like
  # debian:*-slim, tells dpkg to skip /usr/share/man and /usr/share/doc).
  printf 'FROM %s\nRUN rm -f /etc/dpkg/dpkg.cfg.d/99mmdebstrap && apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends systemd adduser bash-completion && rm -rf /var/lib/apt/lists/*\n' \
    "$BASE_IMAGE" > "$CI_STATE/deb-test.Containerfile"
  ci_podman_build -f "$CI_STATE/deb-test.Containerfile" -t "$TEST_IMAGE" "$CI_STATE"
  # The outbox of sql/outbox.sql in a database of its own on the tests' cluster.
  psql_admin "-d postgres -c 'create database $DB'" >/dev/null
  su postgres -c "psql -XAtq -v ON_ERROR_STOP=1 -h 127.0.0.1 -p $PG_PORT -d $DB" < sql/outbox.sql >/dev/null
}
ci_time "test image and database" prepare

install_and_check() {
  # systemd as the container's PID 1, so that the unit can be started for real.
  podman run -d --name "$CONTAINER" --network host --systemd=always \
    -v "$PWD/$DEB:/tmp/outbox-relay.deb:ro" "$TEST_IMAGE" /lib/systemd/systemd >/dev/null
  local i state=""
  for i in $(seq 1 60); do
    state="$(podman exec "$CONTAINER" systemctl is-system-running 2>/dev/null || true)"
    case "$state" in running|degraded) break ;; esac
    sleep 0.5
  done
  case "$state" in running|degraded) ;; *) ci_log "FAILED: systemd in the container is '$state'"; return 1 ;; esac
  podman exec \
    -e "PG_URL=postgresql://postgres@127.0.0.1:$PG_PORT/$DB" -e "AMQP=$AMQP" -e "SLOT=$SLOT" \
    -e "METRICS=127.0.0.1:$METRICS_PORT" \
    -e "GIT_SHA=$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)" \
    "$CONTAINER" bash -euo pipefail -c '
say() { printf "check-deb (in the container): %s\n" "$*" >&2; }
fail() { say "FAILED: $*"; exit 1; }
command -v outbox-relay >/dev/null && fail "the fresh container already has outbox-relay"
dpkg -i /tmp/outbox-relay.deb >/dev/null
say "dpkg -i: installed $(dpkg-query -W -f "\${Package} \${Version}" outbox-relay)"

for f in /usr/bin/outbox-relay /usr/share/man/man1/outbox-relay.1.gz \
         /usr/share/bash-completion/completions/outbox-relay \
         /usr/share/zsh/vendor-completions/_outbox-relay \
         /usr/share/fish/vendor_completions.d/outbox-relay.fish \
         /etc/outbox-relay/outbox-relay.toml /usr/lib/systemd/system/outbox-relay.service; do
  [ -s "$f" ] || fail "$f is missing"
done
dpkg-query -W -f "\${Conffiles}\n" outbox-relay | grep -q " /etc/outbox-relay/outbox-relay.toml " \
  || fail "/etc/outbox-relay/outbox-relay.toml is not a conffile"
perm="$(stat -c "%U:%G %a" /etc/outbox-relay/outbox-relay.toml)"
[ "$perm" = "root:outbox-relay 640" ] \
  || fail "/etc/outbox-relay/outbox-relay.toml is $perm, not root:outbox-relay 640"
zcat /usr/share/man/man1/outbox-relay.1.gz | grep -q "^\.TH outbox-relay 1" || fail "the man page is not outbox-relay(1)"
bash -c ". /usr/share/bash-completion/completions/outbox-relay; complete -p outbox-relay" >/dev/null \
  || fail "the bash completion does not register"

version="$(outbox-relay --version)"
say "outbox-relay --version: $version"
case "$version" in
  "outbox-relay "*" (git $GIT_SHA, "*")") ;;
  *) fail "--version does not name the version and git commit $GIT_SHA" ;;
esac

export OUTBOX_RELAY_POSTGRES_URL="$PG_URL" OUTBOX_RELAY_POSTGRES_SLOT="$SLOT" \
       OUTBOX_RELAY_RABBITMQ_URL="$AMQP" OUTBOX_RELAY_RABBITMQ_EXCHANGE=amq.topic RUST_LOG=warn
cfg=/etc/outbox-relay/outbox-relay.toml
outbox-relay --config "$cfg" slot create >/dev/null
out="$(outbox-relay --config "$cfg" check)" || { printf "%s\n" "$out" >&2; fail "outbox-relay check exited $?"; }
printf "%s\n" "$out" | sed "s/^/    /" >&2
printf "%s\n" "$out" | grep -q "^FAIL" && fail "outbox-relay check reports a failure"
say "outbox-relay check: exit 0 with the packaged configuration"

unit=/usr/lib/systemd/system/outbox-relay.service
systemd-analyze verify --man=no "$unit" || fail "systemd-analyze verify $unit"
for setting in User=outbox-relay ProtectSystem=strict NoNewPrivileges=yes Restart=on-failure; do
  grep -qx "$setting" "$unit" || fail "the unit lacks $setting"
done
say "systemd-analyze verify: ok"

# The unit for real: started by systemd with the configuration file and the secrets
# file, as the system user the package made; streaming; then a clean stop.
printf "%s\n" "OUTBOX_RELAY_POSTGRES_URL=$PG_URL" "OUTBOX_RELAY_POSTGRES_SLOT=$SLOT" \
  "OUTBOX_RELAY_RABBITMQ_URL=$AMQP" "OUTBOX_RELAY_RABBITMQ_EXCHANGE=amq.topic" \
  "OUTBOX_RELAY_RELAY_METRICS_LISTEN=$METRICS" > /etc/outbox-relay/outbox-relay.env
chmod 600 /etc/outbox-relay/outbox-relay.env
systemctl start outbox-relay
say "systemctl start outbox-relay: $(systemctl is-active outbox-relay)"
echo PART-1-DONE
'
}

# ... probed from the host (the container shares its network) ...
unit_ready() {
  local i
  for i in $(seq 1 60); do
    if curl -fsS "http://127.0.0.1:$METRICS_PORT/readyz" >/dev/null 2>&1; then
      ci_log "the unit's relay answers /readyz 200"
      return 0
    fi
    sleep 0.5
  done
  podman exec "$CONTAINER" journalctl -u outbox-relay --no-pager | tail -n 15 >&2
  ci_log "FAILED: the unit did not become ready (/readyz)"
  return 1
}

stop_and_remove() {
  podman exec "$CONTAINER" bash -euo pipefail -c '
say() { printf "check-deb (in the container): %s\n" "$*" >&2; }
fail() { say "FAILED: $*"; exit 1; }
pid="$(systemctl show -p MainPID --value outbox-relay)"
uid="$(awk "/^Uid:/ {print \$2}" "/proc/$pid/status")"
[ "$uid" = "$(id -u outbox-relay)" ] && [ "$uid" != 0 ] || fail "the unit runs as uid $uid, not outbox-relay"
# ExecReload: SIGHUP rereads the file; the same process runs on.
systemctl reload outbox-relay || fail "systemctl reload outbox-relay failed"
for i in $(seq 1 50); do
  journalctl -u outbox-relay --no-pager | grep -q "configuration reloaded" && break
  sleep 0.2
done
journalctl -u outbox-relay --no-pager | grep -q "configuration reloaded" || fail "systemctl reload: no \"configuration reloaded\" in the journal"
[ "$(systemctl show -p MainPID --value outbox-relay)" = "$pid" ] && systemctl is-active -q outbox-relay \
  || fail "systemctl reload: the relay did not run on"
say "systemctl reload: configuration reloaded, same process"
systemctl stop outbox-relay
[ "$(systemctl show -p Result --value outbox-relay)" = success ] && [ "$(systemctl show -p ExecMainStatus --value outbox-relay)" = 0 ] \
  || fail "systemctl stop: $(systemctl show -p Result,ExecMainStatus outbox-relay | tr "\n" " ")"
journalctl -u outbox-relay --no-pager | grep -q "stopped cleanly" || fail "no clean stop in the journal"
say "systemctl start: ready on /readyz as user outbox-relay (uid $uid); systemctl stop: clean, exit 0"

dpkg -r outbox-relay >/dev/null
[ ! -e /usr/bin/outbox-relay ] || fail "dpkg -r left /usr/bin/outbox-relay"
[ -s /etc/outbox-relay/outbox-relay.toml ] || fail "dpkg -r removed the configuration file"
dpkg-query -W -f "\${db:Status-Status}\n" outbox-relay | grep -qx config-files \
  || fail "after dpkg -r the package is not in state config-files"
say "dpkg -r: binary removed, /etc/outbox-relay/outbox-relay.toml kept"
echo PART-2-DONE
'
}

# Each part ends with a marker, so that a shell that stopped early cannot pass.
run_part() {
  local out
  out="$("$@")" || return 1
  printf "%s\n" "$out" | grep -v '^PART-' || true
  printf "%s\n" "$out" | grep -q '^PART-[12]-DONE$' || { ci_log "FAILED: $1 stopped before its end"; return 1; }
}
ci_time "install, --version, check, verify, start the unit" run_part install_and_check
ci_time "the unit ready" unit_ready
ci_time "stop the unit, remove the package" run_part stop_and_remove
ci_log "OK — $(basename "$DEB"): installed in a fresh Debian 12 container, --version, check, systemd-analyze verify, the unit started by systemd (ready, non-root, reload, clean stop), dpkg -r keeps the configuration ($((SECONDS - T0)) s in all)"
