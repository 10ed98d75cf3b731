#!/usr/bin/env bash
# Validates deploy/kubernetes/ without a cluster:
#   1. every object against the Kubernetes OpenAPI schemas (strict: unknown fields are
#      errors), offline, with the schemas bundled in the PyPI package
#      kubernetes-validate, for the oldest supported and the newest bundled version;
#      the ServiceMonitor is a CRD (monitoring.coreos.com/v1) that package has no
#      schema for: its structure is checked by hand below instead (selector, port,
#      path), and its schema is not validated;
#   2. consistency with the relay's code: every OUTBOX_RELAY_* variable names a key of
#      crates/relay/src/config/keys.rs, the probe paths are routes of
#      crates/relay/src/metrics.rs, the probe port is the metrics_listen port, the
#      selectors match, the Secret and ConfigMap references resolve, the pod runs as
#      the image's non-root user, secrets are files of a Secret volume the relay
#      (uid 10001, fsGroup) may read and its mode check accepts, never environment
#      variables, metrics beyond loopback need the bearer token (which the
#      ServiceMonitor sends), a NetworkPolicy admits only the metrics port, and so on;
#   3. the ConfigMap's outbox-relay.toml is loaded by the relay itself (`outbox-relay
#      check`, with the URLs pointed at a closed local port: it prints `ok config`
#      once the configuration is valid, then fails to connect, which is expected).
#      Skipped, with a note, when neither a built binary nor cargo is at hand.
# Read-only and idempotent; installs PyYAML and kubernetes-validate with pip the
# first time if missing. Prints one line per problem and exits 1 if there is any.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# The oldest Kubernetes the manifests support (PodDisruptionBudget's
# unhealthyPodEvictionPolicy is beta, on by default, from 1.27).
K8S_MIN=1.27.0

pip_install() {
  python3 -m pip install --quiet "$@" 2>/dev/null \
    || python3 -m pip install --quiet --user "$@" 2>/dev/null \
    || python3 -m pip install --quiet --user --break-system-packages "$@" 2>/dev/null \
    || true
}
for mod in yaml:pyyaml kubernetes_validate:kubernetes-validate; do
  if ! python3 -c "import ${mod%%:*}" 2>/dev/null; then
    echo "check-k8s: ${mod#*:} is missing, installing it with pip" >&2
    pip_install "${mod#*:}"
    if ! python3 -c "import ${mod%%:*}" 2>/dev/null; then
      echo "check-k8s: FAILED: ${mod#*:} is missing and pip could not install it (python3 -m pip install ${mod#*:})" >&2
      exit 1
    fi
  fi
done

# The relay binary for step 3: OUTBOX_TEST_RELAY_BIN, else a fresh debug build.
RELAY_BIN="${OUTBOX_TEST_RELAY_BIN:-}"
if [[ -z "$RELAY_BIN" ]] && command -v cargo >/dev/null 2>&1; then
  if cargo build --quiet --locked -p outbox-relay --bin outbox-relay >&2; then
    RELAY_BIN="${CARGO_TARGET_DIR:-target}/debug/outbox-relay"
  else
    echo "check-k8s: FAILED: cargo build -p outbox-relay failed" >&2
    exit 1
  fi
fi
export RELAY_BIN K8S_MIN

exec python3 - <<'PY'
import glob, os, re, subprocess, sys, tempfile, tomllib
from urllib.parse import urlsplit, urlunsplit

import kubernetes_validate
import yaml

ROOT = os.getcwd()
K8S = "deploy/kubernetes"
errors, notes = [], []


def err(where, msg):
    errors.append(f"{where}: {msg}")


def read(rel):
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


# ---------------- the relay's code ----------------
ENV_RS = "crates/relay/src/config/keys.rs"
keys = re.findall(r'\("(\w+)",\s*"(\w+)",\s*Kind::\w+\)', read(ENV_RS))
if len(keys) < 10:
    err(ENV_RS, f"found only {len(keys)} keys in KEYS: the table's format changed, update scripts/check-k8s.sh")
CONFIG_KEYS = {(s, k) for s, k in keys}
ENV_VARS = {f"OUTBOX_RELAY_{s}_{k}".upper() for s, k in keys}
METRICS_RS = "crates/relay/src/metrics.rs"
ROUTES = set(re.findall(r'\.route\(\s*"([^"]+)"', read(METRICS_RS)))
for r in ("/metrics", "/healthz", "/readyz"):
    if r not in ROUTES:
        err(METRICS_RS, f"no route {r} found: the probe check cannot work")
