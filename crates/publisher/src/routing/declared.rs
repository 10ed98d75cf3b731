//! The topology a configuration declares (`[[topology.*]]` and `[rabbitmq]
//! exchange`), the broker's default exchanges, and the union of two topologies: what
//! `check --routes` matches rows against besides the broker's own.

use std::collections::BTreeMap;

use serde_json::Value;

use super::{Binding, Destination, Exchange, Kind, Topology};
use crate::settings::{self, TopologyConfig};

/// The broker's default exchanges (`amq.*`), which always exist.
const BROKER_DEFAULTS: [(&str, Kind); 5] = [
    ("amq.direct", Kind::Direct),
    ("amq.fanout", Kind::Fanout),
    ("amq.topic", Kind::Topic),
    ("amq.headers", Kind::Headers),
    ("amq.match", Kind::Headers),
];

impl Topology {
    /// The topology `topology` declares, with the relay's own exchange `own` (one
    /// name, not a template) of `own_kind` as run declares it, and the broker's
    /// defaults. A binding whose source is none of those is taken to bind an
    /// exchange of `own_kind` (one run declares, or one the broker has).
    pub fn declared(topology: &TopologyConfig, own: Option<&str>, own_kind: &Kind) -> Topology {
        let mut t = Topology::default();
        if let Some(own) = own.filter(|x| !x.is_empty()) {
            t.exchanges
                .insert(own.to_string(), Exchange::new(own_kind.clone()));
        }
        for x in &topology.exchanges {
            let mut e = Exchange::new(Kind::of(&x.kind, &x.arguments));
            e.internal = x.internal;
            e.alternate = x
                .arguments
                .get("alternate-exchange")
                .and_then(Value::as_str)
                .map(str::to_string);
            t.exchanges.insert(x.name.clone(), e);
        }
        t.add_broker_defaults();
        let mut bind = |source: &str, destination: Destination, b: &settings::Binding| {
            t.exchanges
                .entry(source.to_string())
                .or_insert_with(|| Exchange::new(own_kind.clone()))
                .bindings
                .push(Binding {
                    destination,
                    routing_key: b.routing_key.clone(),
                    arguments: b.arguments.clone(),
                });
        };
        for x in &topology.exchanges {
            for b in &x.bindings {
                bind(&b.exchange, Destination::Exchange(x.name.clone()), b);
            }
        }
        for q in &topology.queues {
            for b in &q.bindings {
                bind(&b.exchange, Destination::Queue(q.name.clone()), b);
            }
        }
        t.queues
            .extend(topology.queues.iter().map(|q| q.name.clone()));
        t
    }

    /// Adds the broker's default exchanges (`amq.*`) that are missing.
    pub fn add_broker_defaults(&mut self) {
        for (name, kind) in BROKER_DEFAULTS {
            self.exchanges
                .entry(name.to_string())
                .or_insert_with(|| Exchange::new(kind));
        }
    }

    /// Adds what `from` has that this topology lacks: exchanges, bindings (by
    /// destination, key and arguments), an alternate exchange, and queues.
    pub fn merge(&mut self, from: Topology) {
        for (name, x) in from.exchanges {
            match self.exchanges.get_mut(&name) {
                None => {
                    self.exchanges.insert(name, x);
                }
                Some(have) => {
                    if have.alternate.is_none() {
                        have.alternate = x.alternate;
                    }
                    for b in x.bindings {
                        if !have.bindings.contains(&b) {
                            have.bindings.push(b);
                        }
                    }
                }
            }
        }
        self.queues.extend(from.queues);
    }

    /// The empty-arguments kind of an exchange type name (`[rabbitmq] exchange_type`).
    pub fn kind_of_type(name: &str) -> Kind {
        Kind::of(name, &BTreeMap::new())
    }
}
