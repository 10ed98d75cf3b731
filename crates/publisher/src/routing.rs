//! Where the broker would route a message: a pure model of RabbitMQ's exchanges and
//! bindings, for `check --routes` (issue #43, docs/routing.md "Checking routes before
//! deploying").
//!
//! ```text
//!   Topology { exchanges (type, arguments, bindings → queue | exchange), queues }
//!   route(exchange, routing key, headers)
//!     └─ walk: each exchange once (cycles end there), its matching bindings'
//!        destinations; none at all → its alternate-exchange, if it has one
//!        ─► Route { queues reached, exchanges walked, not evaluated (and why) }
//! ```
//!
//! The matching follows RabbitMQ 3.x:
//! - direct: the binding key equals the routing key;
//! - topic: both split on `.` into words (an empty key has no words, `a.` has two,
//!   the second empty); in a binding key `*` is exactly one word and `#` zero or more
//!   words (only as a whole word: `a*` is a literal);
//! - fanout: every binding;
//! - headers: `x-match` `all` (the default) or `any` over the binding's arguments,
//!   those whose name starts with `x-` left out; `all-with-x` / `any-with-x` count
//!   them too (`x-match` itself never). Values are compared as text (a header
//!   `3` and an argument `"3"` match; RabbitMQ also compares their AMQP types);
//! - exchange-to-exchange bindings are followed transitively, each exchange at most
//!   once; an exchange whose own bindings give no destination at all hands the
//!   message to its `alternate-exchange` argument;
//! - the default exchange `""` routes to the queue named by the routing key.
//!
//! Exchange types it cannot decide (`x-consistent-hash`, `x-random`, any plugin's
//! type it does not know) are *not evaluated*: a route that reaches one is never
//! reported as routed on its account. `x-delayed-message` routes as its
//! `x-delayed-type`. Headers the caller does not know (their value depends on the
//! row: [`Headers::complete`] false) make a headers binding that needs them not
//! evaluated too.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;

mod declared;

/// An exchange's type, as far as routing goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kind {
    Direct,
    Topic,
    Fanout,
    Headers,
    /// A type the matcher cannot evaluate (`x-consistent-hash`, a plugin's), by name.
    Other(String),
}

impl Kind {
    /// The kind of an exchange of type `name` with these declaration arguments
    /// (`x-delayed-message` routes as its `x-delayed-type`).
    pub fn of(name: &str, arguments: &BTreeMap<String, Value>) -> Kind {
        match name {
            "direct" => Kind::Direct,
            "topic" => Kind::Topic,
            "fanout" => Kind::Fanout,
            "headers" => Kind::Headers,
            "x-delayed-message" => match arguments.get("x-delayed-type") {
                Some(Value::String(inner)) if inner != "x-delayed-message" => {
                    match Kind::of(inner, &BTreeMap::new()) {
                        Kind::Other(_) => Kind::Other(name.to_string()),
                        known => known,
                    }
                }
                _ => Kind::Other(name.to_string()),
            },
            other => Kind::Other(other.to_string()),
        }
    }
}

/// Where a binding leads.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Destination {
    Queue(String),
    Exchange(String),
}

/// A binding from an exchange (the source) to a queue or another exchange.
#[derive(Debug, Clone, PartialEq)]
pub struct Binding {
    pub destination: Destination,
    pub routing_key: String,
    /// Binding arguments: `x-match` and the header values for a headers exchange.
    pub arguments: BTreeMap<String, Value>,
}

/// An exchange: its type, whether clients may publish to it, its alternate exchange
/// and the bindings whose source it is.
#[derive(Debug, Clone, PartialEq)]
pub struct Exchange {
    pub kind: Kind,
    /// `internal`: only other exchanges may route to it; a publish to it is refused.
    pub internal: bool,
    /// The `alternate-exchange` argument, or its policy's `alternate-exchange`
    /// (the argument wins, as in RabbitMQ).
    pub alternate: Option<String>,
    /// The policy that applies to it when that policy could not be read: its
    /// alternate exchange, if any, is unknown.
    pub unread_policy: Option<String>,
    pub bindings: Vec<Binding>,
}

