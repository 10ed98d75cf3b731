//! What RabbitMQ 4 refuses, or changes by default, in what the relay is set up with:
//! `check` names each hazard with its fix on every broker, so that an upgrade from 3.x
//! is seen coming (docs/operations.md, "RabbitMQ 4").
//!
//! ```text
//!   [topology] (always)        a transient non-exclusive queue      (durable = false)
//!                              x-queue-master-locator                (deprecated)
//!                              a quorum queue without a DLX          (4.0: delivery limit 20)
//!   management API (when       policies with ha-* keys               (classic mirroring, removed)
//!   management_url is set)     policies with queue-master-locator    (deprecated)
//!                              /api/deprecated-features/used         (3.13+; what the broker saw)
//! ```
//!
//! A quorum queue's dead-letter exchange or delivery limit may come from a policy:
//! with the management API, the queue's effective policy is read, and a policy that
//! sets either clears the hazard. Every hazard is a `warn` line: `run` does not depend
//! on them, and on 3.x nothing is refused yet.

use publisher::settings::{QueueType, TopologyConfig};
use serde_json::Value;

use super::routes::management::{encode, Management};
use super::{line, Status};
use crate::config::Config;

/// One hazard: the object it is about and what to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Hazard {
    pub name: String,
    pub detail: String,
}

fn hazard(name: String, detail: &str) -> Hazard {
    Hazard {
        name,
        detail: detail.to_string(),
    }
}

/// The hazards of `[topology]` alone. `dead_lettered(queue)` says whether a policy
/// on the broker gives the quorum queue a dead-letter exchange or a delivery limit.
pub(crate) fn of_topology(t: &TopologyConfig, dead_lettered: impl Fn(&str) -> bool) -> Vec<Hazard> {
    let mut out = Vec::new();
    for q in &t.queues {
        let name = format!("queue {}", q.name);
        if q.kind == QueueType::Classic && !q.durable {
            out.push(hazard(
                name.clone(),
                "a transient non-exclusive queue (durable = false): RabbitMQ 4 deprecates them (deprecated feature transient_nonexcl_queues) and a later 4.x refuses to declare them; set durable = true",
            ));
        }
        if q.arguments.contains_key("x-queue-master-locator") {
            out.push(hazard(
                name.clone(),
                "x-queue-master-locator is deprecated in RabbitMQ 4 (queue_master_locator): rename the argument to x-queue-leader-locator (values client-local or balanced)",
            ));
        }
        let has = |k: &str| q.arguments.contains_key(k);
        if q.kind == QueueType::Quorum
            && !has("x-dead-letter-exchange")
            && !has("x-delivery-limit")
            && !dead_lettered(&q.name)
        {
            out.push(hazard(
                name,
                "a quorum queue without a dead-letter exchange: from RabbitMQ 4.0 its delivery limit is 20, and a message redelivered 20 times is dropped; set x-dead-letter-exchange in its arguments (or a policy's dead-letter-exchange), or x-delivery-limit (-1: no limit, as before 4.0)",
            ));
        }
    }
    out
}

/// The hazards of the vhost's policies (`GET /api/policies/{vhost}`).
pub(crate) fn of_policies(policies: &Value) -> Vec<Hazard> {
    let mut out = Vec::new();
    for p in policies.as_array().into_iter().flatten() {
        let (Some(name), Some(def)) = (
            p.get("name").and_then(Value::as_str),
            p.get("definition").and_then(Value::as_object),
        ) else {
            continue;
        };
        let name = format!("policy {name}");
        if def.keys().any(|k| k.starts_with("ha-")) {
            out.push(hazard(
                name.clone(),
                "sets classic mirroring (ha-* keys), which RabbitMQ 4 removed: its queues are not mirrored there; use quorum queues ([[topology.queue]] type = \"quorum\") and delete the policy's ha-* keys",
            ));
        }
        if def.contains_key("queue-master-locator") {
            out.push(hazard(
                name,
                "sets queue-master-locator, deprecated in RabbitMQ 4: use queue-leader-locator",
            ));
        }
    }
    out
}

