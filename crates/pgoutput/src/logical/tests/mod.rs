//! Decoder tests on bytes built by hand from the protocol documentation. Bytes captured
//! from a real server are tested in `tests/captured.rs`.

#![allow(clippy::unwrap_used)]

use bytes::Bytes;

use super::*;
use crate::Lsn;

mod messages;
mod streaming;
mod tuples;

/// Builds a message field by field, big-endian.
#[derive(Default)]
struct Msg(Vec<u8>);

impl Msg {
    fn tag(t: u8) -> Msg {
        Msg(vec![t])
    }
    fn u8(mut self, v: u8) -> Msg {
        self.0.push(v);
        self
    }
    fn u16(mut self, v: u16) -> Msg {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }
    fn u32(mut self, v: u32) -> Msg {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }
    fn i32(mut self, v: i32) -> Msg {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }
    fn u64(mut self, v: u64) -> Msg {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }
    fn i64(mut self, v: i64) -> Msg {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }
    fn str(mut self, s: &str) -> Msg {
        self.0.extend_from_slice(s.as_bytes());
        self.0.push(0);
        self
    }
    fn raw(mut self, b: &[u8]) -> Msg {
        self.0.extend_from_slice(b);
        self
    }
    fn text(self, v: &[u8]) -> Msg {
        self.u8(b't').i32(v.len() as i32).raw(v)
    }
    fn bytes(&self) -> Bytes {
        Bytes::copy_from_slice(&self.0)
    }
}

fn decode(d: &mut Decoder, m: &Msg) -> Result<LogicalMessage, DecodeError> {
    d.decode(m.bytes())
}

/// Every strict prefix of `m` must fail to decode (messages are self-delimiting).
fn assert_prefixes_fail(d: &Decoder, m: &Msg) {
    for n in 0..m.0.len() {
        let mut after = d.clone();
        let r = after.decode(Bytes::copy_from_slice(&m.0[..n]));
        assert!(r.is_err(), "prefix of {n} bytes decoded: {r:?}");
        assert_eq!(&after, d, "a failed decode changed the decoder's state");
    }
}

fn stream_start(xid: u32) -> Msg {
    Msg::tag(b'S').u32(xid).u8(1)
}

fn stream_abort_v4(parallel_fields: bool) -> Msg {
    let m = Msg::tag(b'A').u32(700).u32(701);
    if parallel_fields {
        m.u64(0x0000_0002_0000_0010).i64(123_456_789)
    } else {
        m
    }
}