DF = "docker/Dockerfile"
df = read(DF)
users = re.findall(r"^USER\s+(\d+)(?::(\d+))?\s*$", df, re.M)
IMAGE_UID = int(users[-1][0]) if users else None
IMAGE_ENV = dict(re.findall(r"(OUTBOX_RELAY_\w+)=(\S+)", df))
DEFAULT_SHUTDOWN_MS = 30000  # outbox-relay.example.toml

# ---------------- the manifests ----------------
objs = []  # (file, doc)
for path in sorted(glob.glob(f"{K8S}/*.yaml")):
    rel = os.path.relpath(path, ROOT)
    if os.path.basename(path) == "kustomization.yaml":
        continue
    try:
        docs = [d for d in yaml.safe_load_all(read(rel)) if d is not None]
    except yaml.YAMLError as e:
        err(rel, f"not valid YAML: {e}")
        continue
    for d in docs:
        objs.append((rel, d))

KF = f"{K8S}/kustomization.yaml"
try:
    kust = yaml.safe_load(read(KF)) or {}
except (FileNotFoundError, yaml.YAMLError) as e:
    kust = {}
    err(KF, f"cannot read it: {e}")
resources = kust.get("resources") or []
for r in resources:
    if not os.path.exists(os.path.join(ROOT, K8S, r)):
        err(KF, f"resource {r} does not exist")
listed = {os.path.join(K8S, r) for r in resources}
for rel in sorted({f for f, _ in objs}):
    if rel not in listed and not rel.endswith("-job.yaml"):
        err(KF, f"{rel} is not listed in resources")
image_tags = {i.get("name"): i.get("newTag") for i in kust.get("images") or []}

by_kind = {}
for rel, d in objs:
    by_kind.setdefault(d.get("kind"), []).append((rel, d))


def one(kind):
    got = by_kind.get(kind) or []
    if len(got) != 1:
        err(K8S, f"expected one {kind}, found {len(got)}")
        return None, {}
    return got[0]


# ---------------- 1. schemas ----------------
versions = [os.environ["K8S_MIN"], kubernetes_validate.utils.latest_version()]
validated = 0
for rel, d in objs:
    where = f"{rel}: {d.get('kind')} {(d.get('metadata') or {}).get('name')}"
    if d.get("apiVersion") == "monitoring.coreos.com/v1":
        checked = "its groups checked by scripts/check-prometheus.sh" if d.get("kind") == "PrometheusRule" else "structure checked below"
        notes.append(f"{d.get('kind')}: schema not validated (a Prometheus Operator CRD, no schema bundled); {checked}")
        continue
    for v in versions:
        try:
            kubernetes_validate.validate(d, v, strict=True)
        except kubernetes_validate.utils.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            err(where, f"Kubernetes {v} schema: {path}: {e.message}")
        except kubernetes_validate.utils.SchemaNotFoundError as e:
            err(where, e.message)
    validated += 1

# ---------------- 2. consistency ----------------
def labels_match(selector, labels):
    sel = (selector or {}).get("matchLabels", selector) or {}
    return bool(sel) and all(labels.get(k) == v for k, v in sel.items())


cm_rel, cm = one("ConfigMap")
sec_rel, sec = one("Secret")
dep_rel, dep = one("Deployment")
svc_rel, svc = one("Service")
pdb_rel, pdb = one("PodDisruptionBudget")
sm_rel, sm = one("ServiceMonitor")
cm_name = (cm.get("metadata") or {}).get("name")
sec_name = (sec.get("metadata") or {}).get("name")
sec_keys = set((sec.get("stringData") or {}).keys()) | set((sec.get("data") or {}).keys())
cm_data = cm.get("data") or {}

