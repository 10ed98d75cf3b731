//! AMQP 0-9-1 framing without I/O: where a frame ends, which frames the relay
//! accepts from a broker, the limits that keep a hostile or broken peer from taking
//! the process down, and the hand-encoded frames of the hot path. The connection
//! (`mod.rs`) owns the socket and the state; this file only turns bytes into frames
//! and frames into bytes (docs/design.md §4, "The AMQP client").
//!
//! Frames are parsed by the `amq-protocol` codec, but only after three checks made
//! here on the raw bytes, because the codec trusts its input:
//!
//! - the frame's declared size is within the negotiated `frame_max` (4,096 before
//!   `connection.tune`, the spec's minimum), so no length read from the wire sizes
//!   an allocation;
//! - the method is one a broker may send to a publishing client ([`accepted`]);
//!   anything else is refused unparsed;
//! - field tables (the only recursive structure, in `connection.start` and in a
//!   returned message's headers) nest at most [`MAX_TABLE_DEPTH`] deep: the codec
//!   recurses once per level, and a deep enough table would overflow the stack.

use amq_protocol::frame::{gen_frame, parse_frame, AMQPFrame, WriteContext};

/// Frame header (type, channel, size) and frame-end octet.
pub(crate) const FRAME_OVERHEAD: usize = 8;
/// The smallest `frame_max` AMQP allows, and the largest frame a peer may send
/// before `connection.tune` settled the size.
pub(crate) const FRAME_MIN: u32 = 4096;
/// The frame size used when the URL does not ask for another (RabbitMQ's default).
pub(crate) const DEFAULT_FRAME_MAX: u32 = 131_072;
/// How deep field tables and arrays may nest in what a broker sends.
pub(crate) const MAX_TABLE_DEPTH: usize = 16;
/// The frame-end octet.
const FRAME_END: u8 = 0xCE;

/// Why bytes from the broker are not a frame the relay takes: each maps to the
/// reply code the connection is closed with (AMQP 0-9-1 §4.2.3 and the constants
/// of the spec).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum FrameError {
    /// 501 FRAME_ERROR: a frame larger than agreed, without its end octet, or of an
    /// unknown type.
    Frame(String),
    /// 502 SYNTAX_ERROR: a frame whose payload does not parse, or nests too deep.
    Syntax(String),
    /// 540 NOT_IMPLEMENTED: a method a broker does not send to a publisher.
    NotImplemented(String),
    /// The broker answered the protocol header with its own: it does not speak
    /// AMQP 0-9-1.
    Version,
}

impl FrameError {
    /// The reply code the connection is closed with.
    pub(crate) fn code(&self) -> u16 {
        match self {
            FrameError::Frame(_) | FrameError::Version => 501,
            FrameError::Syntax(_) => 502,
            FrameError::NotImplemented(_) => 540,
        }
    }
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameError::Frame(s) | FrameError::Syntax(s) | FrameError::NotImplemented(s) => {
                f.write_str(s)
            }
            FrameError::Version => f.write_str("the broker refused AMQP 0-9-1"),
        }
    }
}

/// Splits the first whole frame off `bytes`: the frame and the bytes it used, or
/// `None` while it is incomplete. `frame_max` is the agreed maximum (or
/// [`FRAME_MIN`] before tune); a frame above it is an error before any of it is
/// buffered further.
pub(crate) fn split_frame(
    bytes: &[u8],
    frame_max: u32,
) -> Result<Option<(AMQPFrame, usize)>, FrameError> {
    if bytes.len() >= 4 && bytes.starts_with(b"AMQP") {
        return Err(FrameError::Version);
    }
    if bytes.len() < 7 {
        return Ok(None);
    }
    let size = u32::from_be_bytes([bytes[3], bytes[4], bytes[5], bytes[6]]) as usize;
    let limit = (frame_max.max(FRAME_MIN) as usize).saturating_sub(FRAME_OVERHEAD);
    if size > limit {
        return Err(FrameError::Frame(format!(
            "the broker sent a frame of {} bytes, above the agreed maximum of {}",
            size + FRAME_OVERHEAD,
            limit + FRAME_OVERHEAD
        )));
    }
    let total = size + FRAME_OVERHEAD;
    if bytes.len() < total {
        return Ok(None);
    }
    if bytes[total - 1] != FRAME_END {
        return Err(FrameError::Frame(
            "a frame without its frame-end octet".into(),
        ));
    }
    let payload = &bytes[7..total - 1];
    match bytes[0] {
        1 => check_method(payload)?,
        2 => check_content_header(payload)?,
        3 | 8 => {}
        other => {
            return Err(FrameError::Frame(format!(
                "a frame of unknown type {other}"
            )))
        }
    }
    match parse_frame(&bytes[..total]) {
        Ok((&[], frame)) => Ok(Some((frame, total))),
        Ok(_) => Err(FrameError::Syntax(
            "a frame with bytes after its end".into(),
        )),
        Err(e) => Err(FrameError::Syntax(format!(
            "a frame that does not parse: {}",
            first_line(&e.to_string())
        ))),
    }
}