/// The deprecated features a RabbitMQ 3.13+ broker reports as in use
/// (`GET /api/deprecated-features/used`).
pub(crate) fn of_used_features(used: &Value) -> Vec<Hazard> {
    used.as_array()
        .into_iter()
        .flatten()
        .filter_map(|f| {
            let name = f.get("name")?.as_str()?;
            let phase = f
                .get("deprecation_phase")
                .and_then(Value::as_str)
                .unwrap_or("deprecated");
            let doc = f
                .get("doc_url")
                .and_then(Value::as_str)
                .filter(|u| !u.is_empty())
                .map(|u| format!(" ({u})"))
                .unwrap_or_default();
            Some(Hazard {
                name: format!("deprecated feature {name}"),
                detail: format!(
                    "in use on the broker ({phase}): a later RabbitMQ release refuses it; find what uses it (rabbitmqctl list_deprecated_features --used) and move off it{doc}"
                ),
            })
        })
        .collect()
}

/// Whether a broker of this version (`3.13.7`, `4.0.5`) has the API of the deprecated
/// features in use (3.13 and later; older ones answer 404 or 406).
fn reports_deprecated_features(version: &str) -> bool {
    let mut parts = version.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
    let (major, minor) = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    (major, minor) >= (3, 13)
}

/// The queues whose effective policy sets a dead-letter exchange or a delivery
/// limit (`GET /api/queues/{vhost}`).
fn dead_lettered_by_policy(queues: &Value) -> Vec<String> {
    queues
        .as_array()
        .into_iter()
        .flatten()
        .filter(|q| {
            q.get("effective_policy_definition")
                .and_then(Value::as_object)
                .is_some_and(|d| {
                    d.contains_key("dead-letter-exchange") || d.contains_key("delivery-limit")
                })
        })
        .filter_map(|q| Some(q.get("name")?.as_str()?.to_string()))
        .collect()
}

