//! What a stream-protocol connection reports, whichever drives it: the clients of
//! `client.rs` or the relay's own connection of `raw.rs`.

use std::fmt;

use rabbitmq_stream_client::types::ResponseCode;

/// What the broker reports on a publishing connection.
#[derive(Debug)]
pub(super) enum BrokerEvent {
    /// Publishing ids of a publisher stored (or dropped as duplicates).
    Confirmed(u8, Vec<u64>),
    /// Publishing ids of a publisher refused, with the code.
    Refused(u8, Vec<(u64, ResponseCode)>),
    /// The connection is gone or the stream changed (deleted, leader moved).
    Closed(String),
    /// The broker answered a liveness probe (`liveness.rs`).
    Alive,
}

/// A failed request or connection, from either client.
#[derive(Debug)]
pub(crate) struct ClientFailure {
    /// The broker's code when it answered with one.
    pub code: Option<ResponseCode>,
    pub text: String,
}

impl fmt::Display for ClientFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}
