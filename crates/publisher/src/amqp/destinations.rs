//! Exchanges chosen by events (docs/routing.md, "An exchange per event"): which
//! names a row may choose, and what the relay knows of each on the broker. The one
//! owner of that knowledge; `run.rs` asks it before every publish to an exchange of
//! an event's own and tells it what the broker answered.
//!
//! A rendered name is checked as RabbitMQ would take it, then against the
//! operator's list ([`Policy`]): at most 255 bytes; no control byte (RabbitMQ takes
//! CR and LF out of a *declared* name but not out of a *published* one, so a name
//! holding a newline is declared as another exchange and then refused at every
//! publish); inside `[rabbitmq] allowed_exchanges` (by default the template's own
//! shape: `events.{aggregate_type}` allows `events.*`); never `amq.*` nor the
//! dead-letter exchange unless listed by name. A name that fails is that event's
//! problem: poison, named, and dead-lettered when a dead-letter exchange is set.
//!
//! On the broker, each name goes through: unknown → declared (or checked) once per
//! connection → ready. A publish the broker refuses with 404 (the exchange was
//! deleted) or 403 makes a ready name *recheck*: declared once more before the next
//! publish to it; refused again, or refused at the declaration, the name is
//! *refused* and its events are poison. Never a loop, never a stall; the configured
//! exchange and the dead-letter exchange are not event-chosen and keep the outage
//! behaviour (retried, loud). At most `max_declared_exchanges` distinct names are
//! declared by one publisher: the next ones are refused as poison, so that rows
//! cannot fill the broker with exchanges.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use amq_protocol::types::ShortString;

use crate::message::{RoutingKeyTemplate, SHORT_STRING_MAX};

/// Default `[rabbitmq] max_declared_exchanges`.
pub const DEFAULT_MAX_DECLARED_EXCHANGES: usize = 1000;

/// Which names an event may choose (see the module docs).
#[derive(Debug, Clone)]
pub(crate) struct Policy {
    /// Globs; `*` stands for one or more of `[A-Za-z0-9_.:-]`.
    allowed: Vec<String>,
    /// Whether `allowed` is the operator's (else the template's shape).
    listed: bool,
    dead_letter: Option<String>,
}

/// The characters a `*` of a glob matches.
fn safe(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | ':' | '-')
}

/// Whether `name` matches `glob` (`*`: one or more safe characters).
pub(crate) fn glob_matches(glob: &str, name: &str) -> bool {
    match glob.split_once('*') {
        None => glob == name,
        Some((head, tail)) => {
            let Some(rest) = name.strip_prefix(head) else {
                return false;
            };
            // The star takes 1..=n safe characters; the rest must match the tail.
            for (i, c) in rest.char_indices() {
                if !safe(c) {
                    break;
                }
                if glob_matches(tail, &rest[i + c.len_utf8()..]) {
                    return true;
                }
            }
            false
        }
    }
}

impl Policy {
    /// The policy of `[rabbitmq] exchange` (a template or a name), the operator's
    /// `allowed_exchanges` (empty: the template's shape, or any safe name for an
    /// exchange column) and the dead-letter exchange.
    pub(crate) fn new(exchange: &str, allowed: &[String], dead_letter: Option<&str>) -> Policy {
        let listed = !allowed.is_empty();
        let allowed = if listed {
            allowed.to_vec()
        } else {
            match RoutingKeyTemplate::parse(exchange) {
                Ok(t) if t.has_placeholders() => vec![t.glob()],
                _ => vec!["*".to_string()],
            }
        };
        Policy {
            allowed,
            listed,
            dead_letter: dead_letter.map(str::to_string),
        }
    }

    /// Why an event may not publish to `name`, if it may not.
    pub(crate) fn check(&self, name: &str) -> Result<(), String> {
        if name.is_empty() {
            return Err("its exchange is empty: the [rabbitmq] exchange template rendered no name (docs/routing.md)".into());
        }
        if name.len() > SHORT_STRING_MAX {
            return Err(format!(
                "its exchange name is {} bytes long, over RabbitMQ's 255 (docs/routing.md)",
                name.len()
            ));
        }
        if let Some(c) = name.chars().find(|c| c.is_control()) {
            return Err(format!(
                "its exchange name {} holds the control character {c:?}, which RabbitMQ takes out of a declared name but not out of a published one: fix the row (docs/routing.md)",
                printable(name)
            ));
        }
        let explicit = |n: &str| self.listed && self.allowed.iter().any(|g| g == n);
        if name.starts_with("amq.") && !explicit(name) {
            return Err(format!(
                "its exchange {} is one of RabbitMQ's own (amq.*): name it in [rabbitmq] allowed_exchanges to allow it (docs/security.md)",
                printable(name)
            ));
        }
        if self.dead_letter.as_deref() == Some(name) && !explicit(name) {
            return Err(format!(
                "its exchange {} is the dead-letter exchange, which rows may not choose: name it in [rabbitmq] allowed_exchanges to allow it (docs/security.md)",
                printable(name)
            ));
        }
        if !self.allowed.iter().any(|g| glob_matches(g, name)) {
            return Err(format!(
                "its exchange {} is outside [rabbitmq] allowed_exchanges ({}): add a glob that matches it, or fix the row (docs/security.md)",
                printable(name),
                self.allowed.join(", ")
            ));
        }
        Ok(())
    }
}

