#!/usr/bin/env bash
# Checks the Prometheus rules and the dashboard's PromQL with promtool (Debian's
# `prometheus` package, installed the first time if missing):
#   1. `promtool check rules` on deploy/prometheus/outbox-relay.rules.yml;
#   2. `promtool test rules outbox-relay.rules.test.yml`, run plainly in
#      deploy/prometheus/ as a user would (the tests hold the annotations too), and
#      every alert has a test where it fires and one where it does not, and every
#      firing expectation names its annotations;
#   3. deploy/kubernetes/prometheusrule.yaml carries exactly the rules file's groups;
#   4. docs/operations.md's alert table names exactly the rules file's alerts;
#   5. every query of the Grafana dashboard parses (`promtool check rules` on them as
#      recording rules, Grafana's variables replaced).
# Which metrics the expressions may name is checked by scripts/check-docker.sh
# (against docs/operations.md's metrics table, which a Rust test keeps equal to what
# the binary registers). Read-only; a few seconds. Exits 1 on any problem.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if ! command -v promtool >/dev/null 2>&1; then
  echo "check-prometheus: installing promtool (Debian's prometheus package)" >&2
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi
python3 -c 'import yaml' 2>/dev/null || {
  echo "check-prometheus: FAILED: PyYAML is missing (scripts/check-docker.sh installs it)" >&2
  exit 1
}

RULES=deploy/prometheus/outbox-relay.rules.yml
TESTS=deploy/prometheus/outbox-relay.rules.test.yml
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

promtool check rules "$RULES" >"$WORK/check.log" 2>&1 || {
  cat "$WORK/check.log" >&2
  echo "check-prometheus: FAILED: promtool check rules $RULES" >&2
  exit 1
}

exec python3 - "$RULES" "$TESTS" "$WORK" <<'PY'
import json, os, re, subprocess, sys
import yaml

rules_path, tests_path, work = sys.argv[1:4]
errors = []


def err(where, msg):
    errors.append(f"{where}: {msg}")


rules = yaml.safe_load(open(rules_path))
alerts = [r for g in rules["groups"] for r in g["rules"] if "alert" in r]
names = [a["alert"] for a in alerts]

# ---- 2. promtool test rules, the plain command in the rules' directory
tests = yaml.safe_load(open(tests_path))
if tests.get("rule_files") != [os.path.basename(rules_path)]:
    err(tests_path, f"rule_files must be [{os.path.basename(rules_path)}]")
out = subprocess.run(["promtool", "test", "rules", os.path.basename(tests_path)],
                     cwd=os.path.dirname(tests_path), capture_output=True, text=True)
if out.returncode != 0:
    err(tests_path, "`promtool test rules " + os.path.basename(tests_path) + "` failed:\n" + (out.stdout + out.stderr).strip())
for t in tests.get("tests") or []:
    for case in t.get("alert_rule_test") or []:
        for exp in case.get("exp_alerts") or []:
            if "exp_annotations" not in exp:
                err(tests_path, f"{t.get('name')}: {case.get('alertname')} at {case.get('eval_time')} expects no annotations (the plain command compares them)")
fires, quiet = set(), set()
for t in tests.get("tests") or []:
    for case in t.get("alert_rule_test") or []:
        (fires if case.get("exp_alerts") else quiet).add(case.get("alertname"))
for n in names:
    if n not in fires:
        err(tests_path, f"no test where {n} fires")
    if n not in quiet:
        err(tests_path, f"no test where {n} stays quiet")
for n in (fires | quiet) - set(names):
    err(tests_path, f"tests alert {n}, which {rules_path} does not define")

# ---- 3. the PrometheusRule
PR = "deploy/kubernetes/prometheusrule.yaml"
try:
    pr = yaml.safe_load(open(PR))
    if pr.get("kind") != "PrometheusRule" or pr.get("apiVersion") != "monitoring.coreos.com/v1":
        err(PR, "not a monitoring.coreos.com/v1 PrometheusRule")
    if (pr.get("spec") or {}).get("groups") != rules["groups"]:
        err(PR, f"spec.groups differ from {rules_path}'s groups: copy them over")
except FileNotFoundError:
    err(PR, "missing")
kust = yaml.safe_load(open("deploy/kubernetes/kustomization.yaml"))
if "prometheusrule.yaml" not in (kust.get("resources") or []):
    err("deploy/kubernetes/kustomization.yaml", "does not list prometheusrule.yaml")

# ---- 4. the docs' alert table: rows "| `OutboxRelay...` | ..."
DOC = "docs/operations.md"
documented = re.findall(r"^\|\s*`(OutboxRelay\w+)`[^|]*\|", open(DOC, encoding="utf-8").read(), re.M)
for n in names:
    if n not in documented:
        err(DOC, f"alert {n} is not in the alert table (what it means, what to do)")
for n in documented:
    if n not in names:
        err(DOC, f"the alert table names {n}, which {rules_path} does not define")
if rules_path not in open(DOC, encoding="utf-8").read():
    err(DOC, f"does not link {rules_path}")

# ---- 5. the dashboard's queries parse
DJ = "docker/grafana/dashboards/outbox-relay.json"
dash = json.load(open(DJ))


def walk(panels):
    for p in panels or []:
        yield p
        yield from walk(p.get("panels"))


record = []
for p in walk(dash.get("panels")):
    for t in p.get("targets") or []:
        e = t.get("expr")
        if not e:
            continue
        e = re.sub(r"\$__(rate_)?interval|\$__range", "5m", e)
        e = re.sub(r"\$\{?\w+\}?", ".*", e)
        record.append({"record": f"dashboard:panel_{p.get('id')}:{t.get('refId')}", "expr": e})
path = os.path.join(work, "dashboard.rules.yml")
yaml.safe_dump({"groups": [{"name": "dashboard", "rules": record}]}, open(path, "w"))
out = subprocess.run(["promtool", "check", "rules", path], capture_output=True, text=True)
if out.returncode != 0:
    err(DJ, "a query does not parse:\n" + (out.stdout + out.stderr).strip())

if errors:
    print(f"check-prometheus: FAILED ({len(errors)} problem{'s' if len(errors) > 1 else ''})", file=sys.stderr)
    for e in errors:
        print(f"  - {e}", file=sys.stderr)
    sys.exit(1)
print(f"check-prometheus: OK — {len(names)} alerts pass promtool check and "
      f"{sum(len(t.get('alert_rule_test') or []) for t in tests['tests'])} unit-test evaluations "
      f"(each alert firing and quiet), {PR} matches, {DOC} documents every alert, "
      f"{len(record)} dashboard queries parse")
PY
