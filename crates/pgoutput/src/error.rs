//! The decoder's error type.
//!
//! Every failure is a value of [`DecodeError`]; the decoder never panics on input. All
//! variants mean the same thing to a caller: these bytes are not a valid message of the
//! protocol version and options the connection asked for, so the replication
//! connection should be dropped (a retry with the same bytes fails the same way). The
//! variants say *what* was wrong, for logs and for tests.

/// Malformed, truncated or unexpected input.
///
/// `reading` fields name the field being read when the input ran out or was invalid
/// (for example `"Begin final LSN"`), `message` fields name the message type.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The input ended in the middle of a field.
    #[error("the message ends while reading the {reading} ({needed} bytes needed, {remaining} left); the input is truncated or not pgoutput/replication protocol data")]
    UnexpectedEnd {
        reading: &'static str,
        needed: usize,
        remaining: usize,
    },
    /// The first byte of a pgoutput message is not a known message type.
    #[error("unknown pgoutput message tag {tag:#04x}; request a proto_version this decoder supports (1 to 4)")]
    UnknownMessageTag { tag: u8 },
    /// The first byte of a CopyData payload is neither `w` (XLogData) nor `k` (keepalive).
    #[error("unknown replication CopyData tag {tag:#04x}; only XLogData ('w') and primary keepalive ('k') are expected after START_REPLICATION")]
    UnknownReplicationTag { tag: u8 },
    /// A tuple column is not `n`, `u`, `t` or `b`.
    #[error("unknown tuple column kind {kind:#04x} (expected 'n', 'u', 't' or 'b'); the input is corrupt or from an unsupported protocol version")]
    UnknownColumnKind { kind: u8 },
    /// An Insert, Update or Delete has a tuple marker other than the expected ones.
    #[error("unexpected tuple marker {found:#04x} in a {message} message (expected {expected}); the input is corrupt")]
    UnexpectedTupleMarker {
        message: &'static str,
        found: u8,
        expected: &'static str,
    },
    /// A C string has no NUL terminator before the end of the input.
    #[error("the {reading} has no NUL terminator before the end of the message; the input is truncated or corrupt")]
    MissingNulTerminator { reading: &'static str },
    /// A name (relation, namespace, column, type, origin, prefix, gid) is not UTF-8.
    #[error("the {reading} is not valid UTF-8; connect with client_encoding UTF8 (the replication connection's encoding decides the names' encoding)")]
    InvalidUtf8 { reading: &'static str },
    /// A length field is negative.
    #[error("the {reading} has the negative length {length}; the input is corrupt")]
    NegativeLength { reading: &'static str, length: i32 },
    /// A length field is larger than the rest of the input.
    #[error("the {reading} has length {length} but only {remaining} bytes are left; the input is truncated or corrupt")]
    LengthExceedsInput {
        reading: &'static str,
        length: u64,
        remaining: usize,
    },
    /// A count field announces more entries than the rest of the input can hold.
    #[error("the {reading} is {count}, but the {remaining} bytes left cannot hold that many entries; the input is truncated or corrupt")]
    CountExceedsInput {
        reading: &'static str,
        count: u64,
        remaining: usize,
    },
    /// Bytes are left after a complete message.
    #[error("{count} unexpected bytes follow a complete {message} message; the decoder and the server disagree on the protocol (for streaming = 'parallel' use Decoder::with_parallel_streaming(true))")]
    TrailingBytes { message: &'static str, count: usize },
    /// A message arrived where the protocol does not allow it, given the Stream
    /// Start..Stream Stop state the decoder tracks.
    #[error("unexpected {message} message {context}; use one Decoder per replication connection and feed it every message in order")]
    UnexpectedMessage {
        message: &'static str,
        context: &'static str,
    },
}