/// `check`'s RabbitMQ 4 lines: one `warn` per hazard, or one `ok` line saying what
/// was looked at. Never fails the check.
pub(crate) async fn lines(cfg: &Config) {
    const NAME: &str = "rabbitmq 4";
    let management = match Management::from_config(cfg) {
        Ok(m) => m,
        Err(e) => {
            line(Status::Warn, NAME, &format!("not asked of the broker: {e}"));
            None
        }
    };
    let mut hazards = Vec::new();
    let mut looked = vec!["[topology]"];
    let mut dead_lettered = Vec::new();
    let mut notes = Vec::new();
    if let Some(m) = &management {
        // What `check --routes` says about these credentials, said here too.
        for w in &m.warnings {
            line(Status::Warn, "management API", w);
        }
        let ca = cfg.ca_file();
        let vhost = encode(m.vhost());
        let version = m
            .get_if_found("/api/overview", ca)
            .await
            .ok()
            .flatten()
            .and_then(|o| o.get("rabbitmq_version")?.as_str().map(str::to_string));
        if let Some(v) = &version {
            notes.push(format!("the broker is RabbitMQ {v}"));
        }
        match m.get_if_found(&format!("/api/policies/{vhost}"), ca).await {
            Ok(Some(p)) => {
                looked.push("the policies");
                hazards.extend(of_policies(&p));
            }
            Ok(None) => {}
            Err(e) => notes.push(format!("the policies were not read: {e}")),
        }
        let columns = "?columns=name,effective_policy_definition";
        if let Ok(Some(q)) = m
            .get_if_found(&format!("/api/queues/{vhost}{columns}"), ca)
            .await
        {
            dead_lettered = dead_lettered_by_policy(&q);
        }
        let reports_features = version.as_deref().is_none_or(reports_deprecated_features);
        let used = match reports_features {
            true => m.get_if_found("/api/deprecated-features/used", ca).await,
            false => Ok(None),
        };
        match used {
            Ok(Some(used)) => {
                looked.push("the deprecated features in use");
                hazards.extend(of_used_features(&used));
            }
            Ok(None) => notes.push(
                "the broker does not report deprecated features in use (RabbitMQ 3.13 and later do)"
                    .to_string(),
            ),
            Err(e) => notes.push(format!("the deprecated features in use were not read: {e}")),
        }
    } else {
        notes.push(
            "set [rabbitmq] management_url to have the broker's policies and deprecated features checked too"
                .to_string(),
        );
    }
    let mut all = of_topology(&cfg.topology, |q| dead_lettered.iter().any(|d| d == q));
    all.extend(hazards);
    for h in &all {
        line(Status::Warn, &h.name, &h.detail);
    }
    let mut summary = match all.len() {
        0 => format!(
            "nothing that RabbitMQ 4 refuses or changes, in {}",
            looked.join(", ")
        ),
        n => format!("{n} hazard(s) above, in {}", looked.join(", ")),
    };
    for n in notes {
        summary.push_str("; ");
        summary.push_str(&n);
    }
    line(Status::Ok, NAME, &summary);
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use serde_json::json;

    use super::*;

    #[test]
    fn each_queue_hazard_is_named_once_with_its_fix() {
        let t: TopologyConfig = serde_json::from_value(json!({"queue": [
            {"name": "scratch", "durable": false},
            {"name": "located", "arguments": {"x-queue-master-locator": "min-masters"}},
            {"name": "q.nodlx", "type": "quorum"},
            {"name": "q.dlx", "type": "quorum", "arguments": {"x-dead-letter-exchange": "dlx"}},
            {"name": "q.limit", "type": "quorum", "arguments": {"x-delivery-limit": -1}},
            {"name": "q.policy", "type": "quorum"},
            {"name": "fine"},
        ]}))
        .unwrap();
        let found = of_topology(&t, |q| q == "q.policy");
        let names: Vec<&str> = found.iter().map(|h| h.name.as_str()).collect();
        assert_eq!(names, ["queue scratch", "queue located", "queue q.nodlx"]);
        assert!(found[0].detail.contains("set durable = true"));
        assert!(found[1].detail.contains("x-queue-leader-locator"));
        assert!(found[2].detail.contains("x-dead-letter-exchange"));
        assert!(found[2].detail.contains("20"));
    }

    #[test]
    fn mirroring_and_locator_policies_are_named() {
        let p = json!([
            {"name": "ha-all", "definition": {"ha-mode": "all", "ha-sync-mode": "automatic"}},
            {"name": "loc", "definition": {"queue-master-locator": "min-masters"}},
            {"name": "ttl", "definition": {"message-ttl": 1000}},
        ]);
        let found = of_policies(&p);
        let names: Vec<&str> = found.iter().map(|h| h.name.as_str()).collect();
        assert_eq!(names, ["policy ha-all", "policy loc"]);
        assert!(found[0].detail.contains("quorum"));
        assert!(of_policies(&json!({"error": "x"})).is_empty());
    }

    #[test]
    fn used_features_and_policy_dead_lettering_are_read_from_the_api() {
        let used = json!([{"name": "transient_nonexcl_queues", "deprecation_phase": "permitted_by_default", "doc_url": "https://www.rabbitmq.com/docs/queues"}]);
        let found = of_used_features(&used);
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].name, "deprecated feature transient_nonexcl_queues");
        assert!(found[0].detail.contains("permitted_by_default"));
        let queues = json!([
            {"name": "a", "effective_policy_definition": {"dead-letter-exchange": "d"}},
            {"name": "b", "effective_policy_definition": {}},
            {"name": "c", "effective_policy_definition": {"delivery-limit": 5}},
            {"name": "d"},
        ]);
        assert_eq!(dead_lettered_by_policy(&queues), ["a", "c"]);
        assert!(!reports_deprecated_features("3.10.8"));
        assert!(!reports_deprecated_features("3.12.14"));
        assert!(reports_deprecated_features("3.13.0"));
        assert!(reports_deprecated_features("4.0.5"));
    }
}
