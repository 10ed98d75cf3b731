//! Loads the committed fixtures captured from Postgres 15 by `fixtures/capture.sh`.
#![allow(dead_code, clippy::unwrap_used)]

use bytes::Bytes;
use pgoutput::logical::{Decoder, LogicalMessage};

pub const V1_TEXT: &str = include_str!("../fixtures/v1_text.hex");
pub const V1_BINARY: &str = include_str!("../fixtures/v1_binary.hex");
pub const V2_STREAM: &str = include_str!("../fixtures/v2_stream.hex");
pub const V3_TWOPHASE: &str = include_str!("../fixtures/v3_twophase.hex");

/// Every fixture: its name and its messages in capture order.
pub fn all() -> Vec<(&'static str, Vec<Bytes>)> {
    vec![
        ("v1_text", parse(V1_TEXT)),
        ("v1_binary", parse(V1_BINARY)),
        ("v2_stream", parse(V2_STREAM)),
        ("v3_twophase", parse(V3_TWOPHASE)),
    ]
}

/// One message per non-comment line, lower-case hex.
pub fn parse(text: &str) -> Vec<Bytes> {
    text.lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| Bytes::from(hex(l.trim())))
        .collect()
}

fn hex(s: &str) -> Vec<u8> {
    assert!(s.len() % 2 == 0, "odd hex length");
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// Decodes a whole fixture with one decoder; panics with the message index on error.
pub fn decode_all(messages: &[Bytes]) -> Vec<LogicalMessage> {
    let mut d = Decoder::new();
    let out = messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            d.decode(m.clone()).unwrap_or_else(|e| {
                panic!("message {i} ({:?}): {e}", m.first().map(|&t| t as char))
            })
        })
        .collect();
    assert!(!d.in_stream(), "fixture ends inside a stream block");
    out
}

/// Each message with the decoder state it must be decoded in.
pub fn with_states(messages: &[Bytes]) -> Vec<(Decoder, Bytes)> {
    let mut d = Decoder::new();
    messages
        .iter()
        .map(|m| {
            let before = d.clone();
            d.decode(m.clone()).unwrap();
            (before, m.clone())
        })
        .collect()
}
