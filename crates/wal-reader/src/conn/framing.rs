//! Backend messages off the read buffer: one growable buffer, filled by one `read`
//! at a time, from which every complete message is split without copying.
//!
//! A [`Frame`] is one whole message (tag, length word, body). Bodies are parsed by
//! `postgres-protocol`'s [`Message::parse`] except where it does not fit: the
//! CopyBothResponse (`W`), which it does not know, the authentication request,
//! whose codes the relay words itself (`auth.rs`), and ErrorResponse /
//! NoticeResponse, read by [`parse_error`], which keeps the fields of a truncated
//! body where `ErrorResponseBody::fields` would reject it all. While streaming,
//! CopyData (`d`, every replication message) is not parsed at all: its body is the
//! payload ([`Frame::into_body`]), with no second split of the buffer per message.

use bytes::{Buf, Bytes, BytesMut};
use fallible_iterator::FallibleIterator;
use postgres_protocol::message::backend::{DataRowBody, Message};

use crate::error::{ReaderError, ServerError};
use outbox_event::redact::printable;

/// Largest backend message accepted (Postgres caps a field at 1 GB).
pub(super) const MAX_MESSAGE_LEN: usize = (1 << 30) + (1 << 20);
/// Largest backend message accepted before the session is ready (authentication,
/// parameter status, errors): libpq's limit for such messages, so a hostile server
/// or a man in the middle cannot make the relay reserve a gigabyte before it even
/// logged in (docs/security.md).
pub(super) const MAX_STARTUP_MESSAGE_LEN: usize = 30_000;
/// Initial read buffer; grows for larger messages.
pub(super) const READ_BUFFER: usize = 256 * 1024;
/// How many bytes one `fill` takes at most once the first read returned: enough to
/// batch thousands of small messages, small enough to hand them on promptly.
pub(super) const FILL_TARGET: usize = 128 * 1024;

/// One whole backend message, split off the read buffer.
#[derive(Debug)]
pub(crate) struct Frame(BytesMut);

impl Frame {
    /// The message type byte.
    pub fn tag(&self) -> u8 {
        self.0[0]
    }

    /// The body, without tag and length word.
    pub fn body(&self) -> &[u8] {
        &self.0[5..]
    }

    /// The body as a `Bytes` slice of the read buffer, without tag and length word:
    /// a CopyData payload without going through [`Message::parse`] (which splits
    /// and freezes the buffer a second time for every replication message).
    pub fn into_body(self) -> Bytes {
        let mut frame = self.0;
        frame.advance(5);
        frame.freeze()
    }

    /// The message, parsed by `postgres-protocol` (a `Bytes` body such as
    /// CopyData's stays a slice of the read buffer).
    pub fn parse(mut self) -> Result<Message, ReaderError> {
        let tag = self.tag();
        match Message::parse(&mut self.0) {
            Ok(Some(m)) => Ok(m),
            Ok(None) => Err(ReaderError::Protocol(format!(
                "message {:?} is incomplete",
                tag as char
            ))),
            Err(e) => Err(ReaderError::Protocol(format!(
                "malformed message {:?}: {e}",
                tag as char
            ))),
        }
    }
}

/// Splits the next complete message off `buf`, if it holds one; refuses a length
/// word below 4 or above `max`.
pub(super) fn split_frame(buf: &mut BytesMut, max: usize) -> Result<Option<Frame>, ReaderError> {
    if buf.len() < 5 {
        return Ok(None);
    }
    let tag = buf[0];
    let len = i32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]);
    if len < 4 || len as usize > max {
        return Err(ReaderError::Protocol(format!(
            "message {:?} with invalid length {len}",
            tag as char
        )));
    }
    let total = 1 + len as usize;
    if buf.len() < total {
        buf.reserve(total - buf.len());
        return Ok(None);
    }
    Ok(Some(Frame(buf.split_to(total))))
}

