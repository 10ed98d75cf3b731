#!/bin/bash
# outbox-relay-healthcheck [PATH] — container health probe for the outbox-relay image.
#
# Exits 0 when GET http://127.0.0.1:<port><PATH> answers 200, 1 otherwise. PATH is
# /readyz (streaming and connected to both sides) by default; /healthz answers 200
# while the process is alive. The port is taken from OUTBOX_RELAY_RELAY_METRICS_LISTEN.
#
# Why not curl: the runtime image is debian:bookworm-slim, which has bash but no HTTP
# client; installing curl would add libcurl and a dozen libraries to the image only
# for this probe. bash's /dev/tcp does the one request needed.
set -euo pipefail

path="${1:-/readyz}"
listen="${OUTBOX_RELAY_RELAY_METRICS_LISTEN-127.0.0.1:9187}"
if [ -z "$listen" ]; then
    echo "outbox-relay-healthcheck: metrics are disabled (OUTBOX_RELAY_RELAY_METRICS_LISTEN is empty)" >&2
    exit 1
fi
port="${listen##*:}"

if ! { exec 3<>"/dev/tcp/127.0.0.1/${port}"; } 2>/dev/null; then
    echo "outbox-relay-healthcheck: nothing listens on 127.0.0.1:${port}" >&2
    exit 1
fi
printf 'GET %s HTTP/1.1\r\nHost: 127.0.0.1:%s\r\nConnection: close\r\n\r\n' "$path" "$port" >&3
status=""
IFS= read -r -t 5 status <&3 || true
# Read the rest (the server closes after answering) rather than reset the connection.
while IFS= read -r -t 5 _ <&3; do :; done
exec 3<&-
status="${status%$'\r'}"
case "$status" in
    "HTTP/1."?" 200"*) exit 0 ;;
    *)
        echo "outbox-relay-healthcheck: GET ${path}: ${status:-no answer}" >&2
        exit 1
        ;;
esac
