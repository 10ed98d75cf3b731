//! `[topology]`: the exchanges, queues and bindings the relay declares (with
//! `[rabbitmq] declare_topology = true`, or `check --declare`) and that `check`
//! compares with the broker's (issue #43, part 3; docs/routing.md).
//!
//! ```toml
//! [[topology.exchange]]
//! name = "orders"
//! type = "topic"                      # any exchange type the broker knows
//! arguments = { alternate-exchange = "orders.unrouted" }
//! bindings = [{ exchange = "outbox", routing_key = "orders.#" }]   # exchange-to-exchange
//!
//! [[topology.queue]]
//! name = "billing"
//! type = "quorum"                     # classic (default), quorum, stream → x-queue-type
//! arguments = { x-dead-letter-exchange = "billing.dlx", x-delivery-limit = 5 }
//! bindings = [{ exchange = "orders", routing_key = "order.*" }]
//! ```
//!
//! These types are shared: the publisher declares them, the relay's `check` compares
//! them, and `check --routes` matches routing keys through their bindings. They are
//! read from the configuration file only: environment variables cannot express
//! arrays of tables.
//!
//! Argument values are kept as JSON values ([`ArgValue`]): TOML strings, integers,
//! floats, booleans, arrays and tables map one to one, and [`TopologyConfig::validate`]
//! checks the type of every argument RabbitMQ gives a meaning to (`x-message-ttl`
//! must be a whole number, ...).

use std::collections::BTreeMap;

use serde::Deserialize;

/// One argument value of a declaration or binding (`x-message-ttl = 60000`,
/// `x-match = "all"`): a JSON value, which TOML values map to one to one.
pub type ArgValue = serde_json::Value;

/// The `arguments` table of a declaration or binding, by name.
pub type Arguments = BTreeMap<String, ArgValue>;

/// The longest name RabbitMQ accepts for an exchange or queue (a short string).
pub const MAX_NAME_BYTES: usize = 255;

/// `[topology]`: extra exchanges and the queues with their bindings.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TopologyConfig {
    /// `[[topology.exchange]]`, in file order (declared in that order, before the
    /// queues).
    #[serde(rename = "exchange")]
    pub exchanges: Vec<ExchangeDecl>,
    /// `[[topology.queue]]`, in file order.
    #[serde(rename = "queue")]
    pub queues: Vec<QueueDecl>,
}

/// `[[topology.exchange]]`: an exchange to declare, and the exchange-to-exchange
/// bindings whose destination it is.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExchangeDecl {
    /// Its name (1 to 255 bytes, not `amq.*`).
    pub name: String,
    /// Its type, as the broker names it: `direct`, `topic`, `fanout`, `headers`, or a
    /// plugin's (`x-consistent-hash`, `x-delayed-message`, ...). Default `topic`.
    #[serde(rename = "type", default = "default_exchange_kind")]
    pub kind: String,
    /// Survives a broker restart. Default `true`.
    #[serde(default = "yes")]
    pub durable: bool,
    /// Deleted when its last binding is removed. Default `false`.
    #[serde(default)]
    pub auto_delete: bool,
    /// Only other exchanges may publish to it. Default `false`.
    #[serde(default)]
    pub internal: bool,
    /// `alternate-exchange`, `x-delayed-type`, ...
    #[serde(default)]
    pub arguments: Arguments,
    /// Bindings *to* this exchange from others (`exchange.bind`): messages routed
    /// by `exchange` with a matching key are routed on by this one.
    #[serde(default)]
    pub bindings: Vec<Binding>,
}

/// `[[topology.queue]]`: a queue to declare and its bindings.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QueueDecl {
    /// Its name (1 to 255 bytes, not `amq.*`).
    pub name: String,
    /// `classic` (default), `quorum` or `stream`: declared as `x-queue-type`.
    #[serde(rename = "type", default)]
    pub kind: QueueType,
    /// Survives a broker restart. Default `true` (quorum queues and streams must be).
    #[serde(default = "yes")]
    pub durable: bool,
    /// `x-dead-letter-exchange`, `x-dead-letter-routing-key`, `x-delivery-limit`,
    /// `x-message-ttl`, `x-max-length`, `x-overflow`, ...
    #[serde(default)]
    pub arguments: Arguments,
    /// The exchanges it is bound to (`queue.bind`).
    #[serde(default)]
    pub bindings: Vec<Binding>,
}

/// A binding: messages `exchange` routes with `routing_key` (a pattern for a topic
/// exchange, ignored by fanout and headers exchanges) reach the queue or exchange
/// whose `bindings` it is in. A headers exchange matches on `arguments`
/// (`x-match = "all"` or `"any"`, and the header values).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Binding {
    /// The source exchange (`""`, the default exchange, cannot be bound).
    pub exchange: String,
    /// The binding key. Default `""`.
    #[serde(default)]
    pub routing_key: String,
    /// Binding arguments (`x-match` and the header values for a headers exchange).
    #[serde(default)]
    pub arguments: Arguments,
}

/// `[[topology.queue]] type`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum QueueType {
    #[default]
    Classic,
    Quorum,
    Stream,
}

impl QueueType {
    /// The `x-queue-type` value.
    pub const fn as_str(self) -> &'static str {
        match self {
            QueueType::Classic => "classic",
            QueueType::Quorum => "quorum",
            QueueType::Stream => "stream",
        }
    }
}

fn default_exchange_kind() -> String {
    "topic".to_string()
}

const fn yes() -> bool {
    true
}

impl TopologyConfig {
    /// Nothing declared.
    pub fn is_empty(&self) -> bool {
        self.exchanges.is_empty() && self.queues.is_empty()
    }

    /// The declared exchange named `name`.
    pub fn exchange(&self, name: &str) -> Option<&ExchangeDecl> {
        self.exchanges.iter().find(|e| e.name == name)
    }

    /// The declared queue named `name`.
    pub fn queue(&self, name: &str) -> Option<&QueueDecl> {
        self.queues.iter().find(|q| q.name == name)
    }
}

mod validate;
