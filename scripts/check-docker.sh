#!/usr/bin/env bash
# Validates docker/ without a Docker engine: the Dockerfile, the compose file, the
# Prometheus and Grafana provisioning files, the Grafana dashboard's PromQL, the
# RabbitMQ definitions and the image's health-check script. Read-only and idempotent
# (PyYAML is installed with pip the first time if it is missing); takes a few seconds.
# Prints one line per problem and exits 1 if there is any.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if ! python3 -c 'import yaml' 2>/dev/null; then
  echo "check-docker: PyYAML is missing, installing it with pip" >&2
  python3 -m pip install --quiet pyyaml 2>/dev/null \
    || python3 -m pip install --quiet --user pyyaml 2>/dev/null \
    || python3 -m pip install --quiet --user --break-system-packages pyyaml 2>/dev/null \
    || true
  if ! python3 -c 'import yaml' 2>/dev/null; then
    echo "check-docker: FAILED: PyYAML is missing and pip could not install it (python3 -m pip install pyyaml)" >&2
    exit 1
  fi
fi
bash -n docker/healthcheck.sh

# `docker compose config` parses the file without a daemon, when the plugin exists.
if docker compose version >/dev/null 2>&1; then
  docker compose -f docker/compose.yml config --quiet
fi

exec python3 - <<'PY'
import base64, glob, hashlib, http.server, json, os, re, subprocess, sys, threading, tomllib
from urllib.parse import urlsplit, unquote

import yaml

ROOT = os.getcwd()
DOCKER = os.path.join(ROOT, "docker")
errors = []


def err(where, msg):
    errors.append(f"{where}: {msg}")


def read(rel):
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


class StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys (PyYAML keeps the last one; compose refuses them)."""


def _mapping(loader, node, deep=False):
    seen = set()
    for k, _ in node.value:
        if k.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(k, deep=True)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", k.start_mark)
        seen.add(key)
    return yaml.SafeLoader.construct_mapping(loader, node, deep)


StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def fail(note=None):
    print(f"check-docker: FAILED ({len(errors)} problem{'s' if len(errors) > 1 else ''})", file=sys.stderr)
    for e in errors:
        print(f"  - {e}", file=sys.stderr)
    if note:
        print(f"  ({note})", file=sys.stderr)
    sys.exit(1)


def load_yaml(rel):
    try:
        return yaml.load(read(rel), Loader=StrictLoader)
    except FileNotFoundError:
        err(rel, "missing")
    except yaml.YAMLError as e:
        err(rel, f"not valid YAML: {e}")
    return None


# --- the relay's configuration keys (outbox-relay.example.toml lists every key) ---
try:
    example = tomllib.loads(read("outbox-relay.example.toml"))
except (FileNotFoundError, tomllib.TOMLDecodeError) as e:
    example = {}
    err("outbox-relay.example.toml", f"cannot read the relay's example configuration: {e}")
ENV_KEYS = {f"OUTBOX_RELAY_{s}_{k}".upper(): v for s, t in example.items() for k, v in t.items()}

# The relay's Prometheus metrics: docs/operations.md's metrics table, which the test
# metrics::tests::the_docs_table_lists_exactly_the_registered_metrics (crates/relay)
# keeps equal to what the binary registers.
METRICS_DOC = "docs/operations.md"
COUNTERS, GAUGES, HISTOGRAMS = set(), set(), set()
try:
    for name, kind in re.findall(r"^\|\s*`(outbox_relay_\w+)(?:\{[^`]*\})?`\s*\|\s*(\w+)\s*\|", read(METRICS_DOC), re.M):
        {"counter": COUNTERS, "gauge": GAUGES, "histogram": HISTOGRAMS}.get(kind, set()).add(name)
except FileNotFoundError:
    pass
if len(COUNTERS | GAUGES | HISTOGRAMS) < 15:
    err(METRICS_DOC, f"found only {len(COUNTERS | GAUGES | HISTOGRAMS)} metrics in its table: its format changed, update scripts/check-docker.sh")
SERIES = COUNTERS | GAUGES | {h + s for h in HISTOGRAMS for s in ("_bucket", "_sum", "_count")}
LABEL_VALUES = {"side": {"postgres", "rabbitmq"}, "target": {"exchange", "stream"},
                "position": {"stored", "carried"}}

# ============================== Dockerfile ==============================
DF = "docker/Dockerfile"
try:
    df_text = read(DF)
except FileNotFoundError:
    df_text = ""
    err(DF, "missing")

instructions = []  # (line number, INSTRUCTION, arguments)
pending, start = "", 0
for n, line in enumerate(df_text.splitlines(), 1):
    s = line.strip()
    if not pending and (not s or s.startswith("#")):
        continue
    if pending and s.startswith("#"):
        continue
    if not pending:
        start = n
    if s.endswith("\\"):
        pending += s[:-1] + " "
        continue
    full = (pending + s).strip()
    pending = ""
    op, _, args = full.partition(" ")
    instructions.append((start, op.upper(), args.strip()))

stages = []  # {"name", "image", "ins": [...]}
global_args = {}
for ln, op, args in instructions:
    if op == "FROM":
        m = re.match(r"(?:--\S+\s+)*(\S+)(?:\s+AS\s+(\S+))?$", args, re.I)
        image = m.group(1) if m else args
        for _ in range(3):  # ARG defaults may name other ARGs
            image = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda x: global_args.get(x.group(1) or x.group(2), x.group(0)), image)
        stages.append({"name": (m.group(2) if m else None), "image": image, "ins": [], "line": ln})
    elif not stages:
        if op == "ARG":
            k, _, v = args.partition("=")
            global_args[k.strip()] = v.strip()
    else:
        stages[-1]["ins"].append((ln, op, args))

BUILD = ["cargo", "build", "--release", "--locked", "-p", "outbox-relay"]
builds = []
if len(stages) < 2:
    err(DF, f"expected a multi-stage build (a builder and a runtime stage), found {len(stages)} stage(s)")
else:
    builder, final = stages[0], stages[-1]
    if not re.match(r"(docker\.io/library/)?rust:", builder["image"]):
        err(DF, f"the builder stage should use the official rust image, not {builder['image']}")
    m = re.search(r"rust:(\d+)\.(\d+)", builder["image"])
    try:
        want = tomllib.loads(read("Cargo.toml"))["workspace"]["package"].get("rust-version")
    except (FileNotFoundError, KeyError, tomllib.TOMLDecodeError):
        want = None
    if m and want:
        have, need = (int(m.group(1)), int(m.group(2))), tuple(int(x) for x in want.split(".")[:2])
        if have < need:
            err(DF, f"builder toolchain rust {have[0]}.{have[1]} is older than the workspace's rust-version {want}")
    # Every `cargo build` is exactly the project's release build of the binary.
    for st in stages:
        for ln, op, args in st["ins"]:
            if op != "RUN":
                continue
            for cmd in re.split(r";|&&|\|\|", args):
                toks = cmd.split()
                if toks[:2] == ["cargo", "build"]:
                    builds.append((st, ln))
                    if toks != BUILD:
                        err(f"{DF}:{ln}", f"build command is `{' '.join(toks)}`, expected `{' '.join(BUILD)}`")
    if not builds:
        err(DF, f"no `{' '.join(BUILD)}` in the Dockerfile")
    elif any(st is final for st, _ in builds):
        err(DF, "the final stage compiles: build in the builder stage and copy the binary")
    # The final stage, with what it inherits from the stages it is built FROM.
    by_name = {st["name"]: st for st in stages if st["name"]}
    chain, st = [final], final
    while st["image"] in by_name and by_name[st["image"]] not in chain:
        st = by_name[st["image"]]
        chain.insert(0, st)
    fins = [i for c in chain for i in c["ins"]]
    final_base_image = chain[0]["image"]
    fin = lambda op: [a for _, o, a in fins if o == op]
    if not re.match(r"((docker\.io/library/)?debian:[\w.-]*slim|gcr\.io/distroless/cc)", final_base_image):
        err(DF, f"the final stage should be a small image (debian:*-slim or distroless cc), not {final_base_image}")
    users = fin("USER")
    if not users:
        err(DF, "the final stage has no USER: the relay would run as root")
    elif users[-1].split(":")[0] in ("root", "0"):
        err(DF, f"the final stage runs as root (USER {users[-1]})")
    try:
        ep = json.loads(fin("ENTRYPOINT")[-1]) if fin("ENTRYPOINT") else None
        cmd = json.loads(fin("CMD")[-1]) if fin("CMD") else None
    except json.JSONDecodeError:
        ep = cmd = "not JSON"
    if ep != ["outbox-relay"]:
        err(DF, f'the final stage\'s ENTRYPOINT must be ["outbox-relay"] (exec form), found {ep}')
    if cmd != ["run"]:
        err(DF, f'the final stage\'s CMD must be ["run"], found {cmd}')
    exposed = " ".join(fin("EXPOSE")).split()
    if "9187" not in [p.split("/")[0] for p in exposed]:
        err(DF, "the final stage does not EXPOSE 9187")
    env = {}
    for a in fin("ENV"):
        for k, v in re.findall(r"(\w+)=(\"[^\"]*\"|\S+)", a):
            env[k] = v.strip('"')
    if env.get("OUTBOX_RELAY_RELAY_METRICS_LISTEN") != "0.0.0.0:9187":
        err(DF, "the final stage must set OUTBOX_RELAY_RELAY_METRICS_LISTEN=0.0.0.0:9187 so metrics are reachable from outside")
    for k in env:
        if k.startswith("OUTBOX_RELAY_") and ENV_KEYS and k not in ENV_KEYS:
            err(DF, f"ENV {k} is not a configuration key of the relay (it would refuse to start)")
    copies = [a for _, o, a in fins if o == "COPY"]
    # The binary: the compile stage (the first) copies its release build to /out; the
    # stage prebuilt takes one from the build context relay-bin; the final stage (the
    # default target) copies /out/outbox-relay from compile, and the target
    # runtime-prebuilt, on the same base, from prebuilt.
    if not any(op == "RUN" and "cp target/release/outbox-relay /out/" in a for _, op, a in builder["ins"]):
        err(DF, "the compile stage does not copy target/release/outbox-relay to /out/")
    pre = by_name.get("prebuilt")
    if not pre or not any(op == "COPY" and "--from=relay-bin" in a and "/out/outbox-relay" in a for _, op, a in pre["ins"]):
        err(DF, "no stage prebuilt copying outbox-relay from the build context relay-bin to /out/")
    if not any(f"--from={builder['name']}" in a and "/out/outbox-relay /usr/local/bin/outbox-relay" in a for a in copies):
        err(DF, f"the final stage does not copy /out/outbox-relay from the {builder['name']} stage")
    rp = by_name.get("runtime-prebuilt")
    if not rp or rp["image"] != final["image"] or not any(
            op == "COPY" and "--from=prebuilt" in a and "/out/outbox-relay /usr/local/bin/outbox-relay" in a for _, op, a in rp["ins"]):
        err(DF, f"no target runtime-prebuilt FROM {final['image']} copying /out/outbox-relay from prebuilt")
    if not any("docker/healthcheck.sh" in a and "outbox-relay-healthcheck" in a for a in copies):
        err(DF, "the final stage does not install docker/healthcheck.sh as outbox-relay-healthcheck (the relay's compose health check)")

# .dockerignore semantics: the last matching pattern wins; a pattern also matches
# everything below a directory it matches.
IGN = "docker/Dockerfile.dockerignore"
ignore_rules = []
try:
    for line in read(IGN).splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            neg = line.startswith("!")
            pat = line.lstrip("!").strip("/")
            rx = re.escape(pat).replace(r"\*\*", "\0").replace(r"\*", "[^/]*").replace(r"\?", "[^/]").replace("\0", ".*")
            ignore_rules.append((neg, re.compile(rx + "$")))
except FileNotFoundError:
    err(IGN, "missing: without it the whole repository (target/, .git) is sent to the builder")


def ignored(path):
    parts = path.strip("/").split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    out = False
    for neg, rx in ignore_rules:
        if any(rx.match(p) for p in prefixes):
            out = not neg
    return out


if ignore_rules:
    for p in ("target/release/outbox-relay", ".git/HEAD"):
        if not ignored(p):
            err(IGN, f"does not exclude {p.split('/')[0]}/ from the build context")

# Every COPY source exists and is in the build context.
copied = set()
for st in stages:
    for ln, op, args in st["ins"]:
        if op not in ("COPY", "ADD") or "--from=" in args:
            continue
        toks = [t for t in args.split() if not t.startswith("--")]
        if toks and toks[0].startswith("["):
            toks = json.loads(" ".join(toks))
        for src in toks[:-1]:
            copied.add(src.rstrip("/"))
            if not os.path.exists(os.path.join(ROOT, src)):
                err(f"{DF}:{ln}", f"COPY source {src} does not exist in the repository")
            elif ignore_rules and ignored(src):
                err(f"{DF}:{ln}", f"COPY source {src} is excluded by {IGN}")

# Every workspace member's manifest is copied before the dependency build, and its
# sources are in the build context — except the black-box test package (tests/),
# which the image never compiles: only its manifest is needed to load the workspace.
NOT_IN_IMAGE = {"tests"}
try:
    members = tomllib.loads(read("Cargo.toml"))["workspace"]["members"]
except Exception as e:  # noqa: BLE001
    members = []
    err("Cargo.toml", f"cannot read the workspace members: {e}")
paths = sorted({p for m in members for p in glob.glob(m, root_dir=ROOT)})
for m in paths:
    if f"{m}/Cargo.toml" not in copied:
        err(DF, f"workspace member {m}: {m}/Cargo.toml is not copied before the dependency build (cargo cannot load the workspace without it)")
    if m not in NOT_IN_IMAGE and ignore_rules and ignored(f"{m}/src/lib.rs"):
        err(IGN, f"workspace member {m}: its src/ is excluded from the build context")

# ============================== compose.yml ==============================
CF = "docker/compose.yml"
raw = ""
try:
    raw = read(CF)
except FileNotFoundError:
    pass
compose = load_yaml(CF)
if compose is None:
    fail("the checks that need docker/compose.yml did not run")
services = compose.get("services") or {}
for name in ("postgres", "rabbitmq", "relay-init", "relay", "producer", "prometheus", "grafana"):
    if name not in services:
        err(CF, f"service {name} is missing")

# Compose interpolates $VAR / ${VAR}: a shell `$` must be written `$$`.
for n, line in enumerate(raw.splitlines(), 1):
    if line.lstrip().startswith("#"):
        continue
    for m in re.finditer(r"\$(\{[^}]*\}?|\w+|.?)", line.replace("$$", "")):
        if not re.match(r"\{\w+:?[-?][^}]*\}", m.group(1)):
            err(f"{CF}:{n}", f"`${m.group(1)}`: compose interpolates `$` from the host's environment (write `$$` for a literal `$`, or ${{VAR:-default}})")

VALID_CONDITIONS = {"service_started", "service_healthy", "service_completed_successfully"}
deps = {}
for name, svc in services.items():
    svc = svc or {}
    d = svc.get("depends_on") or {}
    if isinstance(d, list):
        d = {x: {"condition": "service_started"} for x in d}
    deps[name] = d
    for dep, spec in d.items():
        if dep not in services:
            err(CF, f"service {name} depends on {dep}, which is not defined")
        cond = (spec or {}).get("condition", "service_started")
        if cond not in VALID_CONDITIONS:
            err(CF, f"service {name}: depends_on {dep} has an unknown condition {cond}")
        if cond == "service_healthy" and dep in services and not (services[dep] or {}).get("healthcheck"):
            err(CF, f"service {name} waits for {dep} to be healthy, but {dep} has no healthcheck")

# No dependency cycle.
state = {}
def visit(n, path):
    if state.get(n) == 1:
        err(CF, "depends_on cycle: " + " -> ".join(path + [n]))
        return
    if state.get(n) == 2:
        return
    state[n] = 1
    for d in deps.get(n, {}):
        if d in services:
            visit(d, path + [n])
    state[n] = 2
for n in services:
    visit(n, [])

# Bind mounts exist in the repository; named volumes are declared.
mounts = {}  # service -> [(host path relative to ROOT, container path)]
declared_volumes = set((compose.get("volumes") or {}).keys())
for name, svc in services.items():
    for v in (svc or {}).get("volumes") or []:
        if isinstance(v, dict):
            src, dst, typ = v.get("source", ""), v.get("target", ""), v.get("type", "volume")
        else:
            parts = v.split(":")
            src, dst = parts[0], (parts[1] if len(parts) > 1 else parts[0])
            typ = "bind" if src.startswith((".", "/", "~")) else "volume"
        if typ == "bind":
            host = os.path.normpath(os.path.join(DOCKER, src))
            rel = os.path.relpath(host, ROOT)
            if rel.startswith(".."):
                err(CF, f"service {name} mounts {src}, which is outside the repository")
            elif not os.path.exists(host):
                err(CF, f"service {name} mounts {src} ({rel}), which does not exist")
            mounts.setdefault(name, []).append((rel, dst))
        elif src and src not in declared_volumes:
            err(CF, f"service {name} uses volume {src}, which is not declared under volumes:")
    for ef in (svc or {}).get("env_file") or []:
        ef = ef if isinstance(ef, str) else ef.get("path", "")
        if not os.path.exists(os.path.join(DOCKER, ef)):
            err(CF, f"service {name}: env_file {ef} does not exist")
    b = (svc or {}).get("build")
    if b:
        ctx = b if isinstance(b, str) else b.get("context", ".")
        ctx_abs = os.path.normpath(os.path.join(DOCKER, ctx))
        if ctx_abs != ROOT:
            err(CF, f"service {name} builds with context {ctx}: it must be the repository root (..)")
        dockerfile = "Dockerfile" if isinstance(b, str) else b.get("dockerfile", "Dockerfile")
        if os.path.normpath(os.path.join(ctx_abs, dockerfile)) != os.path.join(DOCKER, "Dockerfile"):
            err(CF, f"service {name} builds {dockerfile}, expected docker/Dockerfile")


def env_of(svc):
    e = (svc or {}).get("environment") or {}
    if isinstance(e, list):
        e = dict((x.split("=", 1) + [""])[:2] for x in e)
    return {k: ("" if v is None else str(v)) for k, v in e.items()}


def test_of(svc):
    t = ((svc or {}).get("healthcheck") or {}).get("test")
    return " ".join(t) if isinstance(t, list) else str(t or "")


def cond(a, b):
    return ((deps.get(a) or {}).get(b) or {}).get("condition")


pg, rmq = services.get("postgres") or {}, services.get("rabbitmq") or {}
init, relay = services.get("relay-init") or {}, services.get("relay") or {}
prod, prom, graf = services.get("producer") or {}, services.get("prometheus") or {}, services.get("grafana") or {}

# postgres
if pg:
    if not re.match(r"postgres:1[67]\b", str(pg.get("image", ""))):
        err(CF, f"postgres: image {pg.get('image')} is not postgres:16 or postgres:17")
    c = pg.get("command") or []
    c = c.split() if isinstance(c, str) else [str(x) for x in c]
    settings = [c[i + 1] for i, x in enumerate(c[:-1]) if x == "-c"] + [x[2:] for x in c if x.startswith("-c") and len(x) > 2]
    if not c or c[0] != "postgres" or "wal_level=logical" not in settings:
        err(CF, "postgres: command must be postgres -c wal_level=logical ...")
    if "pg_isready" not in test_of(pg):
        err(CF, "postgres: the healthcheck must use pg_isready")
    init_sql = [d for s, d in mounts.get("postgres", []) if s == "sql/outbox.sql"]
    if not any(d.startswith("/docker-entrypoint-initdb.d/") for d in init_sql):
        err(CF, "postgres: sql/outbox.sql is not mounted into /docker-entrypoint-initdb.d/")
    pg_env = env_of(pg)
else:
    pg_env = {}

# rabbitmq
if rmq:
    if not re.match(r"rabbitmq:3[\w.-]*-management", str(rmq.get("image", ""))):
        err(CF, f"rabbitmq: image {rmq.get('image')} is not rabbitmq:3-management")
    if not test_of(rmq):
        err(CF, "rabbitmq: no healthcheck")

# the relay's services
relay_envs = {}
for name in ("relay-init", "relay"):
    svc = services.get(name)
    if not svc:
        continue
    if not svc.get("build"):
        err(CF, f"{name}: no build: section (docker/Dockerfile)")
    e = env_of(svc)
    relay_envs[name] = e
    for k in e:
        if k.startswith("OUTBOX_RELAY_") and ENV_KEYS and k not in ENV_KEYS:
            err(CF, f"{name}: {k} is not a configuration key of the relay (it refuses unknown OUTBOX_RELAY_* variables)")
if init and relay and init.get("image") != relay.get("image"):
    err(CF, "relay-init and relay should run the same image tag")
if init:
    if [str(x) for x in init.get("command") or []] != ["slot", "create", "--if-not-exists"]:
        err(CF, 'relay-init: command must be ["slot", "create", "--if-not-exists"]')
    if cond("relay-init", "postgres") != "service_healthy":
        err(CF, "relay-init: must depend on postgres with condition service_healthy")
    if str(init.get("restart", "no")) not in ("no", "False", "false"):
        err(CF, "relay-init runs once: restart must be \"no\"")
if relay:
    if cond("relay", "relay-init") != "service_completed_successfully":
        err(CF, "relay: must depend on relay-init with condition service_completed_successfully")
    if cond("relay", "rabbitmq") != "service_healthy":
        err(CF, "relay: must depend on rabbitmq with condition service_healthy")
    if "/readyz" not in test_of(relay):
        err(CF, "relay: the healthcheck must probe /readyz")
    c = relay.get("command")
    if c not in (None, ["run"], "run"):
        err(CF, f"relay: command should be run, found {c}")
    for k in ("OUTBOX_RELAY_POSTGRES_URL", "OUTBOX_RELAY_RABBITMQ_URL", "OUTBOX_RELAY_RABBITMQ_EXCHANGE"):
        if k not in relay_envs.get("relay", {}):
            err(CF, f"relay: {k} is not set")
    if "outbox-relay-healthcheck" in test_of(relay) and "outbox-relay-healthcheck" not in df_text:
        err(CF, "relay: the healthcheck runs outbox-relay-healthcheck, which docker/Dockerfile does not install")
    listen = relay_envs.get("relay", {}).get("OUTBOX_RELAY_RELAY_METRICS_LISTEN", "0.0.0.0:9187")
    if listen.startswith("127.") or listen.startswith("localhost") or listen == "":
        err(CF, f"relay: metrics listen on {listen!r}, unreachable by Prometheus")

# Published ports only on loopback: the demo's passwords are public (postgres/postgres,
# admin/admin), so no service is reachable from other machines.
for name, svc in services.items():
    for p in (svc or {}).get("ports") or []:
        if isinstance(p, dict):
            host_ip = str(p.get("host_ip", ""))
        else:
            parts = str(p).split(":")
            host_ip = ":".join(parts[:-2]) if len(parts) >= 3 else ""
        if host_ip != "127.0.0.1":
            err(CF, f"{name}: port {p} is published on every interface: bind it to 127.0.0.1 (\"127.0.0.1:HOST:CONTAINER\")")

# The relay's Postgres URL matches the database the postgres service creates.
for name, e in relay_envs.items():
    u = e.get("OUTBOX_RELAY_POSTGRES_URL")
    if not u or not pg:
        continue
    p = urlsplit(u)
    if p.hostname not in services:
        err(CF, f"{name}: OUTBOX_RELAY_POSTGRES_URL host {p.hostname} is not a service")
    db = p.path.lstrip("/")
    if db != pg_env.get("POSTGRES_DB", pg_env.get("POSTGRES_USER", "postgres")):
        err(CF, f"{name}: OUTBOX_RELAY_POSTGRES_URL names database {db}, postgres creates {pg_env.get('POSTGRES_DB')}")
    user, pw = unquote(p.username or ""), unquote(p.password or "")
    if user == pg_env.get("POSTGRES_USER", "postgres"):
        if pw != pg_env.get("POSTGRES_PASSWORD"):
            err(CF, f"{name}: the Postgres password does not match POSTGRES_PASSWORD")
    elif user == "outbox_relay":
        if not any(s == "sql/role.sql" and d.startswith("/docker-entrypoint-initdb.d/") for s, d in mounts.get("postgres", [])):
            err(CF, f"{name}: logs in as outbox_relay, but sql/role.sql is not an init script of postgres")
        if pw != pg_env.get("RELAY_DB_PASSWORD"):
            err(CF, f"{name}: the outbox_relay password does not match RELAY_DB_PASSWORD on postgres")
    else:
        err(CF, f"{name}: logs in to Postgres as {user}, a role nothing creates")

# producer
if prod:
    text = json.dumps(prod.get("command")) + json.dumps(prod.get("entrypoint"))
    if "psql" not in text or "INSERT INTO outbox" not in text:
        err(CF, "producer: should insert into outbox with psql")
    if not any(cond("producer", d) in ("service_healthy", "service_completed_successfully") for d in ("postgres", "relay-init")):
        err(CF, "producer: must wait for postgres (healthy) or relay-init (completed)")

# ============================== RabbitMQ definitions ==============================
defs = None
for rel, dst in mounts.get("rabbitmq", []):
    if rel.endswith(".json"):
        try:
            defs = json.loads(read(rel))
        except json.JSONDecodeError as e:
            err(rel, f"not valid JSON: {e}")
        confs = [read(r) for r, d in mounts.get("rabbitmq", []) if r.endswith(".conf")]
        if not any(re.search(rf"^\s*load_definitions\s*=\s*{re.escape(dst)}\s*$", c, re.M) for c in confs):
            err(CF, f"rabbitmq: {rel} is mounted at {dst} but no mounted .conf sets load_definitions = {dst}")
        for c, d in [(r, d) for r, d in mounts.get("rabbitmq", []) if r.endswith(".conf")]:
            if not d.startswith("/etc/rabbitmq/conf.d/"):
                err(CF, f"rabbitmq: {c} should be mounted under /etc/rabbitmq/conf.d/ (it would replace the image's defaults)")
if defs is not None:
    for name, e in relay_envs.items():
        u = e.get("OUTBOX_RELAY_RABBITMQ_URL")
        if not u:
            continue
        p = urlsplit(u)
        if p.hostname not in services:
            err(CF, f"{name}: OUTBOX_RELAY_RABBITMQ_URL host {p.hostname} is not a service")
        user, pw = unquote(p.username or ""), unquote(p.password or "")
        vhost = unquote(p.path[1:]) if len(p.path) > 1 else "/"
        users = {x["name"]: x for x in defs.get("users", [])}
        if user not in users:
            err("docker/rabbitmq/definitions.json", f"defines no user {user!r} ({name}'s OUTBOX_RELAY_RABBITMQ_URL); importing definitions skips the default guest user")
        else:
            h = base64.b64decode(users[user].get("password_hash", ""))
            if users[user].get("hashing_algorithm") != "rabbit_password_hashing_sha256" or hashlib.sha256(h[:4] + pw.encode()).digest() != h[4:]:
                err("docker/rabbitmq/definitions.json", f"user {user}'s password hash does not match the password in {name}'s OUTBOX_RELAY_RABBITMQ_URL")
        if not any(x.get("user") == user and x.get("vhost") == vhost for x in defs.get("permissions", [])):
            err("docker/rabbitmq/definitions.json", f"user {user} has no permissions on vhost {vhost}")
        if name != "relay":
            continue
        xname = e.get("OUTBOX_RELAY_RABBITMQ_EXCHANGE", example.get("rabbitmq", {}).get("exchange"))
        # Least privilege (docs/security.md, "Privileges"): no tags, no read, and
        # configure/write on the relay's exchange only.
        DEFS = "docker/rabbitmq/definitions.json"
        if (users.get(user) or {}).get("tags"):
            err(DEFS, f"the relay's user {user} has tags {users[user]['tags']}: it needs none (no management, no administrator)")
        perms = [x for x in defs.get("permissions", []) if x.get("user") == user and x.get("vhost") == vhost]
        for x in perms:
            def matches(kind, target):
                pat = x.get(kind, "")
                return pat != "" and re.search(pat, target) is not None
            if matches("read", xname) or matches("read", "outbox.demo") or matches("read", "any.queue"):
                err(DEFS, f"the relay's user {user} may read ({x.get('read')!r}): it consumes nothing, give it read \"^$\"")
            for kind in ("configure", "write"):
                if not matches(kind, xname):
                    err(DEFS, f"the relay's user {user} may not {kind} exchange {xname}, which it publishes to (and declares)")
                for other in ("outbox.demo", "amq.topic", "another-exchange", f"{xname}.x", f"x{xname}"):
                    if matches(kind, other):
                        err(DEFS, f"the relay's user {user} may {kind} {other!r} ({x.get(kind)!r}): limit it to ^{xname}$")
        xtype = e.get("OUTBOX_RELAY_RABBITMQ_EXCHANGE_TYPE", example.get("rabbitmq", {}).get("exchange_type"))
        xs = [x for x in defs.get("exchanges", []) if x.get("name") == xname and x.get("vhost") == vhost]
        if xs and (xs[0].get("type") != xtype or not xs[0].get("durable") or xs[0].get("auto_delete") or xs[0].get("internal") or xs[0].get("arguments")):
            err("docker/rabbitmq/definitions.json", f"exchange {xname} differs from what the relay declares (durable {xtype}, no arguments): the declaration would fail")
        if not any(b.get("source") == xname and b.get("vhost") == vhost for b in defs.get("bindings", [])):
            err("docker/rabbitmq/definitions.json", f"nothing is bound to exchange {xname}: every message would be unroutable and retried")
        queues = {q.get("name") for q in defs.get("queues", [])}
        for b in defs.get("bindings", []):
            if b.get("destination_type") == "queue" and b.get("destination") not in queues:
                err("docker/rabbitmq/definitions.json", f"binding to undefined queue {b.get('destination')}")
        for q in defs.get("queues", []):
            if (q.get("arguments") or {}).get("x-overflow") == "reject-publish":
                err("docker/rabbitmq/definitions.json", f"queue {q.get('name')} rejects publishes when full: the relay would be nacked forever")
elif rmq:
    err(CF, "rabbitmq: no definitions .json is mounted (exchange, queue and user for the demo)")

# ============================== Prometheus ==============================
relay_port = (relay_envs.get("relay", {}).get("OUTBOX_RELAY_RELAY_METRICS_LISTEN") or "0.0.0.0:9187").rsplit(":", 1)[-1]
PF = "docker/prometheus.yml"
if not any(s == PF and d == "/etc/prometheus/prometheus.yml" for s, d in mounts.get("prometheus", [])):
    err(CF, f"prometheus: {PF} is not mounted at /etc/prometheus/prometheus.yml")
pcfg = load_yaml(PF) or {}
targets = [t for j in pcfg.get("scrape_configs") or [] for sc in j.get("static_configs") or [] for t in sc.get("targets") or []]
if f"relay:{relay_port}" not in targets:
    err(PF, f"no scrape target relay:{relay_port} (the relay's metrics port)")
for t in targets:
    host = t.rsplit(":", 1)[0]
    if host not in services and host not in ("localhost", "127.0.0.1"):
        err(PF, f"scrape target {t}: {host} is not a compose service")
for j in pcfg.get("scrape_configs") or []:
    if j.get("metrics_path", "/metrics") != "/metrics":
        err(PF, f"job {j.get('job_name')}: the relay serves /metrics, not {j.get('metrics_path')}")

# ============================== Grafana ==============================
gmounts = dict(mounts.get("grafana", []))
if gmounts.get("docker/grafana/provisioning") != "/etc/grafana/provisioning":
    err(CF, "grafana: docker/grafana/provisioning is not mounted at /etc/grafana/provisioning")
DSF = "docker/grafana/provisioning/datasources/prometheus.yml"
dsc = load_yaml(DSF) or {}
ds_uids = set()
for ds in dsc.get("datasources") or []:
    if ds.get("type") != "prometheus":
        continue
    if not ds.get("uid"):
        err(DSF, f"datasource {ds.get('name')} has no uid (the dashboard refers to it by uid)")
    ds_uids.add(ds.get("uid"))
    host = urlsplit(ds.get("url", "")).hostname
    if host not in services:
        err(DSF, f"datasource {ds.get('name')} points at {ds.get('url')}, and {host} is not a compose service")
if not ds_uids:
    err(DSF, "no Prometheus datasource")
if dsc.get("apiVersion") != 1:
    err(DSF, "apiVersion must be 1")
DBF = "docker/grafana/provisioning/dashboards/dashboards.yml"
dbc = load_yaml(DBF) or {}
if dbc.get("apiVersion") != 1:
    err(DBF, "apiVersion must be 1")
provider_paths = [((p.get("options") or {}).get("path")) for p in dbc.get("providers") or []]
dash_dir = gmounts.get("docker/grafana/dashboards")
if not dash_dir:
    err(CF, "grafana: docker/grafana/dashboards is not mounted")
elif dash_dir not in provider_paths:
    err(DBF, f"no provider reads {dash_dir}, where compose mounts docker/grafana/dashboards")

# --- the dashboard and its PromQL ---
DJ = "docker/grafana/dashboards/outbox-relay.json"
try:
    dash = json.loads(read(DJ))
except (FileNotFoundError, json.JSONDecodeError) as e:
    dash = {}
    err(DJ, f"cannot read it: {e}")

KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
            "and", "or", "unless", "inf", "nan", "atan2"}
RANGE_FUNCS = {"rate", "irate", "increase"}  # counters (or histogram series) only


def strip_strings(expr):
    return re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)


def metric_names(expr):
    """The series names an expression selects."""
    e = strip_strings(expr)
    e = re.sub(r"\$\{[^}]*\}|\$\w+", "", e)               # Grafana variables
    e = re.sub(r"\{[^}]*\}", "", e)                          # label matchers
    e = re.sub(r"\[[^\]]*\]", "", e)                         # ranges, subqueries
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    e = re.sub(r"\boffset\s+-?\w+", " ", e)
    e = re.sub(r"@\s*[\w.()]+", " ", e)
    names = []
    for m in re.finditer(r"(?<![\w.])([a-zA-Z_:][\w:]*)(\s*\()?", e):
        name, call = m.group(1), m.group(2)
        if call or name.lower() in KEYWORDS:
            continue
        names.append(name)
    return names


def calls(expr, fname):
    """The argument text of every call of fname in expr."""
    out = []
    for m in re.finditer(rf"\b{fname}\s*\(", expr):
        depth, i = 1, m.end()
        while i < len(expr) and depth:
            depth += {"(": 1, ")": -1}.get(expr[i], 0)
            i += 1
        out.append(expr[m.end(): i - 1])
    return out


used = set()


def check_expr(where, expr, need_metric=True):
    e = strip_strings(expr)
    if e.count("(") != e.count(")") or e.count("{") != e.count("}") or e.count("[") != e.count("]"):
        err(where, f"unbalanced brackets in {expr!r}")
    names = metric_names(expr)
    for n in names:
        if n not in SERIES:
            hint = "" if not n.startswith("outbox_relay_") else " (misspelt? the relay's metrics: " + ", ".join(sorted(COUNTERS | GAUGES | HISTOGRAMS)) + ")"
            err(where, f"{n} is not a metric the relay exports{hint}")
        used.add(n)
    if need_metric and not names:
        err(where, f"{expr!r} selects no metric")
    for f in RANGE_FUNCS:
        for arg in calls(expr, f):
            for n in metric_names(arg):
                if n in GAUGES:
                    err(where, f"{f}() over the gauge {n}: use it directly or deriv()")
    for arg in calls(expr, "histogram_quantile"):
        inner = metric_names(arg)
        if not inner or any(not n.endswith("_bucket") for n in inner):
            err(where, f"histogram_quantile over {inner}: it needs a _bucket series")
        if not re.search(r"\b(by|without)\s*\([^)]*\ble\b", arg) and "sum" in arg:
            err(where, "histogram_quantile: the aggregation must keep the le label (sum by (le) ...)")
    for lbl, allowed in LABEL_VALUES.items():
        for m in re.finditer(rf'\b{lbl}\s*(=~|!~|!=|=)\s*"([^"]*)"', expr):
            vals = m.group(2).split("|") if "~" in m.group(1) else [m.group(2)]
            for v in vals:
                if v not in allowed:
                    err(where, f'label {lbl}="{v}": the relay sets {lbl} to one of {sorted(allowed)}')


def walk(panels):
    for p in panels or []:
        yield p
        yield from walk(p.get("panels"))


if dash:
    sv = dash.get("schemaVersion")
    if not isinstance(sv, int) or not 36 <= sv <= 41:
        err(DJ, f"schemaVersion {sv}: expected 36..41 (Grafana 10/11)")
    for k in ("uid", "title", "panels"):
        if not dash.get(k):
            err(DJ, f"no {k}")
    ids, kinds = set(), set()
    for p in walk(dash.get("panels")):
        where = f"{DJ}: panel {p.get('id')} {p.get('title')!r}"
        if p.get("id") in ids:
            err(where, "duplicate panel id")
        ids.add(p.get("id"))
        g = p.get("gridPos") or {}
        if not all(isinstance(g.get(k), int) for k in "xywh") or g["x"] + g["w"] > 24 or g["x"] < 0:
            err(where, f"gridPos {g} does not fit the 24-column grid")
        if p.get("type") == "row":
            continue
        kinds.add(p.get("type"))
        pds = (p.get("datasource") or {}).get("uid")
        targets = p.get("targets") or []
        if not targets:
            err(where, "no queries")
        refs = [t.get("refId") for t in targets]
        if len(set(refs)) != len(refs):
            err(where, f"duplicate refIds {refs}")
        for t in targets:
            uid = (t.get("datasource") or {}).get("uid", pds)
            if uid not in ds_uids and not str(uid).startswith("$"):
                err(where, f"datasource uid {uid!r} is not provisioned ({sorted(ds_uids)})")
            if not t.get("expr"):
                err(where, f"query {t.get('refId')} has no expr")
            else:
                check_expr(f"{where} {t.get('refId')}", t["expr"])
    for v in (dash.get("templating") or {}).get("list") or []:
        if v.get("type") != "query":
            continue
        q = v.get("query")
        q = q.get("query", "") if isinstance(q, dict) else str(q or "")
        m = re.fullmatch(r"\s*label_values\((.*)\)\s*", q)
        sel = m.group(1).rsplit(",", 1)[0] if m and "," in m.group(1) else (m.group(1) if m else q)
        check_expr(f"{DJ}: variable {v.get('name')}", sel)
    titles = " ".join(str(p.get("title", "")).lower() for p in walk(dash.get("panels")))
    for word in ("throughput", "lag", "latency", "errors", "in flight"):
        if word not in titles:
            err(DJ, f"no panel or row about {word}")
    for n in sorted(COUNTERS | GAUGES):
        if n not in used:
            err(DJ, f"metric {n} is on no panel")
    for h in HISTOGRAMS:
        if h + "_bucket" not in used:
            err(DJ, f"histogram {h} has no quantile panel")
    exprs = [t.get("expr", "") for p in walk(dash.get("panels")) for t in p.get("targets") or []]
    for q in ("0.5", "0.99"):
        if not any(re.search(rf"histogram_quantile\(\s*{re.escape(q)}\s*,", e) for e in exprs):
            err(DJ, f"no p{q[2:] if q != '0.5' else '50'} latency (histogram_quantile({q}, ...))")

# ============================== the alerting rules ==============================
# Their expressions name only exported metrics, and each alert has a dashboard panel
# (its description names the alert) plotting every metric the alert reads.
RF = "deploy/prometheus/outbox-relay.rules.yml"
rules_doc = load_yaml(RF) or {}
alert_rules = [r for g in rules_doc.get("groups") or [] for r in g.get("rules") or [] if "alert" in r]
if not alert_rules:
    err(RF, "no alerting rules")
dash_panels = [p for p in walk(dash.get("panels")) if p.get("type") != "row"] if dash else []
for r in alert_rules:
    where = f"{RF}: alert {r['alert']}"
    check_expr(where, r.get("expr", ""))
    wanted = set(metric_names(r.get("expr", "")))
    covering = [p for p in dash_panels if r["alert"] in str(p.get("description", ""))]
    if not covering:
        err(DJ, f"no panel for alert {r['alert']} (a panel whose description names it)")
    elif not any(wanted <= {n for t in p.get("targets") or [] for n in metric_names(t.get("expr", ""))} for p in covering):
        err(DJ, f"the panel for alert {r['alert']} does not plot {sorted(wanted)}")
if not any(s == RF and d.startswith("/etc/prometheus/") for s, d in mounts.get("prometheus", [])):
    err(CF, f"prometheus: {RF} is not mounted under /etc/prometheus/")
else:
    rule_dst = [d for s, d in mounts.get("prometheus", []) if s == RF][0]
    if rule_dst not in (pcfg.get("rule_files") or []):
        err(PF, f"rule_files does not load {rule_dst}, where compose mounts {RF}")

# ============================== the health-check script ==============================
HC = "docker/healthcheck.sh"
if not os.access(os.path.join(ROOT, HC), os.X_OK):
    err(HC, "not executable (the image runs it directly)")
else:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b"ready\n" if self.path == "/readyz" else b"not ready\n"
            self.send_response(200 if self.path == "/readyz" else 503)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    class Server(http.server.ThreadingHTTPServer):
        def handle_error(self, request, client_address):
            pass

    srv = Server(("127.0.0.1", 0), Handler)
    port = srv.server_address[1]
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    env = dict(os.environ, OUTBOX_RELAY_RELAY_METRICS_LISTEN=f"0.0.0.0:{port}")

    def probe(*args):
        return subprocess.run(["bash", HC, *args], env=env, capture_output=True, timeout=20).returncode

    if probe("/readyz") != 0:
        err(HC, "exits non-zero although /readyz answers 200")
    if probe("/not-ready") == 0:
        err(HC, "exits 0 although the endpoint answers 503")
    srv.shutdown()
    srv.server_close()
    if probe("/readyz") == 0:
        err(HC, "exits 0 although nothing listens")

if errors:
    fail()
print(f"check-docker: OK — Dockerfile ({len(stages)} stages, build `{' '.join(BUILD)}`), "
      f"compose ({len(services)} services), prometheus, grafana provisioning, "
      f"dashboard ({len([p for p in walk(dash.get('panels')) if p.get('type') != 'row'])} panels, "
      f"{len(used)} series), {len(alert_rules)} alerts (metrics exported, each on a panel), "
      f"rabbitmq definitions, health-check script")
PY
