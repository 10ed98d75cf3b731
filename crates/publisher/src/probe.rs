//! Read-only checks of the broker for `outbox-relay check` (docs/operations.md,
//! "Configuration and check"): whether the exchanges and the stream `run` needs
//! exist, found without creating anything (passive declarations), so that `check`
//! can say what `run` would create instead of creating it.

use crate::amqp::connection::{ConnError, Declare};
use crate::amqp::session::{connect_any, refused};
use crate::config::PublisherConfig;
use crate::error::{redact_url, PublishError};
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
    let mut bare = config.clone();
    bare.exchange = String::new();
    bare.dead_letter_exchange = None;
    bare.validate()?;
    let tls = bare.tls()?;
    let mut conn = connect_any(&bare, &tls, 0).await?;
    let node = redact_url(&config.urls[conn.node]);
    let passive = async |conn: &mut crate::amqp::connection::Connection, name: &str| match conn
        .declare_exchange(name, "topic", Declare::Passive)
        .await
    {
        Ok(()) => Ok(Presence::Exists),
        Err(ConnError::ChannelClosed { code: 404, .. }) => Ok(Presence::Missing),
        Err(e) => Err(refused(config, conn.node, name, e)),
    };
    let result = async {
        let exchange = match config.exchange.as_str() {
            "" => None,
            name => {
                let presence = passive(&mut conn, name).await?;
                if presence == Presence::Exists && config.declare_exchange {
                    conn.declare_exchange(name, &config.exchange_type, Declare::Active)
                        .await
                        .map_err(|e| refused(config, conn.node, name, e))?;
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

/// Whether the stream of `config` exists, asked without declaring it (the stream
/// protocol's metadata request), as `run` would log in.
pub async fn probe_stream(config: &StreamConfig) -> Result<Presence, PublishError> {
    crate::stream::stream_presence(config).await
}