# The ConfigMap's configuration file: TOML, every key one the relay knows, no password.
config_file, config = None, {}
for name, text in cm_data.items():
    if name.endswith(".toml"):
        config_file = name
        try:
            config = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            err(cm_rel, f"{name} is not valid TOML: {e}")
        for section, table in config.items():
            if not isinstance(table, dict):
                err(cm_rel, f"{name}: {section} is not a [section]")
                continue
            for key, value in table.items():
                if (section, key) not in CONFIG_KEYS:
                    err(cm_rel, f"{name}: [{section}] {key} is not a configuration key of the relay ({ENV_RS})")
                if key.endswith("url") and "@" in str(value) and urlsplit(str(value)).password:
                    err(cm_rel, f"{name}: [{section}] {key} holds a password: put the URL in the Secret")
if config_file is None:
    err(cm_rel, "holds no .toml configuration file")

# The secret files the configuration names: passfile= of [postgres] url,
# [rabbitmq] password_file / stream_password_file, [relay] metrics_*_file.
SECRET_KEYS = {("rabbitmq", "password_file"), ("rabbitmq", "stream_password_file"),
               ("relay", "metrics_bearer_token_file"), ("relay", "metrics_basic_auth_password_file"),
               ("relay", "metrics_tls_key_file")}
secret_paths = [str(v) for sct, t in config.items() if isinstance(t, dict)
                for k, v in t.items() if (sct, k) in SECRET_KEYS and v]
pg_url = str((config.get("postgres") or {}).get("url", ""))
secret_paths += re.findall(r"[?&]passfile=([^&]+)", pg_url)
for path in secret_paths:
    if os.path.basename(path) not in sec_keys:
        err(cm_rel, f"{config_file} names {path}, but Secret {sec_name} has no key {os.path.basename(path)}")

pods = []  # (where, pod spec, labels)
if dep:
    pods.append((dep_rel, ((dep.get("spec") or {}).get("template") or {}).get("spec") or {},
                 (((dep.get("spec") or {}).get("template") or {}).get("metadata") or {}).get("labels") or {}))
for rel, job in by_kind.get("Job", []):
    t = (job.get("spec") or {}).get("template") or {}
    pods.append((rel, t.get("spec") or {}, (t.get("metadata") or {}).get("labels") or {}))

relay_env = {}
for where, spec, _ in pods:
    psc = spec.get("securityContext") or {}
    if spec.get("automountServiceAccountToken") is not False:
        err(where, "automountServiceAccountToken should be false (the relay never talks to the API server)")
    volumes = {v.get("name"): v for v in spec.get("volumes") or []}
    # The Secret's files: root's, readable by the relay through fsGroup, and within
    # the relay's rule for secret files (0640 or less when root owns them).
    for v in volumes.values():
        sv = v.get("secret") or {}
        if sv.get("secretName") != sec_name:
            continue
        mode = sv.get("defaultMode", 0o644)
        if mode & 0o037:
            err(where, f"volume {v.get('name')}: defaultMode {mode:o} gives the Secret's files group write or access to others: the relay refuses them; use 0440 with fsGroup")
        if psc.get("fsGroup") != IMAGE_UID or not mode & 0o040:
            err(where, f"volume {v.get('name')}: the relay (uid {IMAGE_UID}) cannot read the Secret's files, which root owns: set securityContext.fsGroup: {IMAGE_UID} and defaultMode 0440")
    for c in (spec.get("initContainers") or []) + (spec.get("containers") or []):
        cw = f"{where}: container {c.get('name')}"
        csc = c.get("securityContext") or {}
        non_root = csc.get("runAsNonRoot", psc.get("runAsNonRoot"))
        uid = csc.get("runAsUser", psc.get("runAsUser"))
        if non_root is not True:
            err(cw, "runAsNonRoot must be true")
        if IMAGE_UID is not None and uid != IMAGE_UID:
            err(cw, f"runAsUser {uid} is not the image's user {IMAGE_UID} ({DF})")
        if csc.get("readOnlyRootFilesystem") is not True:
            err(cw, "readOnlyRootFilesystem must be true")
        if csc.get("allowPrivilegeEscalation") is not False:
            err(cw, "allowPrivilegeEscalation must be false")
        if "ALL" not in ((csc.get("capabilities") or {}).get("drop") or []):
            err(cw, "capabilities must drop ALL")
        res = c.get("resources") or {}
        for kind in ("requests", "limits"):
            for r in ("cpu", "memory"):
                if r not in (res.get(kind) or {}):
                    err(cw, f"no resources.{kind}.{r}")
        env = {}
        for e in c.get("env") or []:
            name = e.get("name", "")
            if name.startswith("OUTBOX_RELAY_") and name not in ENV_VARS:
                err(cw, f"{name} is not a variable the relay reads ({ENV_RS}); the relay refuses unknown OUTBOX_RELAY_* variables")
            ref = (e.get("valueFrom") or {}).get("secretKeyRef")
            if ref:
                if ref.get("name") != sec_name:
                    err(cw, f"{name}: secretKeyRef names Secret {ref.get('name')}, defined is {sec_name}")
                elif ref.get("key") not in sec_keys:
                    err(cw, f"{name}: Secret {sec_name} has no key {ref.get('key')}")
                env[name] = ("secret", ref.get("key"))
            elif "value" in e:
                env[name] = ("value", str(e["value"]))
        # Secrets are files (a Secret volume), never environment variables: every
        # process of the pod and `kubectl describe` see those.
        for name, (kind, value) in env.items():
            if kind == "secret":
                err(cw, f"{name} comes from the Secret as an environment variable: mount the Secret as files and name them (passfile=, password_file, *_file)")
            elif "://" in value and urlsplit(value).password:
                err(cw, f"{name} holds a password: put it in the Secret, mounted as a file")
        secret_mounts = [m.get("mountPath", "").rstrip("/") for m in c.get("volumeMounts") or []
                         if ((volumes.get(m.get("name")) or {}).get("secret") or {}).get("secretName") == sec_name]
        for path in secret_paths:
            if not any(path.startswith(mp + "/") for mp in secret_mounts):
                err(cw, f"{path}, named by {config_file}, is not in a mount of Secret {sec_name}")
        if c.get("envFrom"):
            err(cw, "envFrom: name each variable (an unknown OUTBOX_RELAY_* key in the source would stop the relay)")
        args = c.get("args") or []
        if "--config" not in args:
            err(cw, "no --config: the relay would look for ./outbox-relay.toml")
        else:
            cfg_path = args[args.index("--config") + 1]
            mounted = False
            for m in c.get("volumeMounts") or []:
                v = volumes.get(m.get("name")) or {}
                if (v.get("configMap") or {}).get("name") == cm_name and cfg_path == f"{m.get('mountPath').rstrip('/')}/{config_file}":
                    mounted = True
            if not mounted:
                err(cw, f"--config {cfg_path} is not the ConfigMap's {config_file} mounted from {cm_name}")
        if where == dep_rel:
            relay_env = env