fn first_line(s: &str) -> &str {
    s.lines().next().unwrap_or_default()
}

/// The methods a broker sends to a client that publishes and declares: class and
/// method ids of AMQP 0-9-1.
pub(crate) fn accepted(class: u16, method: u16) -> bool {
    matches!(
        (class, method),
        // connection: start, secure, tune, open-ok, close, close-ok, blocked, unblocked
        (10, 10 | 20 | 30 | 41 | 50 | 51 | 60 | 61)
        // channel: open-ok, flow, flow-ok, close, close-ok
        | (20, 11 | 20 | 21 | 40 | 41)
        // exchange: declare-ok, delete-ok, bind-ok, unbind-ok
        | (40, 11 | 21 | 31 | 51)
        // queue: declare-ok, bind-ok, purge-ok, delete-ok, unbind-ok
        | (50, 11 | 21 | 31 | 41 | 51)
        // basic: return, ack, nack
        | (60, 50 | 80 | 120)
        // confirm: select-ok
        | (85, 11)
    )
}

fn check_method(payload: &[u8]) -> Result<(), FrameError> {
    if payload.len() < 4 {
        return Err(FrameError::Syntax(
            "a method frame shorter than its ids".into(),
        ));
    }
    let class = u16::from_be_bytes([payload[0], payload[1]]);
    let method = u16::from_be_bytes([payload[2], payload[3]]);
    if !accepted(class, method) {
        return Err(FrameError::NotImplemented(format!(
            "the broker sent method {class}.{method}, which a publishing client does not take"
        )));
    }
    if (class, method) == (10, 10) {
        // connection.start: version-major, version-minor, server-properties (table).
        let table = payload.get(6..).unwrap_or_default();
        check_table(table, 1)?;
    }
    Ok(())
}

/// A content header: class, weight, body size, property flags, then the
/// properties in flag order; the headers table is the third.
fn check_content_header(payload: &[u8]) -> Result<(), FrameError> {
    let short = || FrameError::Syntax("a content header cut short".into());
    let flags = u16::from_be_bytes([
        *payload.get(12).ok_or_else(short)?,
        *payload.get(13).ok_or_else(short)?,
    ]);
    let mut at = 14;
    for bit in [15u16, 14] {
        if flags & (1 << bit) != 0 {
            let len = *payload.get(at).ok_or_else(short)? as usize;
            at += 1 + len;
        }
    }
    if flags & (1 << 13) != 0 {
        check_table(payload.get(at..).ok_or_else(short)?, 1)?;
    }
    Ok(())
}

/// Walks the field table at the start of `bytes` (its 4-byte length first) and
/// fails when tables or arrays nest deeper than [`MAX_TABLE_DEPTH`]. Malformed
/// content past the nesting is left to the codec.
fn check_table(bytes: &[u8], depth: usize) -> Result<(), FrameError> {
    check_nested(bytes, depth, true)
}

/// As [`check_table`], for a field array (values without names).
fn check_array(bytes: &[u8], depth: usize) -> Result<(), FrameError> {
    check_nested(bytes, depth, false)
}

/// A table (`named`: each value after a short-string name) or an array.
fn check_nested(bytes: &[u8], depth: usize, named: bool) -> Result<(), FrameError> {
    if depth > MAX_TABLE_DEPTH {
        return Err(too_deep());
    }
    let Some(body) = sized(bytes) else {
        return Ok(());
    };
    let mut at = 0;
    while at < body.len() {
        if named {
            at += 1 + body[at] as usize;
        }
        let Some(rest) = body.get(at..) else {
            return Ok(());
        };
        match skip_value(rest, depth)? {
            Some(used) => at += used,
            None => return Ok(()),
        }
    }
    Ok(())
}

