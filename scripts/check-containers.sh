#!/usr/bin/env bash
# Builds the container images and runs docker/compose.yml with podman (no Docker engine
# runs on these machines), then checks the stack the way a user would see it:
#
#   1. images: a Debian 12 base from Debian's packages (mmdebstrap, podman import);
#      Postgres 15, RabbitMQ 3.10 and Prometheus from Debian's packages on it
#      (docker/debian/); the relay's image from docker/Dockerfile, target
#      runtime-prebuilt: the binary the tests build (target/debug, stripped),
#      not a second compilation. Images and layers stay in podman's storage, so a
#      second run only rebuilds what changed.
#   2. the compose stack: docker/compose.yml, run by podman-compose with the changes
#      a shared host needs (transform_compose below): every service on the host's
#      network with ports of its own, the images of step 1, Grafana left out (not
#      packaged in Debian; scripts/check-docker.sh validates its dashboard).
#   3. smoke checks: the relay's health check passes; the producer's rows arrive in
#      the queue; the relay runs as uid 10001 on a read-only root file system;
#      Prometheus scrapes it (up, outbox_relay_build_info) with the alerts of
#      deploy/prometheus/outbox-relay.rules.yml loaded and none firing; SIGTERM stops
#      the relay cleanly (exit 0); with the relay stopped while the producer keeps
#      inserting, OutboxRelayNoneReady fires (the rules' `for:` shortened to 10 s in
#      this copy: promtool's unit tests check the real delays).
#   4. a second relay, from the same image, publishing to a RabbitMQ stream.
#
# Everything it starts is removed on exit (a trap), whatever happens. Ports (all on
# 127.0.0.1, checked free first): Postgres 56432, RabbitMQ 56672 (stream 56552,
# management 56692, distribution 56673, epmd 56369), relay metrics 59187 and 59188,
# Prometheus 59090. Prints how long each step took.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$PWD"
CI_NAME=check-containers
# shellcheck source=scripts/lib/podman-ci.sh
. scripts/lib/podman-ci.sh

PG_PORT=56432 RMQ_PORT=56672 RMQ_STREAM_PORT=56552 RMQ_MGMT_PORT=56692 RMQ_DIST_PORT=56673
EPMD_PORT=56369 RELAY_PORT=59187 STREAM_RELAY_PORT=59188 PROM_PORT=59090
PROJECT=outboxci
PG_IMAGE=localhost/outbox-relay-ci/postgres:15
RMQ_IMAGE=localhost/outbox-relay-ci/rabbitmq:3.10
PROM_IMAGE=localhost/outbox-relay-ci/prometheus:2.42
RELAY_IMAGE=localhost/outbox-relay:ci
STREAM_RELAY=${PROJECT}_stream_relay

T0=$SECONDS
ci_podman_setup
ci_apt python3:python3 curl:curl ss:iproute2 objcopy:binutils
python3 -c 'import yaml' 2>/dev/null || ci_apt python3-yaml:python3-yaml
# podman-compose from PyPI, pinned: Debian 12's 1.0.3 adds a network to services with
# network_mode: host, which podman refuses. Kept with the images, outside the clone.
PODMAN_COMPOSE_VERSION=1.0.6
PC_DIR="$CI_STATE/podman-compose-$PODMAN_COMPOSE_VERSION"
if [ ! -f "$PC_DIR/podman_compose.py" ]; then
  ci_log "installing podman-compose $PODMAN_COMPOSE_VERSION from PyPI into $PC_DIR"
  python3 -m pip install --quiet --disable-pip-version-check --target "$PC_DIR.tmp" \
    "podman-compose==$PODMAN_COMPOSE_VERSION" >/dev/null
  rm -rf "$PC_DIR"
  mv "$PC_DIR.tmp" "$PC_DIR"
fi

for port in $PG_PORT $RMQ_PORT $RMQ_STREAM_PORT $RMQ_MGMT_PORT $RMQ_DIST_PORT $EPMD_PORT \
  $RELAY_PORT $STREAM_RELAY_PORT $PROM_PORT; do
  if ss -Hltn "sport = :$port" | grep -q .; then
    ci_log "FAILED: port $port is in use; this check needs it for its own services"
    exit 1
  fi