if dep:
    spec = dep.get("spec") or {}
    pod_spec = pods[0][1]
    pod_labels = pods[0][2]
    if (spec.get("replicas") or 1) < 2:
        err(dep_rel, "replicas < 2: no relay stands by to take over the slot")
    if not labels_match(spec.get("selector"), pod_labels):
        err(dep_rel, "the selector does not match the pod template's labels")
    relay = (pod_spec.get("containers") or [{}])[0]
    # The effective metrics_listen: the container's env > the file > the image's ENV.
    listen = relay_env.get("OUTBOX_RELAY_RELAY_METRICS_LISTEN", ("value", None))[1] \
        or (config.get("relay") or {}).get("metrics_listen") \
        or IMAGE_ENV.get("OUTBOX_RELAY_RELAY_METRICS_LISTEN")
    if not listen:
        err(dep_rel, "metrics_listen is empty: no /healthz, /readyz or /metrics")
        listen = ":0"
    host, _, port = listen.rpartition(":")
    if host.strip("[]") in ("127.0.0.1", "localhost", "::1"):
        err(dep_rel, f"metrics_listen {listen} is loopback: the probes and Prometheus cannot reach it")
    ports = {p.get("name"): p.get("containerPort") for p in relay.get("ports") or []}
    if int(port or 0) not in ports.values():
        err(dep_rel, f"no containerPort {port} (metrics_listen {listen})")
    for probe in ("livenessProbe", "readinessProbe"):
        pr = relay.get(probe)
        if not pr:
            err(dep_rel, f"no {probe}")
            continue
        http = pr.get("httpGet") or {}
        if http.get("path") not in ROUTES:
            err(dep_rel, f"{probe} path {http.get('path')} is not a route of the relay ({sorted(ROUTES)})")
        pp = http.get("port")
        if ports.get(pp, pp) != int(port or 0):
            err(dep_rel, f"{probe} port {pp} is not the metrics_listen port {port}")
    if (relay.get("livenessProbe") or {}).get("httpGet", {}).get("path") != "/healthz":
        err(dep_rel, "livenessProbe must be /healthz (alive), never /readyz (a relay waiting for the broker must not be restarted)")
    relay_cfg = config.get("relay") or {}
    token_file = relay_cfg.get("metrics_bearer_token_file")
    if host.strip("[]") not in ("127.0.0.1", "localhost", "::1") and not (
            token_file or relay_cfg.get("metrics_basic_auth_password_file")):
        err(cm_rel, f"metrics_listen {listen} is beyond loopback without credentials: anyone who reaches the pod reads /metrics and /poison; set [relay] metrics_bearer_token_file")
    policies = [(rel, d) for rel, d in by_kind.get("NetworkPolicy", [])
                if labels_match((d.get("spec") or {}).get("podSelector"), pod_labels)]
    if not policies:
        err(K8S, "no NetworkPolicy selects the relay's pods: the metrics port is open to every pod of the cluster")
    for rel, d in policies:
        ns = d.get("spec") or {}
        if "Ingress" not in (ns.get("policyTypes") or []):
            err(rel, "policyTypes lacks Ingress: it does not restrict who reaches the relay")
        for rule in ns.get("ingress") or []:
            if not rule.get("from"):
                err(rel, "an ingress rule admits every source: name Prometheus's pods")
            rule_ports = [p.get("port") for p in rule.get("ports") or []]
            if not rule_ports or any(ports.get(p, p) != int(port or 0) for p in rule_ports):
                err(rel, f"an ingress rule admits ports {rule_ports or 'all'}: only the metrics port {port} takes traffic")

    shutdown_ms = (config.get("relay") or {}).get("shutdown_timeout_ms", DEFAULT_SHUTDOWN_MS)
    grace = pod_spec.get("terminationGracePeriodSeconds", 30)
    if grace * 1000 <= shutdown_ms:
        err(dep_rel, f"terminationGracePeriodSeconds {grace} is not above shutdown_timeout_ms {shutdown_ms}: a clean stop would be killed")
    if relay.get("image") not in image_tags and relay.get("image", "").split(":")[0] not in image_tags:
        err(KF, f"no images entry for the Deployment's image {relay.get('image')}")
    for rel, job in by_kind.get("Job", []):
        for c in (((job.get("spec") or {}).get("template") or {}).get("spec") or {}).get("containers") or []:
            name = relay.get("image")
            want = f"{name}:{image_tags.get(name)}"
            if c.get("image") != want:
                err(rel, f"image {c.get('image')} differs from the Deployment's ({want}, from {KF})")

    if svc:
        s = svc.get("spec") or {}
        if not labels_match(s.get("selector"), pod_labels):
            err(svc_rel, "the selector does not match the relay's pods")
        svc_ports = {p.get("name"): p for p in s.get("ports") or []}
        for p in svc_ports.values():
            t = p.get("targetPort")
            if ports.get(t, t) != int(port or 0):
                err(svc_rel, f"targetPort {t} is not the metrics port {port}")
        if s.get("publishNotReadyAddresses") is not True:
            err(svc_rel, "publishNotReadyAddresses should be true: a relay that is not ready must still be scraped")
    if pdb:
        ps = pdb.get("spec") or {}
        if not labels_match(ps.get("selector"), pod_labels):
            err(pdb_rel, "the selector does not match the relay's pods")
        if ps.get("minAvailable") is not None and int(str(ps["minAvailable"]).rstrip("%")) >= (spec.get("replicas") or 1):
            err(pdb_rel, "minAvailable leaves nothing to evict: node drains would hang")