fn too_deep() -> FrameError {
    FrameError::Syntax(format!(
        "a field table nested deeper than {MAX_TABLE_DEPTH} levels"
    ))
}

/// The bytes of a long-sized structure (a table or an array), `None` when cut short.
fn sized(bytes: &[u8]) -> Option<&[u8]> {
    let len = u32::from_be_bytes(bytes.get(..4)?.try_into().ok()?) as usize;
    bytes.get(4..4usize.checked_add(len)?)
}

/// Skips one typed field value (its type octet first): the bytes it used, or
/// `None` when it cannot be read (the codec then reports the error).
fn skip_value(bytes: &[u8], depth: usize) -> Result<Option<usize>, FrameError> {
    let Some((&kind, rest)) = bytes.split_first() else {
        return Ok(None);
    };
    let long = |rest: &[u8]| {
        rest.get(..4)
            .and_then(|b| b.try_into().ok())
            .map(|b: [u8; 4]| 4 + u32::from_be_bytes(b) as usize)
    };
    let used = match kind {
        b't' | b'b' | b'B' => Some(1),
        b's' | b'U' | b'u' => Some(2),
        b'I' | b'i' | b'f' => Some(4),
        b'L' | b'l' | b'd' | b'T' => Some(8),
        b'D' => Some(5),
        b'V' => Some(0),
        b'S' | b'x' => long(rest),
        b'F' => {
            check_table(rest, depth + 1)?;
            long(rest)
        }
        b'A' => {
            check_array(rest, depth + 1)?;
            long(rest)
        }
        _ => None,
    };
    Ok(used.map(|n| n + 1))
}

/// The `frame_max` the relay agrees to: the smaller of what the URL asks for
/// (128 KiB when it asks for nothing or for "no limit") and what the broker
/// proposes (0: no limit), never below the spec's minimum. A broker cannot raise
/// the relay's read limit beyond what the URL allows.
pub(crate) fn negotiate_frame_max(url: Option<u32>, broker: u32) -> u32 {
    let ours = match url {
        Some(0) | None => DEFAULT_FRAME_MAX,
        Some(n) => n,
    };
    negotiate(ours, broker).max(FRAME_MIN)
}

/// The smaller of two limits where 0 means none.
pub(crate) fn negotiate(ours: u32, theirs: u32) -> u32 {
    match (ours, theirs) {
        (0, t) => t,
        (o, 0) => o,
        (o, t) => o.min(t),
    }
}

/// Appends one frame encoded by the codec.
pub(crate) fn encode(out: &mut Vec<u8>, frame: &AMQPFrame) -> Result<(), String> {
    let buffer = std::mem::take(out);
    match gen_frame(frame)(WriteContext::from(buffer)) {
        Ok(context) => {
            *out = context.write;
            Ok(())
        }
        Err(e) => Err(format!("cannot encode a frame: {e}")),
    }
}

/// The `basic.publish` method frame, encoded by hand (it is on every message's
/// path). `exchange` and `routing_key` must be at most 255 bytes (the caller checks).
pub(crate) fn encode_publish(
    out: &mut Vec<u8>,
    ch: u16,
    exchange: &str,
    routing_key: &str,
    mandatory: bool,
) {
    let exchange = &exchange.as_bytes()[..exchange.len().min(255)];
    let routing_key = &routing_key.as_bytes()[..routing_key.len().min(255)];
    // class, method, reserved short, two short strings, the bits.
    let size = 4 + 2 + 1 + exchange.len() + 1 + routing_key.len() + 1;
    out.push(1);
    out.extend_from_slice(&ch.to_be_bytes());
    out.extend_from_slice(&(size as u32).to_be_bytes());
    out.extend_from_slice(&60u16.to_be_bytes());
    out.extend_from_slice(&40u16.to_be_bytes());
    out.extend_from_slice(&0u16.to_be_bytes());
    out.push(exchange.len() as u8);
    out.extend_from_slice(exchange);
    out.push(routing_key.len() as u8);
    out.extend_from_slice(routing_key);
    out.push(u8::from(mandatory));
    out.push(FRAME_END);
}

/// One content body frame.
pub(crate) fn encode_body(out: &mut Vec<u8>, ch: u16, piece: &[u8]) {
    out.push(3);
    out.extend_from_slice(&ch.to_be_bytes());
    out.extend_from_slice(&(piece.len() as u32).to_be_bytes());
    out.extend_from_slice(piece);
    out.push(FRAME_END);
}

#[cfg(test)]
mod tests;
