# Sourced by scripts/check-containers.sh and scripts/check-deb.sh: podman as these
# machines need it, and the Debian base image built from Debian's packages.
#
# No Docker engine runs here and no image registry is reachable, but podman from
# Debian works as root with runc (crun refuses this sandbox's cgroup layout), the
# cgroupfs cgroup manager, no default ulimits and the host's network. Base images
# come from Debian's packages: mmdebstrap builds a minimal Debian 12 file system and
# `podman import` makes it an image. Images are kept in podman's own storage
# (/var/lib/containers/storage), outside the clone, so a second run reuses them and
# their cached layers; set OUTBOX_CI_REBUILD=1 to build them again.

CI_STATE="${OUTBOX_CI_STATE:-/var/cache/outbox-relay-ci}"
BASE_IMAGE="localhost/outbox-relay-ci/debian:bookworm-slim"

ci_log() { printf '%s: %s\n' "${CI_NAME:-ci}" "$*" >&2; }

# ci_time LABEL CMD...: runs CMD and logs how long it took.
ci_time() {
  local label="$1" start=$SECONDS
  shift
  "$@"
  ci_log "$label: $((SECONDS - start)) s"
}

ci_apt() {
  local missing=()
  for pair in "$@"; do
    command -v "${pair%%:*}" >/dev/null 2>&1 || missing+=("${pair#*:}")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  ci_log "installing ${missing[*]} from Debian"
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

ci_podman_setup() {
  ci_apt podman:podman runc:runc mmdebstrap:mmdebstrap
  mkdir -p "$CI_STATE"
  cat > "$CI_STATE/containers.conf" <<'CONF'
# Written by scripts/lib/podman-ci.sh
[containers]
default_ulimits = []

[engine]
cgroup_manager = "cgroupfs"
runtime = "runc"
CONF
  export CONTAINERS_CONF="$CI_STATE/containers.conf"
}

# The Debian 12 base (what debian:bookworm-slim is elsewhere): minbase without
# documentation, built once and then taken from podman's storage.
ci_base_image() {
  if [ -z "${OUTBOX_CI_REBUILD:-}" ] && podman image exists "$BASE_IMAGE"; then
    return 0
  fi
  ci_log "building $BASE_IMAGE with mmdebstrap"
  local tar="$CI_STATE/bookworm-slim.tar"
  mmdebstrap --quiet --variant=minbase --mode=root \
    --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    --dpkgopt='path-exclude=/usr/share/info/*' \
    --dpkgopt='path-exclude=/usr/share/man/*' \
    --aptopt='APT::Install-Recommends "false"' \
    bookworm "$tar"
  podman import --quiet --change 'CMD ["bash"]' "$tar" "$BASE_IMAGE" >/dev/null
  rm -f "$tar"
}

# ci_build TAG FILE CONTEXT [podman build args...]: an image from a Containerfile,
# on the base image, with podman's layer cache.
ci_build() {
  local tag="$1" file="$2" ctx="$3"
  shift 3
  ci_podman_build --build-arg BASE="$BASE_IMAGE" -f "$file" -t "$tag" "$@" "$ctx"
}

# ci_podman_build ARGS...: `podman build` with the host's network and the layer
# cache; its output is shown only when it fails.
ci_podman_build() {
  local log
  log="$(mktemp)"
  if ! podman build --network host --layers "$@" >"$log" 2>&1; then
    tail -n 40 "$log" >&2
    rm -f "$log"
    ci_log "FAILED: podman build $*"
    return 1
  fi
  rm -f "$log"
}
