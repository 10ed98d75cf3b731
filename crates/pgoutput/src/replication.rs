//! Streaming replication CopyData payloads (the frames around pgoutput).
//!
//! After `START_REPLICATION ... LOGICAL`, the server sends CopyData (`d`) messages whose
//! payload starts with a tag byte; the client answers with its own CopyData payloads.
//! Layouts (big-endian, per the "Streaming Replication Protocol" chapter of the
//! Postgres docs):
//!
//! ```text
//! server → client
//!   XLogData          'w' | Int64 WAL start | Int64 WAL end | Int64 send time | data…
//!   Primary keepalive 'k' | Int64 WAL end   | Int64 send time | Byte1 reply requested
//! client → server
//!   Standby status    'r' | Int64 write | Int64 flush | Int64 apply | Int64 client time
//!                         | Byte1 reply requested
//! ```
//!
//! Times are microseconds since 2000-01-01 00:00 UTC (the Postgres epoch). XLogData's
//! `data` runs to the end of the payload (one pgoutput message, for
//! [`crate::logical::Decoder::decode`]) and is a slice of the input, not a copy.

use std::time::{SystemTime, UNIX_EPOCH};

use bytes::{BufMut, Bytes, BytesMut};

use crate::cursor::Cursor;
use crate::error::DecodeError;
use crate::Lsn;

/// Seconds from 1970-01-01 (Unix epoch) to 2000-01-01 (Postgres epoch).
const PG_EPOCH_OFFSET_SECS: i64 = 946_684_800;

/// One server → client CopyData payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplicationMessage {
    XLogData(XLogData),
    PrimaryKeepalive(PrimaryKeepalive),
}

/// WAL data: one pgoutput message in `data`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XLogData {
    /// The WAL position this data starts at (0/0 for some pgoutput control messages).
    pub wal_start: Lsn,
    /// The server's current end of WAL.
    pub wal_end: Lsn,
    /// The server's clock at transmission (µs since 2000-01-01).
    pub send_time: i64,
    /// The pgoutput message, a slice of the CopyData payload.
    pub data: Bytes,
}

/// A server heartbeat.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrimaryKeepalive {
    /// The server's current end of WAL.
    pub wal_end: Lsn,
    /// The server's clock at transmission (µs since 2000-01-01).
    pub send_time: i64,
    /// The server asks for a standby status update now (or it may time the client out).
    pub reply_requested: bool,
}

/// `buf` is the payload of one CopyData ('d') message, starting with b'w' or b'k'.
pub fn parse_copy_data(buf: Bytes) -> Result<ReplicationMessage, DecodeError> {
    let mut c = Cursor::new(buf);
    match c.u8("CopyData tag")? {
        b'w' => {
            let wal_start = c.lsn("XLogData WAL start")?;
            let wal_end = c.lsn("XLogData WAL end")?;
            let send_time = c.i64("XLogData send time")?;
            Ok(ReplicationMessage::XLogData(XLogData {
                wal_start,
                wal_end,
                send_time,
                data: c.rest(),
            }))
        }
        b'k' => {
            let wal_end = c.lsn("keepalive WAL end")?;
            let send_time = c.i64("keepalive send time")?;
            let reply_requested = c.u8("keepalive reply flag")? != 0;
            c.finish("primary keepalive")?;
            Ok(ReplicationMessage::PrimaryKeepalive(PrimaryKeepalive {
                wal_end,
                send_time,
                reply_requested,
            }))
        }
        tag => Err(DecodeError::UnknownReplicationTag { tag }),
    }
}

/// Appends a complete Standby status update payload (b'r', write, flush, apply, client time, reply flag) to `out` (not the CopyData framing).
pub fn encode_standby_status_update(
    write: Lsn,
    flush: Lsn,
    apply: Lsn,
    client_time_micros: i64,
    reply_requested: bool,
    out: &mut BytesMut,
) {
    out.reserve(34);
    out.put_u8(b'r');
    out.put_u64(write.0);
    out.put_u64(flush.0);
    out.put_u64(apply.0);
    out.put_i64(client_time_micros);
    out.put_u8(u8::from(reply_requested));
}

/// Microseconds since 2000-01-01 (Postgres epoch) for `SystemTime::now()`.
pub fn pg_now_micros() -> i64 {
    system_time_to_pg_micros(SystemTime::now())
}

