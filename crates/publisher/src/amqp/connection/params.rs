//! What opening a connection takes from the configuration, built from it before
//! each round of connects (`crate::amqp::session::params`): the connection reads
//! nothing else of it, and nothing of the rest of the publisher.

use std::sync::Arc;
use std::time::Duration;

/// The brokers and how to log in to them.
#[derive(Clone)]
pub(crate) struct Params {
    /// The brokers' URLs, in the order they are tried, with their credentials (a
    /// password file's password already in them).
    pub(crate) urls: Vec<String>,
    /// The TLS client configuration of `amqps` URLs (roots, client identity); `None`
    /// when no URL is `amqps`.
    pub(crate) tls: Option<Arc<rustls::ClientConfig>>,
    /// The deadline of every request, and of the confirms of waiting publishes.
    pub(crate) request_timeout: Duration,
    /// The `connection_name` client property the broker's UI shows.
    pub(crate) name: String,
}

impl Params {
    /// The URL of node `index`.
    pub(crate) fn url(&self, index: usize) -> &str {
        &self.urls[index]
    }
}