if sm and svc:
    ss = sm.get("spec") or {}
    if sm.get("kind") != "ServiceMonitor":
        err(sm_rel, f"kind {sm.get('kind')}")
    if not labels_match(ss.get("selector"), (svc.get("metadata") or {}).get("labels") or {}):
        err(sm_rel, f"the selector does not match Service {(svc.get('metadata') or {}).get('name')}'s labels")
    svc_port_names = {p.get("name") for p in (svc.get("spec") or {}).get("ports") or []}
    eps = ss.get("endpoints") or []
    if not eps:
        err(sm_rel, "no endpoints")
    for ep in eps:
        if ep.get("port") not in svc_port_names:
            err(sm_rel, f"endpoint port {ep.get('port')} is not a port name of the Service ({sorted(svc_port_names)})")
        if ep.get("path", "/metrics") not in ROUTES:
            err(sm_rel, f"endpoint path {ep.get('path')} is not a route of the relay")
        token_file = (config.get("relay") or {}).get("metrics_bearer_token_file")
        if token_file:
            cred = ((ep.get("authorization") or {}).get("credentials") or {})
            if (ep.get("authorization") or {}).get("type", "Bearer") != "Bearer" or \
                    cred.get("name") != sec_name or cred.get("key") != os.path.basename(token_file):
                err(sm_rel, f"endpoint {ep.get('port')}: the relay requires the bearer token of {token_file}; scrape with authorization credentials {{name: {sec_name}, key: {os.path.basename(token_file)}}}")
    allowed = {"selector", "endpoints", "jobLabel", "namespaceSelector", "podTargetLabels",
               "targetLabels", "sampleLimit", "scrapeProtocols", "attachMetadata", "labelLimit"}
    for k in ss:
        if k not in allowed:
            err(sm_rel, f"spec.{k}: not a ServiceMonitor field checked here; extend scripts/check-k8s.sh")