/// Microseconds since the Postgres epoch for `t`, saturating at the `i64` range.
fn system_time_to_pg_micros(t: SystemTime) -> i64 {
    let unix_micros: i128 = match t.duration_since(UNIX_EPOCH) {
        Ok(d) => d.as_micros() as i128,
        Err(before) => -(before.duration().as_micros() as i128),
    };
    let pg = unix_micros - i128::from(PG_EPOCH_OFFSET_SECS) * 1_000_000;
    pg.clamp(i128::from(i64::MIN), i128::from(i64::MAX)) as i64
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::time::Duration;

    use super::*;

    fn xlogdata_frame(data: &[u8]) -> Vec<u8> {
        let mut v = vec![b'w'];
        v.extend_from_slice(&0x0000_0001_0000_00A0u64.to_be_bytes());
        v.extend_from_slice(&0x0000_0001_0000_0FFFu64.to_be_bytes());
        v.extend_from_slice(&(-5i64).to_be_bytes());
        v.extend_from_slice(data);
        v
    }

    #[test]
    fn parses_xlogdata_and_slices_data() {
        let input = Bytes::from(xlogdata_frame(b"B123"));
        let base = input.as_ptr();
        let ReplicationMessage::XLogData(x) = parse_copy_data(input).unwrap() else {
            panic!("not XLogData")
        };
        assert_eq!(x.wal_start, "1/A0".parse().unwrap());
        assert_eq!(x.wal_end, "1/FFF".parse().unwrap());
        assert_eq!(x.send_time, -5);
        assert_eq!(&x.data[..], b"B123");
        assert_eq!(x.data.as_ptr(), base.wrapping_add(25), "data is not copied");
    }

    #[test]
    fn xlogdata_may_carry_empty_data() {
        let ReplicationMessage::XLogData(x) = parse_copy_data(xlogdata_frame(b"").into()).unwrap()
        else {
            panic!("not XLogData")
        };
        assert!(x.data.is_empty());
    }

    #[test]
    fn parses_keepalive() {
        let mut v = vec![b'k'];
        v.extend_from_slice(&0x16_B374_D848u64.to_be_bytes());
        v.extend_from_slice(&789_000_000i64.to_be_bytes());
        v.push(1);
        assert_eq!(
            parse_copy_data(v.clone().into()).unwrap(),
            ReplicationMessage::PrimaryKeepalive(PrimaryKeepalive {
                wal_end: Lsn(0x16_B374_D848),
                send_time: 789_000_000,
                reply_requested: true,
            })
        );
        v[17] = 0;
        let ReplicationMessage::PrimaryKeepalive(k) = parse_copy_data(v.into()).unwrap() else {
            panic!("not a keepalive")
        };
        assert!(!k.reply_requested);
    }

    #[test]
    fn rejects_truncated_frames_at_every_length() {
        let frame = xlogdata_frame(b"");
        for n in 0..frame.len() {
            assert!(
                parse_copy_data(Bytes::copy_from_slice(&frame[..n])).is_err(),
                "prefix {n}"
            );
        }
        let mut keepalive = vec![b'k'];
        keepalive.extend_from_slice(&[0; 17]);
        for n in 0..keepalive.len() {
            assert!(parse_copy_data(Bytes::copy_from_slice(&keepalive[..n])).is_err());
        }
        assert!(parse_copy_data(keepalive.clone().into()).is_ok());
        keepalive.push(0);
        assert_eq!(
            parse_copy_data(keepalive.into()),
            Err(DecodeError::TrailingBytes {
                message: "primary keepalive",
                count: 1
            })
        );
    }

    #[test]
    fn rejects_unknown_tag() {
        assert_eq!(
            parse_copy_data(Bytes::from_static(b"r")),
            Err(DecodeError::UnknownReplicationTag { tag: b'r' })
        );
    }

    #[test]
    fn encodes_standby_status_update() {
        let mut out = BytesMut::from(&b"xy"[..]);
        encode_standby_status_update(
            Lsn(1),
            Lsn(0x0102),
            Lsn(0x0A0B_0C0D_0E0F_1011),
            -2,
            true,
            &mut out,
        );
        let mut want = b"xyr".to_vec();
        want.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 1]);
        want.extend_from_slice(&[0, 0, 0, 0, 0, 0, 1, 2]);
        want.extend_from_slice(&[0x0A, 0x0B, 0x0C, 0x0D, 0x0E, 0x0F, 0x10, 0x11]);
        want.extend_from_slice(&[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xfe]);
        want.push(1);
        assert_eq!(&out[..], &want[..]);
        assert_eq!(out.len(), 2 + 34);

        let mut out = BytesMut::new();
        encode_standby_status_update(Lsn(0), Lsn(0), Lsn(0), 0, false, &mut out);
        assert_eq!(out[33], 0);
    }

    #[test]
    fn converts_to_postgres_epoch() {
        let pg_epoch = UNIX_EPOCH + Duration::from_secs(946_684_800);
        assert_eq!(system_time_to_pg_micros(pg_epoch), 0);
        assert_eq!(
            system_time_to_pg_micros(pg_epoch + Duration::from_micros(1_500_001)),
            1_500_001
        );
        assert_eq!(system_time_to_pg_micros(UNIX_EPOCH), -946_684_800_000_000);
        // 2026-01-01T00:00:00Z is 820_540_800 s after 2000-01-01.
        let y2026 = UNIX_EPOCH + Duration::from_secs(1_767_225_600);
        assert_eq!(system_time_to_pg_micros(y2026), 820_540_800_000_000);
        assert!(pg_now_micros() > 0, "the clock is after 2000-01-01");
    }
}