fn printable(name: &str) -> String {
    format!("{:?}", outbox_event::redact::printable(name))
}

/// What the relay knows of a name on the broker.
#[derive(Debug, Clone)]
enum State {
    /// Declared (or found) on this connection.
    Ready,
    /// The broker refused a publish to it (404 or 403): declare it once more.
    Recheck,
    /// Declared once more after a refused publish: one more refusal makes it refused.
    Rechecked,
    Refused(Arc<str>),
}

/// What to do before publishing to a name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    Send,
    /// Declare (or check) it first.
    Declare,
    /// Its events are poison, for this reason.
    Refuse(Arc<str>),
}

/// The names events chose, and their state (module docs).
#[derive(Debug)]
pub(crate) struct Destinations {
    policy: Policy,
    known: HashMap<ShortString, State>,
    /// Names ever declared or checked by this publisher, and the bound on them.
    ever: HashSet<ShortString>,
    max_declared: usize,
    /// Names refused by the rules, kept at most this many (they are checked again
    /// cheaply when forgotten).
    refused_kept: usize,
}

impl Destinations {
    pub(crate) fn new(policy: Policy, max_declared: usize) -> Destinations {
        Destinations {
            policy,
            known: HashMap::new(),
            ever: HashSet::new(),
            max_declared: max_declared.max(1),
            refused_kept: 0,
        }
    }

    /// What to do before publishing an event to `name`.
    pub(crate) fn verdict(&mut self, name: &ShortString) -> Verdict {
        match self.known.get(name) {
            Some(State::Ready | State::Rechecked) => return Verdict::Send,
            Some(State::Recheck) => return Verdict::Declare,
            Some(State::Refused(why)) => return Verdict::Refuse(why.clone()),
            None => {}
        }
        if let Err(why) = self.policy.check(name.as_str()) {
            let why: Arc<str> = why.into();
            if self.refused_kept < self.max_declared {
                self.refused_kept += 1;
                self.known.insert(name.clone(), State::Refused(why.clone()));
            }
            return Verdict::Refuse(why);
        }
        if !self.ever.contains(name) && self.ever.len() >= self.max_declared {
            return Verdict::Refuse(
                format!(
                    "the relay has already declared max_declared_exchanges = {} exchanges named by events: raise it, or find why rows name so many (docs/routing.md)",
                    self.max_declared
                )
                .into(),
            );
        }
        Verdict::Declare
    }

    /// The broker declared (or found) `name`.
    pub(crate) fn declared(&mut self, name: ShortString) {
        let state = match self.known.get(&name) {
            Some(State::Recheck) => State::Rechecked,
            Some(State::Rechecked) => State::Rechecked,
            _ => {
                self.ever.insert(name.clone());
                State::Ready
            }
        };
        self.known.insert(name, state);
    }

    /// The broker refused `name` (at a declaration, or at a publish after it was
    /// declared again): its events are poison.
    pub(crate) fn refuse(&mut self, name: ShortString, why: String) {
        self.known.insert(name, State::Refused(why.into()));
    }

    /// The broker refused a publish to `name` with 404 or 403: true when it is an
    /// event's own exchange the relay knows (a refusal of that event, not an
    /// outage). It is declared once more; a second refusal makes it refused with
    /// `why`.
    pub(crate) fn publish_refused(&mut self, name: &str, why: &str) -> bool {
        let key = ShortString::from(name);
        match self.known.get(&key) {
            Some(State::Ready) => {
                self.known.insert(key, State::Recheck);
                true
            }
            Some(State::Rechecked | State::Recheck) => {
                self.known.insert(key, State::Refused(why.into()));
                true
            }
            Some(State::Refused(_)) => true,
            None => false,
        }
    }