# ---------------- 3. the relay loads the configuration ----------------
relay_bin = os.environ.get("RELAY_BIN")
# Absolute: the check runs with its working directory in a temporary folder.
relay_bin = os.path.abspath(relay_bin) if relay_bin else None
if config_file and relay_bin and os.path.exists(relay_bin):
    def closed_port(url):
        # Keep the user, password and query (the relay checks them); reach nothing.
        p = urlsplit(url)
        creds = p.netloc.rsplit("@", 1)[0] + "@" if "@" in p.netloc else ""
        return urlunsplit((p.scheme, f"{creds}127.0.0.1:1", p.path, p.query, p.fragment))

    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_RELAY_")}
    for name, (kind, value) in relay_env.items():
        env[name] = value
    env["OUTBOX_RELAY_RELAY_METRICS_LISTEN"] = "127.0.0.1:0"
    env["RUST_LOG"] = "error"
    with tempfile.TemporaryDirectory() as tmp:
        # The Secret's files as the pod has them (owner-only here), at a path of the
        # temporary directory instead of the mount's.
        text = cm_data[config_file]
        secret_dir = os.path.join(tmp, "secrets")
        os.makedirs(secret_dir)
        for key, value in (sec.get("stringData") or {}).items():
            with open(os.path.join(secret_dir, key), "w", encoding="utf-8") as f:
                f.write(value)
            os.chmod(os.path.join(secret_dir, key), 0o600)
        for path in secret_paths:
            text = text.replace(os.path.dirname(path) + "/", secret_dir + "/")
        reloaded = tomllib.loads(text)
        for section, var in (("postgres", "OUTBOX_RELAY_POSTGRES_URL"), ("rabbitmq", "OUTBOX_RELAY_RABBITMQ_URL")):
            url = (reloaded.get(section) or {}).get("url")
            if url and var not in env:
                env[var] = closed_port(url)
        path = os.path.join(tmp, config_file)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        try:
            out = subprocess.run([relay_bin, "--config", path, "check"], env=env, cwd=tmp,
                                 capture_output=True, text=True, timeout=60)
            if not out.stdout.startswith("ok    config:"):
                err(cm_rel, f"the relay rejects {config_file}: {out.stderr.strip() or out.stdout.strip()}")
        except subprocess.TimeoutExpired:
            err(cm_rel, "`outbox-relay check` did not finish in 60 s")
else:
    notes.append("the relay's own configuration check skipped (no binary: set OUTBOX_TEST_RELAY_BIN or install cargo)")

if errors:
    print(f"check-k8s: FAILED ({len(errors)} problem{'s' if len(errors) > 1 else ''})", file=sys.stderr)
    for e in errors:
        print(f"  - {e}", file=sys.stderr)
    sys.exit(1)
for n in notes:
    print(f"check-k8s: note: {n}")
print(f"check-k8s: OK — {len(objs)} objects in {K8S} ({validated} against the Kubernetes "
      f"{' and '.join(versions)} schemas), consistent with {ENV_RS}, {METRICS_RS} and {DF}; "
      f"the relay loads the ConfigMap's {config_file}")
PY
