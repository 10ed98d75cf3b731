//! Read-only checks of the broker for `outbox-relay check` (docs/operations.md,
//! "Configuration and check"): whether the exchanges and the stream `run` needs
//! exist, found without creating anything (passive declarations), so that `check`
//! can say what `run` would create instead of creating it; and whether the
//! exchanges and queues of `[topology]` exist as configured ([`probe_topology`]).

use crate::amqp::config::PublisherConfig;
use crate::amqp::connection::{ConnError, Declare};
use crate::amqp::session::login_any;
use crate::amqp::topology::exchange_refused;
use crate::amqp::topology::{self, Object};
use crate::error::{redact_url, scrub, PublishError};
use crate::settings::TopologyConfig;
use crate::stream::StreamConfig;

/// Whether a broker object exists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Presence {
    Exists,
    Missing,
}

/// What [`probe_exchanges`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExchangeProbe {
    /// The node that answered (password redacted).
    pub node: String,
    /// `[rabbitmq] exchange`; `None` for the default exchange `""`, which always
    /// exists.
    pub exchange: Option<Presence>,
    /// `[rabbitmq] dead_letter_exchange`, when one is set.
    pub dead_letter: Option<Presence>,
}

/// Logs in as `run` would (same URLs, TLS, credentials, the same client) and looks
/// the exchanges up without declaring them (passive declarations on the control
/// channel). An exchange that exists is then declared once more with the
/// configured type when `declare_exchange` is on, as `run` does: that changes
/// nothing, and a type or durability that differs is the error `run` would get.
pub async fn probe_exchanges(config: &PublisherConfig) -> Result<ExchangeProbe, PublishError> {
    config.validate_login()?;
    let tls = config.tls()?;
    let mut conn = login_any(config, &tls, 0).await?;
    let node = redact_url(&config.urls[conn.node]);
    let passive = async |conn: &mut crate::amqp::connection::Connection, name: &str| match conn
        .declare_exchange(name, "topic", Declare::Passive)
        .await
    {
        Ok(()) => Ok(Presence::Exists),
        Err(ConnError::ChannelClosed { code: 404, .. }) => Ok(Presence::Missing),
        Err(e) => Err(exchange_refused(config, conn.node, name, e)),
    };
    let result = async {
        let exchange = match config.exchange.as_str() {
            "" => None,
            name => {
                let presence = passive(&mut conn, name).await?;
                if presence == Presence::Exists && config.declare_exchange {
                    conn.declare_exchange(name, &config.exchange_type, Declare::Active)
                        .await
                        .map_err(|e| exchange_refused(config, conn.node, name, e))?;
                }
                Some(presence)
            }
        };
        let dead_letter = match &config.dead_letter_exchange {
            Some(dlx) => Some(passive(&mut conn, dlx).await?),
            None => None,
        };
        Ok(ExchangeProbe {
            node,
            exchange,
            dead_letter,
        })
    }
    .await;
    conn.close().await;
    result
}

/// Whether each exchange of `names` exists (the names a template of `[rabbitmq]
/// exchange` rendered for some events), looked up without declaring anything, as
/// `run` would log in. The answers are in the order of `names`.
pub async fn probe_exchange_names(
    config: &PublisherConfig,
    names: &[String],
) -> Result<Vec<(String, Presence)>, PublishError> {
    config.validate_login()?;
    let tls = config.tls()?;
    let mut conn = login_any(config, &tls, 0).await?;
    let mut found = Vec::with_capacity(names.len());
    let mut result = Ok(());
    for name in names {
        if !conn.is_alive() {
            conn = login_any(config, &tls, conn.node).await?;
        }
        match conn.declare_exchange(name, "topic", Declare::Passive).await {
            Ok(()) => found.push((name.clone(), Presence::Exists)),
            Err(ConnError::ChannelClosed { code: 404, .. }) => {
                found.push((name.clone(), Presence::Missing));
            }
            Err(e) => {
                result = Err(exchange_refused(config, conn.node, name, e));
                break;
            }
        }
    }
    conn.close().await;
    result.map(|()| found)
}

/// Whether the stream of `config` exists, asked without declaring it (the stream
/// protocol's metadata request), as `run` would log in.
pub async fn probe_stream(config: &StreamConfig) -> Result<Presence, PublishError> {
    Ok(match crate::stream::stream_exists(config).await? {
        true => Presence::Exists,
        false => Presence::Missing,
    })
}

/// What `check` found of one exchange or queue of `[topology]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TopologyState {
    /// It exists, and declaring it as configured changes nothing.
    Present,
    /// It does not exist (a passive declaration answered 404; nothing was created).
    Missing,
    /// It exists with other arguments, type or flags: the broker refused the
    /// configured declaration (406 PRECONDITION_FAILED). `argument` is the one its
    /// text names (`x-queue-type`, `x-message-ttl`, `type`, `durable`...), `text`
    /// the broker's words, `fix` what to do.
    Different {
        argument: Option<String>,
        text: String,
        fix: String,
    },
    /// It exists, but whether it matches could not be asked: the broker refused the
    /// comparing declaration otherwise (403: the user may not configure it; 405: an
    /// exclusive queue of another connection; 503: an unknown exchange type).
    NotCompared { reason: String },
}

