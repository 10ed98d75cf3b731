//! Getting a connection to publish on: the URL list tried in order (the password
//! file read at every connect), and what is declared on it (`topology.rs`), as at
//! start so after every failure.

use crate::amqp::config::PublisherConfig;
use crate::amqp::connection::{self, Connection, Params, Tls};
use crate::error::PublishError;

/// Connects to the URLs in order starting at `start`: the first node that answers
/// wins. Every URL is tried, whatever the others answered: a node that refuses the
/// virtual host (530 while it boots, 403 while the vhost is being re-created) or the
/// login may be the only bad one of a cluster. When every node failed, the most
/// meaningful error is returned ([`PublishError::specificity`]): a refusal names what
/// to fix, an unreachable node does not. The exchanges of `config`, and its
/// `[topology]` when it has one, are declared on the connection that answered.
pub(crate) async fn connect_any(
    config: &PublisherConfig,
    tls: &Tls,
    start: usize,
) -> Result<Connection, PublishError> {
    first_that_answers(config, tls, start, true).await
}

/// [`connect_any`] without declaring anything: a login only (the probes of
/// `check`, which create nothing).
pub(crate) async fn login_any(
    config: &PublisherConfig,
    tls: &Tls,
    start: usize,
) -> Result<Connection, PublishError> {
    first_that_answers(config, tls, start, false).await
}

/// What a connection takes from `config`.
pub(crate) fn params(config: &PublisherConfig) -> Params {
    Params {
        urls: config.urls.clone(),
        ca_file: config.ca_file.clone(),
        auth: config.auth.clone(),
        request_timeout: config.request_timeout,
        name: config.connection_name.clone(),
    }
}

async fn first_that_answers(
    config: &PublisherConfig,
    tls: &Tls,
    start: usize,
    declare: bool,
) -> Result<Connection, PublishError> {
    let params = params(config);
    let count = params.urls.len();
    let mut best: Option<PublishError> = None;
    for offset in 0..count {
        let index = (start + offset) % count;
        let connected: Result<Connection, PublishError> =
            match connection::connect(&params, tls, index).await {
                Ok(conn) if !declare => return Ok(conn),
                Ok(mut conn) => match super::topology::declare_all(&mut conn, config).await {
                    Ok(()) => return Ok(conn),
                    Err(e) => {
                        conn.close().await;
                        Err(e)
                    }
                },
                Err(e) => Err(e),
            };
        let Err(e) = connected else { continue };
        if e.is_transient() {
            tracing::debug!(error = %e, "broker node unreachable; trying the next");
        } else {
            tracing::debug!(error = %e, "broker node refused the connection; trying the next");
        }
        // The first of the most specific errors wins; among unreachable nodes the
        // last one (a connection limit, transient too, is never replaced by a later
        // node that did not answer).
        if best.as_ref().is_none_or(|b| {
            e.specificity() > b.specificity()
                || (e.specificity() == b.specificity() && b.is_transient() && e.is_transient())
        }) {
            best = Some(e);
        }
    }
    Err(best.unwrap_or_else(|| PublishError::InvalidConfig {
        key: "url",
        reason: "no URL configured; set at least one amqp:// or amqps:// URL".into(),
    }))
}
