//! What Postgres types mean for an event (docs/design.md §5): the payload column's
//! type decides the message's content type and how its text form becomes the
//! body. The reader applies this when it builds events, so an event reaches the
//! publisher ready to send.

use bytes::Bytes;
use outbox_event::OutboxTable;

use crate::mapping::TableName;

/// Postgres type OIDs the relay treats specially (docs/design.md §5).
pub mod oid {
    pub const BYTEA: u32 = 17;
    pub const TEXT: u32 = 25;
    pub const JSON: u32 = 114;
    pub const VARCHAR: u32 = 1043;
    pub const BPCHAR: u32 = 1042;
    pub const JSONB: u32 = 3802;
    pub const UUID: u32 = 2950;
}

/// Microseconds between the Unix epoch and the Postgres epoch (2000-01-01).
pub const PG_EPOCH_OFFSET_MICROS: i64 = 946_684_800_000_000;

/// Converts a Postgres timestamp (µs since 2000-01-01) to µs since the Unix epoch.
pub fn pg_to_unix_micros(pg_micros: i64) -> i64 {
    pg_micros.saturating_add(PG_EPOCH_OFFSET_MICROS)
}

/// The [`OutboxTable`] of a relayed table whose payload (and headers) columns have
/// these types: its content type is chosen here.
pub fn outbox_table(
    table: &TableName,
    payload_type: u32,
    headers_type: Option<u32>,
) -> OutboxTable {
    OutboxTable {
        qualified_name: table.qualified(),
        schema: table.schema.clone(),
        name: table.name.clone(),
        payload_type,
        headers_type,
        content_type: content_type(payload_type),
    }
}

/// `content_type` by the payload column's type.
pub fn content_type(payload_type: u32) -> &'static str {
    match payload_type {
        oid::JSON | oid::JSONB => "application/json",
        oid::TEXT | oid::VARCHAR | oid::BPCHAR => "text/plain",
        _ => "application/octet-stream",
    }
}

/// The body of a message: the payload's bytes (docs/design.md §5). bytea arrives as
/// Postgres' text form and is decoded to raw bytes; every other type is passed
/// through as is (the same buffer, not a copy); NULL is an empty body.
pub fn body(payload_type: u32, payload: Option<&Bytes>) -> Bytes {
    match payload {
        None => Bytes::new(),
        Some(value) if payload_type == oid::BYTEA => decode_bytea(value)
            .map(Bytes::from)
            .unwrap_or_else(|| value.clone()),
        Some(value) => value.clone(),
    }
}

/// Decodes bytea's text output: the hex form `\x0102…` (the default) or the escape
/// form (`\\` and `\ooo` octal escapes). `None` when the text is neither.
pub fn decode_bytea(text: &[u8]) -> Option<Vec<u8>> {
    if let Some(hex) = text.strip_prefix(b"\\x") {
        if hex.len() % 2 != 0 {
            return None;
        }
        return hex
            .chunks_exact(2)
            .map(|pair| Some(hex_digit(pair[0])? << 4 | hex_digit(pair[1])?))
            .collect();
    }
    let mut out = Vec::with_capacity(text.len());
    let mut i = 0;
    while i < text.len() {
        if text[i] != b'\\' {
            out.push(text[i]);
            i += 1;
        } else if text.get(i + 1) == Some(&b'\\') {
            out.push(b'\\');
            i += 2;
        } else {
            let digits = text.get(i + 1..i + 4)?;
            let mut byte: u32 = 0;
            for &d in digits {
                if !(b'0'..=b'7').contains(&d) {
                    return None;
                }
                byte = byte * 8 + u32::from(d - b'0');
            }
            out.push(u8::try_from(byte).ok()?);
            i += 4;
        }
    }
    Some(out)
}

fn hex_digit(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn bytea_hex_and_escape() {
        assert_eq!(decode_bytea(b"\\x00ff10Ab").unwrap(), vec![0, 255, 16, 171]);
        assert_eq!(decode_bytea(b"\\x").unwrap(), Vec::<u8>::new());
        assert!(decode_bytea(b"\\x0").is_none());
        assert!(decode_bytea(b"\\xzz").is_none());
        assert_eq!(
            decode_bytea(b"ab\\\\c\\001\\377").unwrap(),
            b"ab\\c\x01\xff".to_vec()
        );
        assert!(decode_bytea(b"\\9").is_none());
        assert_eq!(
            body(oid::BYTEA, Some(&Bytes::from_static(b"\\xdeadbeef"))).as_ref(),
            &[0xde, 0xad, 0xbe, 0xef]
        );
        assert_eq!(
            body(oid::JSONB, Some(&Bytes::from_static(b"\\xdeadbeef"))).as_ref(),
            b"\\xdeadbeef"
        );
        assert!(body(oid::JSONB, None).is_empty());
    }

    #[test]
    fn content_types() {
        assert_eq!(content_type(oid::JSONB), "application/json");
        assert_eq!(content_type(oid::JSON), "application/json");
        assert_eq!(content_type(oid::TEXT), "text/plain");
        assert_eq!(content_type(oid::VARCHAR), "text/plain");
        assert_eq!(content_type(oid::BYTEA), "application/octet-stream");
        assert_eq!(content_type(oid::UUID), "application/octet-stream");
    }
}