impl Exchange {
    pub fn new(kind: Kind) -> Exchange {
        Exchange {
            kind,
            internal: false,
            alternate: None,
            unread_policy: None,
            bindings: Vec::new(),
        }
    }
}

/// Exchanges by name, and the queues known to exist.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Topology {
    pub exchanges: BTreeMap<String, Exchange>,
    pub queues: BTreeSet<String>,
    /// Every queue of the broker is in `queues` (read from the broker): the default
    /// exchange's routing is decided. Otherwise a key naming no known queue is not
    /// evaluated rather than unroutable.
    pub queues_complete: bool,
}

/// The headers a message carries.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Headers {
    pub values: BTreeMap<String, String>,
    /// `true`: the message carries these headers and no others. `false`: it may carry
    /// others whose values are unknown here (they vary per row).
    pub complete: bool,
}

/// Where one message would go.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Route {
    /// The queues it reaches.
    pub queues: BTreeSet<String>,
    /// The exchanges it passes through, in the order walked.
    pub exchanges: Vec<String>,
    /// What could not be decided, one sentence each (e.g. an `x-consistent-hash`
    /// exchange on the way): the queues beyond it are not counted.
    pub not_evaluated: Vec<String>,
    /// Why nothing is reached, when that is not just "no binding matched" (the
    /// exchange does not exist, is internal, ...).
    pub notes: Vec<String>,
}

/// What a [`Route`] amounts to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// At least one queue is reached.
    Routed,
    /// No queue is reached, and something on the way was not evaluated.
    NotEvaluated,
    /// No queue is reached: the broker would return the message (mandatory) or
    /// drop it.
    Unroutable,
}

impl Route {
    pub fn verdict(&self) -> Verdict {
        if !self.queues.is_empty() {
            Verdict::Routed
        } else if !self.not_evaluated.is_empty() {
            Verdict::NotEvaluated
        } else {
            Verdict::Unroutable
        }
    }
}

/// Three-valued: whether a binding matches, when headers may be unknown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Match {
    Yes,
    No,
    Unknown,
}

impl Topology {
    /// Where a message published to `exchange` with `routing_key` and `headers`
    /// goes.
    pub fn route(&self, exchange: &str, routing_key: &str, headers: &Headers) -> Route {
        let mut route = Route::default();
        if exchange.is_empty() {
            route.exchanges.push(String::new());
            if self.queues.contains(routing_key) {
                route.queues.insert(routing_key.to_string());
            } else if !self.queues_complete {
                route.not_evaluated.push(format!(
                    "the default exchange routes to the queue named {routing_key:?}, which is not declared here"
                ));
            }
            return route;
        }
        match self.exchanges.get(exchange) {
            None => {
                route
                    .notes
                    .push(format!("exchange {exchange:?} does not exist"));
                return route;
            }
            Some(x) if x.internal => {
                route.notes.push(format!(
                    "exchange {exchange:?} is internal: the broker refuses a publish to it"
                ));
                return route;
            }
            Some(_) => {}
        }
        let mut seen: BTreeSet<&str> = BTreeSet::new();
        let mut todo: Vec<&str> = vec![exchange];
        while let Some(name) = todo.pop() {
            if !seen.insert(name) {
                continue;
            }
            route.exchanges.push(name.to_string());
            let Some(x) = self.exchanges.get(name) else {
                route
                    .notes
                    .push(format!("exchange {name:?} (bound to) does not exist"));
                continue;
            };
            if let Kind::Other(kind) = &x.kind {
                route.not_evaluated.push(format!(
                    "exchange {name:?} is of type {kind}, which this check does not evaluate"
                ));
                continue;
            }
            let mut destinations: Vec<&Destination> = Vec::new();
            let mut unknown = false;
            for b in &x.bindings {
                match binding_matches(&x.kind, b, routing_key, headers) {
                    Match::Yes => destinations.push(&b.destination),
                    Match::No => {}
                    Match::Unknown => {
                        unknown = true;
                        route.not_evaluated.push(format!(
                            "a binding of headers exchange {name:?} depends on headers whose values vary per row"
                        ));
                    }
                }
            }
            // The alternate exchange takes what the exchange itself routes nowhere;
            // when a binding could not be decided, neither can that.
            if destinations.is_empty() && !unknown {
                if let Some(ae) = &x.alternate {
                    todo.push(ae);
                    continue;
                }
                if let Some(policy) = &x.unread_policy {
                    route.not_evaluated.push(format!(
                        "exchange {name:?} routes it nowhere, and its policy {policy:?} (which may name an alternate exchange) could not be read"
                    ));
                    continue;
                }
            }
            // Depth first, in binding order.
            for d in destinations.into_iter().rev() {
                match d {
                    Destination::Queue(q) => {
                        route.queues.insert(q.clone());
                    }
                    Destination::Exchange(e) => todo.push(e),
                }
            }
        }
        route
    }
}

