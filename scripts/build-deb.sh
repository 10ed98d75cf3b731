#!/usr/bin/env bash
# Builds the Debian package target/debian/outbox-relay_<version>-1_<arch>.deb with
# cargo-deb (crates.io; installed with `cargo install` the first time), after
# generating what the package ships besides the binary: the bash, zsh and fish
# completions, from the binary itself, into target/deb-assets/ (the man page is the
# committed docs/man/outbox-relay.1, which a test keeps equal to the binary's).
#
#   scripts/build-deb.sh                 the release build (compiles it if needed)
#   DEB_PROFILE=dev scripts/build-deb.sh the debug build the tests use, stripped: what
#                                        CI packages (scripts/check-deb.sh), to avoid a
#                                        second, optimised compilation
# Prints the .deb's path on stdout.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PROFILE="${DEB_PROFILE:-release}"
CARGO_DEB_VERSION=3.8.0

if ! cargo deb --version >/dev/null 2>&1; then
  echo "build-deb: installing cargo-deb $CARGO_DEB_VERSION from crates.io" >&2
  cargo install --quiet --locked --version "$CARGO_DEB_VERSION" cargo-deb >&2
fi
TARGET_DIR="${CARGO_TARGET_DIR:-target}"
case "$PROFILE" in
  release) BIN="$TARGET_DIR/release/outbox-relay" ;;
  dev) BIN="$TARGET_DIR/debug/outbox-relay" ;;
  *) echo "build-deb: DEB_PROFILE is release or dev, not $PROFILE" >&2; exit 2 ;;
esac
cargo build --quiet --locked --profile "$PROFILE" -p outbox-relay --bin outbox-relay >&2
mkdir -p target/deb-assets
"$BIN" completions bash > target/deb-assets/outbox-relay.bash
"$BIN" completions zsh > target/deb-assets/_outbox-relay
"$BIN" completions fish > target/deb-assets/outbox-relay.fish
out="$(cargo deb --no-build --locked --quiet -p outbox-relay --profile "$PROFILE" --strip --fast --output target/debian 2>&2 | tail -n 1)"
echo "$out"