done

remove_leftovers() {
  # What a run that was killed before its trap could run may have left behind.
  podman rm -f -t 5 "$STREAM_RELAY" >/dev/null 2>&1 || true
  podman ps -a -q --filter "label=io.podman.compose.project=$PROJECT" | xargs -r podman rm -f -t 5 >/dev/null 2>&1 || true
  podman volume ls -q --filter "label=io.podman.compose.project=$PROJECT" | xargs -r podman volume rm -f >/dev/null 2>&1 || true
}
remove_leftovers

WORK="$(mktemp -d)"
compose() { PYTHONPATH="$PC_DIR" python3 -m podman_compose -p "$PROJECT" -f "$WORK/compose.yml" "$@"; }
cleanup() {
  local rc=$?
  if [ $rc -ne 0 ] && [ -f "$WORK/compose.yml" ]; then
    ci_log "--- podman-compose's output"
    tail -n 30 "$WORK/compose.log" 2>/dev/null | sed 's/^/    /' >&2 || true
    for c in relay relay-init postgres rabbitmq producer prometheus; do
      ci_log "--- last log lines of $c"
      podman logs --tail 15 "${PROJECT}_${c}_1" 2>&1 | sed 's/^/    /' >&2 || true
    done
    podman logs --tail 15 "$STREAM_RELAY" 2>&1 | sed 's/^/    /' >&2 || true
  fi
  if [ -f "$WORK/compose.yml" ]; then
    compose down -v -t 5 >/dev/null 2>&1 || true
  fi
  # Whatever is left of the project (a failed `up` may leave containers behind).
  remove_leftovers
  rm -rf "$WORK"
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

fail() { ci_log "FAILED: $*"; exit 1; }

# wait_for SECONDS DESCRIPTION CMD...: polls CMD every second until it succeeds.
wait_for() {
  local limit="$1" what="$2" start=$SECONDS
  shift 2
  until "$@" >/dev/null 2>&1; do
    if [ $((SECONDS - start)) -ge "$limit" ]; then
      fail "$what: not within $limit s"
    fi
    sleep 1
  done
  ci_log "$what ($((SECONDS - start)) s)"
}

# ------------------------------------------------------------------ 1. images
build_images() {
  ci_base_image
  ci_build "$PG_IMAGE" docker/debian/postgres.Containerfile docker/debian
  ci_build "$RMQ_IMAGE" docker/debian/rabbitmq.Containerfile docker/debian
  ci_build "$PROM_IMAGE" docker/debian/prometheus.Containerfile docker/debian
}

build_relay_image() {
  # The binary the tests run (scripts/test.sh builds the same), without its debug
  # information. Built here if it is missing.
  cargo build --quiet --locked -p outbox-relay --bin outbox-relay
  mkdir -p "$WORK/relay-bin"
  objcopy --strip-all "${CARGO_TARGET_DIR:-target}/debug/outbox-relay" "$WORK/relay-bin/outbox-relay"
  ci_podman_build \
    --ignorefile docker/Dockerfile.dockerignore \
    --target runtime-prebuilt \
    --build-arg RUNTIME_IMAGE="$BASE_IMAGE" \
    --build-arg RUST_IMAGE="$BASE_IMAGE" \
    --build-arg RELAY_GIT_SHA="$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)" \
    --build-context relay-bin="$WORK/relay-bin" \
    -f docker/Dockerfile -t "$RELAY_IMAGE" .
}

ci_time "images (base, postgres, rabbitmq, prometheus)" build_images
ci_time "relay image (prebuilt binary)" build_relay_image

# ------------------------------------------------------------------ 2. the stack
# docker/compose.yml as it is, but for a shared host: the host's network with ports of
# our own, local images, no build, no Grafana, and the alerts' `for:` shortened.
transform_compose() {
  python3 - "$ROOT" "$WORK" <<PY
import os, re, sys, yaml
root, work = sys.argv[1], sys.argv[2]
docker = os.path.join(root, "docker")
c = yaml.safe_load(open(os.path.join(docker, "compose.yml")))
c.pop("name", None)
c["services"].pop("grafana")
c["volumes"].pop("grafana-data")
images = {"postgres": "$PG_IMAGE", "producer": "$PG_IMAGE", "rabbitmq": "$RMQ_IMAGE",
          "relay-init": "$RELAY_IMAGE", "relay": "$RELAY_IMAGE", "prometheus": "$PROM_IMAGE"}
def url(v):
    return v.replace("@postgres:5432/", "@127.0.0.1:$PG_PORT/").replace("@rabbitmq:5672/", "@127.0.0.1:$RMQ_PORT/")
for name, s in c["services"].items():
    s["image"] = images[name]
    for k in ("build", "ports", "depends_on"):
        s.pop(k, None)
    s["network_mode"] = "host"
    vols = []
    for v in s.get("volumes", []):
        src, _, rest = v.partition(":")
        if src.startswith("."):
            src = os.path.normpath(os.path.join(docker, src))
        vols.append(f"{src}:{rest}")
    if vols:
        s["volumes"] = vols
    env = s.get("environment") or {}
    for k, v in list(env.items()):
        env[k] = url(str(v))
    s["environment"] = env
s = c["services"]
s["postgres"]["environment"]["PGPORT"] = "$PG_PORT"
s["postgres"]["command"] += ["-c", "port=$PG_PORT", "-c", "listen_addresses=127.0.0.1"]
s["producer"]["environment"].update(PGHOST="127.0.0.1", PGPORT="$PG_PORT")
s["rabbitmq"]["environment"].update(
    RABBITMQ_NODENAME="outboxci@localhost", RABBITMQ_NODE_PORT="$RMQ_PORT",
    RABBITMQ_DIST_PORT="$RMQ_DIST_PORT", ERL_EPMD_PORT="$EPMD_PORT", RABBITMQ_LOGS="-")
with open(os.path.join(work, "90-ports.conf"), "w") as f:
    f.write("listeners.tcp.default = $RMQ_PORT\nmanagement.tcp.port = $RMQ_MGMT_PORT\n"
            "stream.listeners.tcp.default = $RMQ_STREAM_PORT\n")
s["rabbitmq"]["volumes"].append(f"{work}/90-ports.conf:/etc/rabbitmq/conf.d/90-ports.conf:ro")
for name in ("relay-init", "relay"):
    s[name]["environment"]["OUTBOX_RELAY_RELAY_METRICS_LISTEN"] = "127.0.0.1:$RELAY_PORT"
    s[name]["environment"]["RUST_LOG"] = "info"
s["relay"]["healthcheck"]["start_period"] = "1s"
s["prometheus"]["command"] += ["--web.listen-address=127.0.0.1:$PROM_PORT"]
p = yaml.safe_load(open(os.path.join(docker, "prometheus.yml")))
p["global"] = {"scrape_interval": "2s", "evaluation_interval": "2s"}
for job in p["scrape_configs"]:
    for sc in job["static_configs"]:
        sc["targets"] = [re.sub(r"^relay:\d+$", "127.0.0.1:$RELAY_PORT", t) for t in sc["targets"]]
yaml.safe_dump(p, open(os.path.join(work, "prometheus.yml"), "w"))
rules = open(os.path.join(root, "deploy/prometheus/outbox-relay.rules.yml")).read()
rules, n = re.subn(r"(?m)^(\s+for:) \S+$", r"\1 10s", rules)
assert n > 0, "no for: in the rules"
open(os.path.join(work, "rules.yml"), "w").write(rules)
vols = []
for v in s["prometheus"]["volumes"]:
    if v.endswith(":/etc/prometheus/prometheus.yml:ro"):
        v = f"{work}/prometheus.yml:/etc/prometheus/prometheus.yml:ro"
    elif "outbox-relay.rules.yml:" in v:
        v = f"{work}/rules.yml:" + v.split(":", 1)[1]
    vols.append(v)
s["prometheus"]["volumes"] = vols
yaml.safe_dump(c, open(os.path.join(work, "compose.yml"), "w"), sort_keys=False)
PY
  chmod 755 "$WORK"
  chmod 644 "$WORK"/*.yml "$WORK"/*.conf
}
transform_compose

ctr() { echo "${PROJECT}_$1_1"; }
pg_ready() { podman exec "$(ctr postgres)" pg_isready -q -h 127.0.0.1 -p "$PG_PORT" -U postgres -d app; }
rmq_ready() { podman exec "$(ctr rabbitmq)" rabbitmq-diagnostics -q check_port_connectivity; }
relay_healthy() { podman healthcheck run "$(ctr relay)"; }
queue_messages() {
  podman exec "$(ctr rabbitmq)" rabbitmqctl -q list_queues --no-table-headers name messages \
    | awk -v q="$1" '$1 == q { print $2 }'
}
prom_query() { # prom_query EXPR -> the first value, or nothing
  curl -fsS --get "http://127.0.0.1:$PROM_PORT/api/v1/query" --data-urlencode "query=$1" \
    | python3 -c 'import json,sys; r=json.load(sys.stdin)["data"]["result"]; print(r[0]["value"][1] if r else "")'
}
alert_state() { # alert_state NAME -> firing, pending or nothing
  curl -fsS "http://127.0.0.1:$PROM_PORT/api/v1/alerts" \
    | python3 -c 'import json,sys; print(" ".join(a["state"] for a in json.load(sys.stdin)["data"]["alerts"] if a["labels"]["alertname"]==sys.argv[1]))' "$1"
}

start_stack() {
  compose up -d --no-deps postgres rabbitmq >>"$WORK/compose.log" 2>&1
  wait_for 120 "postgres accepts connections" pg_ready
  wait_for 180 "rabbitmq accepts connections" rmq_ready
  compose up -d --no-deps relay-init >>"$WORK/compose.log" 2>&1
  local rc
  rc="$(podman wait "$(ctr relay-init)")"
  [ "$rc" = "0" ] || fail "relay-init (slot create --if-not-exists) exited $rc"
  compose up -d --no-deps relay producer prometheus >>"$WORK/compose.log" 2>&1
  wait_for 90 "the relay's health check (/readyz) passes" relay_healthy
}
ci_time "compose stack up" start_stack

smoke() {
  local n
  events_arrived() { n="$(queue_messages outbox.demo)"; [ "${n:-0}" -ge 3 ]; }
  wait_for 60 "the producer's rows arrive in queue outbox.demo" events_arrived
  # Non-root, read-only root file system.
  local uid
  uid="$(podman exec "$(ctr relay)" id -u)"
  [ "$uid" = "10001" ] || fail "the relay runs as uid $uid, not 10001"
  [ "$(podman inspect -f '{{.HostConfig.ReadonlyRootfs}}' "$(ctr relay)")" = "true" ] \
    || fail "the relay's root file system is writable"
  if podman exec "$(ctr relay)" sh -c ': > /usr/local/bin/probe' 2>/dev/null; then
    fail "the relay could write into its root file system"
  fi
  ci_log "the relay runs as uid 10001 on a read-only root file system"
  podman exec "$(ctr relay)" outbox-relay --version | grep -q '^outbox-relay ' \
    || fail "outbox-relay --version in the image"
}
ci_time "smoke: health, events, user" smoke

prometheus_checks() {
  scraped() { [ "$(prom_query 'up{job="outbox-relay"}')" = "1" ]; }
  wait_for 60 "prometheus scrapes the relay (up == 1)" scraped
  local info
  info="$(prom_query 'count(outbox_relay_build_info{job="outbox-relay"} == 1)')"
  [ "$info" = "1" ] || fail "outbox_relay_build_info is not scraped (got '$info')"
  local rules
  rules="$(curl -fsS "http://127.0.0.1:$PROM_PORT/api/v1/rules" \
    | python3 -c 'import json,sys; print(sum(len(g["rules"]) for g in json.load(sys.stdin)["data"]["groups"]))')"
  [ "${rules:-0}" -ge 10 ] || fail "prometheus loaded ${rules:-0} rules"
  sleep 12 # longer than the shortened for:, so a wrongly firing alert would show
  [ -z "$(alert_state OutboxRelayNoneReady)" ] || fail "OutboxRelayNoneReady is active while the relay runs"
  ci_log "prometheus scrapes the relay, $rules rules loaded, OutboxRelayNoneReady inactive"
}
ci_time "prometheus scrape and rules" prometheus_checks

stop_relay() {
  local before rc
  before="$(queue_messages outbox.demo)"
  podman stop -t 40 "$(ctr relay)" >/dev/null
  rc="$(podman inspect -f '{{.State.ExitCode}}' "$(ctr relay)")"
  [ "$rc" = "0" ] || fail "the relay exited $rc after SIGTERM, not 0"
  podman logs "$(ctr relay)" 2>&1 | grep -q 'stopped cleanly' \
    || fail "the relay's log has no 'stopped cleanly' line after SIGTERM"
  ci_log "SIGTERM: the relay stopped cleanly and exited 0 (queue had ${before} messages)"
  firing() { [ "$(alert_state OutboxRelayNoneReady)" = "firing" ]; }
  wait_for 120 "OutboxRelayNoneReady fires with the relay stopped and rows still arriving" firing
}
ci_time "SIGTERM and the alert" stop_relay

outbox_rows() {
  podman exec "$(ctr postgres)" psql -XAtq -h /var/run/postgresql -p "$PG_PORT" -U postgres -d app \
    -c 'select count(*) from outbox'
}

catch_up() {
  # Started again, the relay publishes what was committed while it was stopped.
  local rows
  rows="$(outbox_rows)"
  podman start "$(ctr relay)" >/dev/null
  wait_for 90 "the restarted relay's health check passes" relay_healthy
  caught_up() { [ "$(queue_messages outbox.demo)" -ge "$rows" ]; }
  wait_for 60 "every one of the $rows rows committed so far is in the queue" caught_up
  resolved() { [ -z "$(alert_state OutboxRelayNoneReady)" ]; }
  wait_for 60 "OutboxRelayNoneReady resolves" resolved
  podman stop -t 40 "$(ctr relay)" >/dev/null
}
ci_time "restart and catch up" catch_up

stream_run() {
  # The same image against the stream target, with the settings compose gives the relay.
  local env_args=()
  while IFS= read -r kv; do env_args+=(-e "$kv"); done < <(python3 - "$WORK/compose.yml" <<'PY'
import sys, yaml
env = yaml.safe_load(open(sys.argv[1]))["services"]["relay"]["environment"]
for k, v in env.items():
    print(f"{k}={v}")
PY
)
  podman run -d --name "$STREAM_RELAY" --network host --read-only "${env_args[@]}" \
    -e OUTBOX_RELAY_RABBITMQ_STREAM=outbox.ci.stream \
    -e "OUTBOX_RELAY_RABBITMQ_STREAM_URL=rabbitmq-stream://outbox:outbox@127.0.0.1:$RMQ_STREAM_PORT/%2f" \
    -e "OUTBOX_RELAY_RELAY_METRICS_LISTEN=127.0.0.1:$STREAM_RELAY_PORT" \
    "$RELAY_IMAGE" run >/dev/null
  stream_ready() { podman exec "$STREAM_RELAY" outbox-relay-healthcheck /readyz; }
  wait_for 90 "the stream relay's health check passes" stream_ready
  stream_filled() {
    local n
    n="$(queue_messages outbox.ci.stream)"
    [ "${n:-0}" -ge 3 ]
  }
  wait_for 60 "the producer's rows arrive in stream outbox.ci.stream" stream_filled
  curl -fsS "http://127.0.0.1:$STREAM_RELAY_PORT/metrics" | grep -q '^outbox_relay_target_info{target="stream",name="outbox.ci.stream"} 1' \
    || fail "the stream relay's metrics do not name the stream target"
  podman stop -t 40 "$STREAM_RELAY" >/dev/null
  local rc
  rc="$(podman inspect -f '{{.State.ExitCode}}' "$STREAM_RELAY")"
  [ "$rc" = "0" ] || fail "the stream relay exited $rc after SIGTERM, not 0"
}
ci_time "stream target run" stream_run

ci_log "OK — images built, compose stack healthy, events in the queue and the stream, non-root read-only relay, clean SIGTERM, alert fired ($((SECONDS - T0)) s in all)"