/// What [`probe_topology`] found, in the order of the configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopologyProbe {
    /// The node that answered (password redacted).
    pub node: String,
    pub exchanges: Vec<(String, TopologyState)>,
    pub queues: Vec<(String, TopologyState)>,
}

/// Compares each exchange and queue of `topology` with the broker's, creating
/// nothing: a passive declaration first (404: [`TopologyState::Missing`]), then,
/// for one that exists, the configured declaration, which the broker answers with
/// declare-ok when it is equivalent and refuses with 406 naming the argument when
/// not ([`TopologyState::Different`]). Each refusal closes the control channel,
/// which the next declaration opens again; a refusal that closes the connection
/// (503, an unknown exchange type) costs a new login. Bindings cannot be looked up
/// over AMQP and are not probed.
pub async fn probe_topology(
    config: &PublisherConfig,
    topology: &TopologyConfig,
) -> Result<TopologyProbe, PublishError> {
    config.validate_login()?;
    let tls = config.tls()?;
    let mut conn = login_any(config, &tls, 0).await?;
    let node = redact_url(&config.urls[conn.node]);
    let mut exchanges = Vec::new();
    for e in &topology.exchanges {
        if !conn.is_alive() {
            conn = login_any(config, &tls, conn.node).await?;
        }
        let object = Object::Exchange(&e.name);
        let passive = topology::declare_exchange(&mut conn, e, Declare::Passive).await;
        let state = match passive {
            Ok(()) => {
                let declared = topology::declare_exchange(&mut conn, e, Declare::Active).await;
                compare(config, conn.node, object, declared)?
            }
            Err(err) => absent(config, conn.node, object, err)?,
        };
        exchanges.push((e.name.clone(), state));
    }
    let mut queues = Vec::new();
    for q in &topology.queues {
        if !conn.is_alive() {
            conn = login_any(config, &tls, conn.node).await?;
        }
        let object = Object::Queue(&q.name);
        let passive = topology::declare_queue(&mut conn, q, Declare::Passive).await;
        let state = match passive {
            Ok(()) => {
                let declared = topology::declare_queue(&mut conn, q, Declare::Active).await;
                compare(config, conn.node, object, declared)?
            }
            Err(err) => absent(config, conn.node, object, err)?,
        };
        queues.push((q.name.clone(), state));
    }
    conn.close().await;
    Ok(TopologyProbe {
        node,
        exchanges,
        queues,
    })
}

/// The answer to a passive declaration that failed: 404 is missing, another
/// refusal is reported as such, an outage is the error.
fn absent(
    config: &PublisherConfig,
    node: usize,
    object: Object<'_>,
    err: ConnError,
) -> Result<TopologyState, PublishError> {
    match err {
        ConnError::ChannelClosed { code: 404, .. } => Ok(TopologyState::Missing),
        ConnError::ChannelClosed { code, text } => Ok(TopologyState::NotCompared {
            reason: scrub(
                &format!("({code}) {text}: {}", topology::fix(object, code, &text)),
                &config.urls[node],
            ),
        }),
        other => Err(topology::refused(config, node, object, other)),
    }
}

/// The answer to the comparing declaration of an object that exists.
fn compare(
    config: &PublisherConfig,
    node: usize,
    object: Object<'_>,
    declared: Result<(), ConnError>,
) -> Result<TopologyState, PublishError> {
    let url = &config.urls[node];
    match declared {
        Ok(()) => Ok(TopologyState::Present),
        Err(ConnError::ChannelClosed { code: 406, text }) => Ok(TopologyState::Different {
            argument: topology::inequivalent_argument(&text).map(str::to_string),
            fix: topology::fix(object, 406, &text),
            text: scrub(&text, url),
        }),
        Err(ConnError::ChannelClosed { code: 403, text }) => Ok(TopologyState::NotCompared {
            reason: scrub(
                &format!("(403) {text}: it exists (looking it up needs no permission), but comparing its arguments declares it again, which needs `configure` on it (docs/security.md); run `check` as a user who may configure it to compare them"),
                url,
            ),
        }),
        Err(ConnError::ChannelClosed { code, text }) | Err(ConnError::Closed { code, text })
            if code != 320 =>
        {
            Ok(TopologyState::NotCompared {
                reason: scrub(
                    &format!("({code}) {text}: {}", topology::fix(object, code, &text)),
                    url,
                ),
            })
        }
        Err(other) => Err(topology::refused(config, node, object, other)),
    }
}

/// `check --declare`: logs in as `run` would and declares every exchange, queue
/// and binding of `topology` (idempotent: what exists as configured is left as it
/// is). Returns the node that answered.
pub async fn declare_topology(
    config: &PublisherConfig,
    topology: &TopologyConfig,
) -> Result<String, PublishError> {
    config.validate_login()?;
    let tls = config.tls()?;
    let mut conn = login_any(config, &tls, 0).await?;
    let node = redact_url(&config.urls[conn.node]);
    let result = topology::declare_topology(&mut conn, config, topology).await;
    conn.close().await;
    result.map(|()| node)
}
