//! Writing to the stream's leader (docs/design.md §4, "Exactly once into a stream",
//! *The leader*): after connecting to the first reachable URL, the publisher asks the
//! broker for the stream's metadata; when the leader's advertised host and port are
//! those of another configured URL, it connects there instead. A leader that cannot
//! be matched or reached leaves the publisher where it is (RabbitMQ forwards a
//! follower's publishes to the leader).

use std::time::Duration;

use super::connection::{self, Session};
use super::endpoint::Endpoint;
use super::StreamConfig;
use crate::error::{redact_url, PublishError};

/// Bound on the metadata request.
const METADATA_TIMEOUT: Duration = Duration::from_secs(5);

/// Connects as [`connection::connect_any`] does from URL `start`, then moves to the
/// stream's leader when it is another configured URL — except URL `avoid` (the node
/// just given up for silence: connecting to it would wait on the same silence).
pub(super) async fn connect_to_leader(
    config: &StreamConfig,
    start: usize,
    avoid: Option<usize>,
) -> Result<Session, PublishError> {
    let session = connection::connect_any(config, start).await?;
    let Some(leader) = leader_index(config, &session).await else {
        return Ok(session);
    };
    if leader == session.url_index || Some(leader) == avoid {
        return Ok(session);
    }
    match connection::connect_one(config, leader).await {
        Ok(on_leader) => {
            tracing::debug!(
                from = %redact_url(&config.urls[session.url_index]),
                to = %redact_url(&config.urls[leader]),
                "moved to the stream's leader"
            );
            session.close().await;
            Ok(on_leader)
        }
        Err(e) => {
            tracing::debug!(
                error = %e,
                "cannot connect to the stream's leader; publishing through this node"
            );
            Ok(session)
        }
    }
}

/// The index of the configured URL whose host and port the broker advertises for the
/// stream's leader; `None` (logged at debug) when it cannot say or none matches.
async fn leader_index(config: &StreamConfig, session: &Session) -> Option<usize> {
    let asked =
        tokio::time::timeout(METADATA_TIMEOUT, session.client.metadata(&config.stream)).await;
    let metadata = match asked {
        Ok(Ok(metadata)) => metadata,
        Ok(Err(e)) => {
            tracing::debug!(error = %e, "cannot ask for the stream's metadata");
            None
        }
        Err(_) => {
            tracing::debug!("the stream's metadata did not come in time");
            None
        }
    };
    let Some((_, host, port)) = metadata else {
        tracing::debug!(stream = %config.stream, "the broker names no leader of the stream now");
        return None;
    };
    let found = matching_url(&config.urls, &host, port);
    if found.is_none() {
        tracing::debug!(
            leader = %format!("{host}:{port}"),
            "the stream's leader, as the broker advertises it, is none of stream_url; staying on this node"
        );
    }
    found
}

/// The first of `urls` whose host (case-insensitive) and port are `host`:`port`.
fn matching_url(urls: &[String], host: &str, port: u32) -> Option<usize> {
    urls.iter().position(|url| {
        Endpoint::parse(url)
            .is_ok_and(|e| e.host.eq_ignore_ascii_case(host) && u32::from(e.port) == port)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_leader_is_matched_by_host_and_port() {
        let urls: Vec<String> = [
            "rabbitmq-stream://u:p@10.77.0.11:5552/%2f",
            "rabbitmq-stream://u:p@10.77.0.12:5552/%2f",
            "rabbitmq-stream+tls://u:p@RMQ-3/%2f",
        ]
        .map(String::from)
        .to_vec();
        assert_eq!(matching_url(&urls, "10.77.0.12", 5552), Some(1));
        assert_eq!(matching_url(&urls, "rmq-3", 5551), Some(2));
        assert_eq!(matching_url(&urls, "10.77.0.12", 5553), None);
        assert_eq!(matching_url(&urls, "node-4", 5552), None);
    }
}
