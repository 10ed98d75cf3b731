//! Read-only checks of the broker for `outbox-relay check` (docs/operations.md,
//! "Configuration and check"): whether the exchanges and the stream `run` needs
//! exist, found without creating anything (passive declarations), so that `check`
//! can say what `run` would create instead of creating it.

use lapin::options::ExchangeDeclareOptions;
use lapin::types::FieldTable;
use lapin::{Connection, ErrorKind};

use crate::config::PublisherConfig;
use crate::connection::{connect_any, exchange_kind};
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

/// Logs in as `run` would (same URLs, TLS, credentials) and looks the exchanges up
/// without declaring them. An exchange that exists is then declared once more with
/// the configured type when `declare_exchange` is on, as `run` does: that changes
/// nothing, and a type or durability that differs is the error `run` would get.
pub async fn probe_exchanges(config: &PublisherConfig) -> Result<ExchangeProbe, PublishError> {
    let mut bare = config.clone();
    bare.exchange = String::new();
    bare.dead_letter_exchange = None;
    bare.validate()?;
    let tls = bare.tls()?;
    let session = connect_any(&bare, &tls, 0).await?;
    let node = redact_url(&config.urls[session.url_index]);
    let connection = session.connection;
    let result = async {
        let exchange = match config.exchange.as_str() {
            "" => None,
            name => {
                let presence = passive(&connection, name).await?;
                if presence == Presence::Exists && config.declare_exchange {
                    let channel = connection
                        .create_channel()
                        .await
                        .map_err(|e| refused(name, &e))?;
                    let options = ExchangeDeclareOptions {
                        durable: true,
                        ..ExchangeDeclareOptions::default()
                    };
                    channel
                        .exchange_declare(
                            name.into(),
                            exchange_kind(&config.exchange_type),
                            options,
                            FieldTable::default(),
                        )
                        .await
                        .map_err(|e| refused(name, &e))?;
                    let _ = channel.close(200, "check done".into()).await;
                }
                Some(presence)
            }
        };
        let dead_letter = match &config.dead_letter_exchange {
            Some(dlx) => Some(passive(&connection, dlx).await?),
            None => None,
        };
        Ok(ExchangeProbe {
            node,
            exchange,
            dead_letter,
        })
    }
    .await;
    let _ = connection.close(200, "check done".into()).await;
    result
}

/// A passive declaration on a channel of its own (a 404 closes the channel).
async fn passive(connection: &Connection, name: &str) -> Result<Presence, PublishError> {
    let channel = connection
        .create_channel()
        .await
        .map_err(|e| refused(name, &e))?;
    let options = ExchangeDeclareOptions {
        passive: true,
        ..ExchangeDeclareOptions::default()
    };
    match channel
        .exchange_declare(
            name.into(),
            lapin::ExchangeKind::Topic,
            options,
            FieldTable::default(),
        )
        .await
    {
        Ok(()) => {
            let _ = channel.close(200, "check done".into()).await;
            Ok(Presence::Exists)
        }
        Err(e) if amqp_code(&e) == Some(404) => Ok(Presence::Missing),
        Err(e) => Err(refused(name, &e)),
    }
}

fn amqp_code(e: &lapin::Error) -> Option<u16> {
    match e.kind() {
        ErrorKind::ProtocolError(amqp) => Some(amqp.get_id()),
        _ => None,
    }
}

fn refused(exchange: &str, e: &lapin::Error) -> PublishError {
    PublishError::Exchange {
        exchange: exchange.to_string(),
        reason: e.to_string(),
    }
}

/// Whether the stream of `config` exists, asked without declaring it (the stream
/// protocol's metadata request), as `run` would log in.
pub async fn probe_stream(config: &StreamConfig) -> Result<Presence, PublishError> {
    crate::stream::stream_presence(config).await
}
