//! The headers column's JSON object read as header pairs, as both targets take it
//! (the AMQP headers table, the stream's application properties).

use std::collections::HashSet;

use super::{cloudevents, is_reserved_header};

/// The keys of the headers column's JSON object with their values as text (strings
/// as they are, other values as their JSON text), reserved keys
/// ([`is_reserved_header`]) and the target's own keys (`relay`: the relay's headers,
/// which `[message] headers = "minimal"` leaves out but a row must not set either)
/// dropped and logged once each. Keys are compared as JSON reads them (unescaped).
/// Anything that is not a JSON object gives nothing (and is logged). With
/// `cloudevents`, keys that would set one of the CloudEvents attributes the relay
/// sets are dropped as reserved too ([`cloudevents::RELAY_ATTRIBUTES`]). Both
/// targets use it (the AMQP headers table, the stream's application properties).
pub(crate) fn json_headers(
    raw: &[u8],
    logged: &mut HashSet<String>,
    cloudevents: bool,
    relay: &[&str],
) -> Vec<(String, String)> {
    match serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(raw) {
        Ok(map) => {
            let mut out = Vec::with_capacity(map.len());
            for (key, value) in map {
                if is_reserved_header(&key)
                    || relay.contains(&key.as_str())
                    || (cloudevents && cloudevents::is_relay_attribute(&key))
                {
                    if logged.len() < 64 && logged.insert(key.clone()) {
                        tracing::warn!(
                            header = %key,
                            "reserved header key in the headers column dropped (RabbitMQ or the relay interprets it); rename it"
                        );
                    }
                    continue;
                }
                let value = match value {
                    serde_json::Value::String(s) => s,
                    other => other.to_string(),
                };
                out.push((key, value));
            }
            out
        }
        Err(error) => {
            tracing::warn!(%error, "headers column is not a JSON object; no extra headers added");
            Vec::new()
        }
    }
}