    /// The names the broker refused a publish to in `text` (a channel close), among
    /// those the relay declared: RabbitMQ names the exchange as `exchange 'NAME'`.
    pub(crate) fn named_in(&self, text: &str) -> Option<String> {
        self.known
            .iter()
            .filter(|(_, s)| matches!(s, State::Ready | State::Rechecked | State::Recheck))
            .map(|(n, _)| n.as_str())
            .find(|n| text.contains(&format!("exchange '{n}'")))
            .map(str::to_string)
    }

    /// A new connection (perhaps to another broker): every name is declared again
    /// as it comes; names refused stay refused.
    pub(crate) fn reconnected(&mut self) {
        self.known.retain(|_, s| matches!(s, State::Refused(_)));
    }

    /// Names known (the simulation checks the bound).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.known.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs_match_one_or_more_safe_characters() {
        assert!(glob_matches("events.*", "events.order"));
        assert!(glob_matches("events.*", "events.a.b-c:d_e"));
        assert!(!glob_matches("events.*", "events."));
        assert!(!glob_matches("events.*", "events.a b"));
        assert!(!glob_matches("events.*", "other.a"));
        assert!(glob_matches("*.v1", "orders.v1"));
        assert!(!glob_matches("*.v1", "orders.v2"));
        assert!(glob_matches("amq.topic", "amq.topic"));
        assert!(!glob_matches("*", "a\nb"));
        assert!(glob_matches("a*b*c", "a1b2c"));
    }

    #[test]
    fn a_name_is_checked_as_rabbitmq_takes_it_and_against_the_list() {
        let p = Policy::new("events.{aggregate_type}", &[], Some("dlx"));
        assert_eq!(p.check("events.order"), Ok(()));
        let why = p.check("events.x\ny").unwrap_err();
        assert!(why.contains("control character"), "{why}");
        assert!(p.check("").unwrap_err().contains("empty"));
        let long = format!("events.{}", "a".repeat(300));
        assert!(p.check(&long).unwrap_err().contains("255"));
        assert!(p.check("amq.topic").unwrap_err().contains("amq."));
        assert!(p.check("dlx").unwrap_err().contains("dead-letter"));
        assert!(p
            .check("billing.x")
            .unwrap_err()
            .contains("allowed_exchanges (events.*)"));
        // Listed by name, amq.* and the DLX are allowed.
        let p = Policy::new(
            "x",
            &["amq.topic".into(), "dlx".into(), "t.*".into()],
            Some("dlx"),
        );
        assert_eq!(p.check("amq.topic"), Ok(()));
        assert_eq!(p.check("dlx"), Ok(()));
        assert_eq!(p.check("t.1"), Ok(()));
        // A glob does not open amq.* by itself.
        let p = Policy::new("x", &["*".into()], None);
        assert!(p.check("amq.direct").is_err());
        assert_eq!(p.check("anything.safe"), Ok(()));
    }

    #[test]
    fn a_refused_publish_declares_once_more_then_refuses() {
        let mut d = Destinations::new(Policy::new("e.{aggregate_type}", &[], None), 10);
        let x = ShortString::from("e.x");
        assert_eq!(d.verdict(&x), Verdict::Declare);
        d.declared(x.clone());
        assert_eq!(d.verdict(&x), Verdict::Send);
        assert!(d.publish_refused("e.x", "404"));
        assert_eq!(d.verdict(&x), Verdict::Declare);
        d.declared(x.clone());
        assert_eq!(d.verdict(&x), Verdict::Send);
        assert!(d.publish_refused("e.x", "404 again"));
        assert_eq!(d.verdict(&x), Verdict::Refuse("404 again".into()));
        // The configured exchange is not the publisher's to refuse.
        assert!(!d.publish_refused("outbox", "404"));
        assert_eq!(
            d.named_in("NOT_FOUND - no exchange 'e.y' in vhost '/'"),
            None
        );
    }

    #[test]
    fn no_more_names_than_the_bound_are_declared() {
        let mut d = Destinations::new(Policy::new("e.{aggregate_type}", &[], None), 3);
        for i in 0..3 {
            let x = ShortString::from(format!("e.{i}"));
            assert_eq!(d.verdict(&x), Verdict::Declare);
            d.declared(x);
        }
        let x = ShortString::from("e.3");
        match d.verdict(&x) {
            Verdict::Refuse(why) => assert!(why.contains("max_declared_exchanges = 3")),
            other => panic!("{other:?}"),
        }
        // Names declared before stay usable, also after a reconnect.
        d.reconnected();
        assert_eq!(d.verdict(&ShortString::from("e.0")), Verdict::Declare);
    }
}