/// Parses the fields of an ErrorResponse / NoticeResponse body.
pub(crate) fn parse_error(body: &[u8]) -> ServerError {
    let mut e = ServerError {
        severity: String::new(),
        code: String::new(),
        message: String::new(),
        detail: None,
        hint: None,
    };
    let mut rest = body;
    while let Some((&kind, after)) = rest.split_first() {
        if kind == 0 {
            break;
        }
        let end = after.iter().position(|b| *b == 0).unwrap_or(after.len());
        // Server text is printed and logged: no line breaks or terminal escapes.
        let value = printable(&String::from_utf8_lossy(&after[..end])).into_owned();
        match kind {
            b'S' => e.severity = value,
            b'C' => e.code = value,
            b'M' => e.message = value,
            b'D' => e.detail = Some(value),
            b'H' => e.hint = Some(value),
            _ => {}
        }
        rest = after.get(end + 1..).unwrap_or_default();
    }
    e
}

/// A DataRow's values in text form.
pub(super) fn text_row(row: &DataRowBody) -> Result<super::Row, ReaderError> {
    let bad = |_| ReaderError::Protocol("malformed DataRow".into());
    let buf = row.buffer();
    row.ranges()
        .map(|r| Ok(r.map(|r| String::from_utf8_lossy(&buf[r]).into_owned())))
        .collect()
        .map_err(bad)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_error_fields() {
        let body = b"SERROR\0C42704\0Mreplication slot \"x\" does not exist\0Hdo it\0\0";
        let e = parse_error(body);
        assert_eq!(e.code, "42704");
        assert_eq!(e.severity, "ERROR");
        assert_eq!(e.hint.as_deref(), Some("do it"));
        // Truncated input does not panic.
        let e = parse_error(b"SERR");
        assert_eq!(e.severity, "ERR");
    }

    /// A DataRow message with `body`, through framing and parsing.
    fn parse_data_row(body: &[u8]) -> Result<super::super::Row, ReaderError> {
        let mut buf = BytesMut::from(&b"D"[..]);
        buf.extend_from_slice(&((body.len() + 4) as i32).to_be_bytes());
        buf.extend_from_slice(body);
        let frame = split_frame(&mut buf, MAX_MESSAGE_LEN)?.expect("whole");
        match frame.parse() {
            Ok(Message::DataRow(row)) => text_row(&row),
            Ok(_) => panic!("not a DataRow"),
            Err(_) => Err(ReaderError::Protocol("malformed DataRow".into())),
        }
    }

    #[test]
    fn parses_data_rows_and_rejects_garbage() {
        let body = b"\x00\x02\x00\x00\x00\x02ab\xff\xff\xff\xff";
        assert_eq!(parse_data_row(body).unwrap(), vec![Some("ab".into()), None]);
        for bad in [&b"\x00"[..], b"\x00\x01\x00\x00\x00\x09ab", b"\xff\xff"] {
            assert!(parse_data_row(bad).is_err());
        }
    }

    #[test]
    fn copy_data_body_is_a_slice_of_the_read_buffer() {
        let mut buf = BytesMut::from(&b"d\x00\x00\x00\x07wxyd\x00\x00\x00\x04"[..]);
        let start = buf.as_ptr();
        let f = split_frame(&mut buf, 100).unwrap().expect("first");
        let body = f.into_body();
        assert_eq!(&body[..], b"wxy");
        assert_eq!(body.as_ptr(), start.wrapping_add(5), "not copied");
        let empty = split_frame(&mut buf, 100).unwrap().expect("second");
        assert!(empty.into_body().is_empty());
    }

    #[test]
    fn splits_frames_and_refuses_bad_lengths() {
        let mut buf = BytesMut::from(&b"d\x00\x00\x00\x06abd\x00\x00"[..]);
        let f = split_frame(&mut buf, 100).unwrap().expect("first");
        assert_eq!((f.tag(), f.body()), (b'd', &b"ab"[..]));
        assert!(split_frame(&mut buf, 100).unwrap().is_none());
        let mut big = BytesMut::from(&b"d\x00\x01\x00\x00"[..]);
        let e = split_frame(&mut big, 100).unwrap_err();
        assert!(e.to_string().contains("invalid length"), "{e}");
    }
}