fn binding_matches(kind: &Kind, b: &Binding, routing_key: &str, headers: &Headers) -> Match {
    let yes = |m: bool| if m { Match::Yes } else { Match::No };
    match kind {
        Kind::Direct => yes(b.routing_key == routing_key),
        Kind::Topic => yes(topic_matches(&b.routing_key, routing_key)),
        Kind::Fanout => Match::Yes,
        Kind::Headers => headers_match(&b.arguments, headers),
        Kind::Other(_) => Match::Unknown,
    }
}

/// The words of a topic routing key or binding key, as RabbitMQ splits them: an
/// empty key has none; every `.` ends a word (so `a.` is `a` and an empty word).
pub fn topic_words(key: &str) -> Vec<&str> {
    if key.is_empty() {
        Vec::new()
    } else {
        key.split('.').collect()
    }
}

/// Whether a topic exchange routes `routing_key` through a binding with
/// `binding_key`: `*` is exactly one word, `#` zero or more.
pub fn topic_matches(binding_key: &str, routing_key: &str) -> bool {
    let pattern = topic_words(binding_key);
    let words = topic_words(routing_key);
    // reach[j]: the first i pattern words can match the first j key words.
    let mut reach = vec![false; words.len() + 1];
    reach[0] = true;
    for p in &pattern {
        let mut next = vec![false; words.len() + 1];
        match *p {
            "#" => {
                let mut any = false;
                for (n, r) in next.iter_mut().zip(&reach) {
                    any |= *r;
                    *n = any;
                }
            }
            "*" => next[1..].copy_from_slice(&reach[..words.len()]),
            literal => {
                for j in 1..=words.len() {
                    next[j] = reach[j - 1] && words[j - 1] == literal;
                }
            }
        }
        reach = next;
    }
    reach[words.len()]
}

/// The `x-match` modes of a headers binding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum XMatch {
    All,
    Any,
}

/// A value as text: strings as they are, anything else as its JSON text.
pub fn value_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// A headers exchange's binding against the message headers.
fn headers_match(arguments: &BTreeMap<String, Value>, headers: &Headers) -> Match {
    let mode = arguments.get("x-match").map(value_text);
    let (mode, with_x) = match mode.as_deref() {
        None | Some("all") => (XMatch::All, false),
        Some("any") => (XMatch::Any, false),
        Some("all-with-x") => (XMatch::All, true),
        Some("any-with-x") => (XMatch::Any, true),
        // The broker refuses such a binding: it cannot exist.
        Some(_) => return Match::No,
    };
    let mut results = arguments
        .iter()
        .filter(|(k, _)| *k != "x-match" && (with_x || !k.starts_with("x-")))
        .map(|(k, v)| match headers.values.get(k) {
            Some(h) => {
                if *h == value_text(v) {
                    Match::Yes
                } else {
                    Match::No
                }
            }
            None if headers.complete => Match::No,
            None => Match::Unknown,
        });
    match mode {
        // No argument left: `all` matches everything, `any` nothing.
        XMatch::All => results.try_fold(Match::Yes, |acc, m| match m {
            Match::No => Err(()),
            Match::Unknown => Ok(Match::Unknown),
            Match::Yes => Ok(acc),
        }),
        XMatch::Any => results.try_fold(Match::No, |acc, m| match m {
            Match::Yes => Err(()),
            Match::Unknown => Ok(Match::Unknown),
            Match::No => Ok(acc),
        }),
    }
    .unwrap_or(match mode {
        XMatch::All => Match::No,
        XMatch::Any => Match::Yes,
    })
}

#[cfg(test)]
mod tests;
