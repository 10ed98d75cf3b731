//! A read cursor over [`Bytes`] that checks every length before reading and slices
//! without copying.

use bytes::{Buf, Bytes};

use crate::error::DecodeError;
use crate::Lsn;

/// Reads big-endian fields from the front of a `Bytes`. Every read checks the remaining
/// length first and returns [`DecodeError`] instead of panicking; byte-string reads are
/// `Bytes::split_to` (a reference-count bump, no copy).
#[derive(Debug)]
pub(crate) struct Cursor {
    buf: Bytes,
}

impl Cursor {
    pub(crate) fn new(buf: Bytes) -> Cursor {
        Cursor { buf }
    }

    #[cfg(test)]
    pub(crate) fn remaining(&self) -> usize {
        self.buf.len()
    }

    fn need(&self, needed: usize, reading: &'static str) -> Result<(), DecodeError> {
        if self.buf.len() < needed {
            return Err(DecodeError::UnexpectedEnd {
                reading,
                needed,
                remaining: self.buf.len(),
            });
        }
        Ok(())
    }

    pub(crate) fn u8(&mut self, reading: &'static str) -> Result<u8, DecodeError> {
        self.need(1, reading)?;
        Ok(self.buf.get_u8())
    }

    pub(crate) fn u16(&mut self, reading: &'static str) -> Result<u16, DecodeError> {
        self.need(2, reading)?;
        Ok(self.buf.get_u16())
    }

    pub(crate) fn u32(&mut self, reading: &'static str) -> Result<u32, DecodeError> {
        self.need(4, reading)?;
        Ok(self.buf.get_u32())
    }

    pub(crate) fn i32(&mut self, reading: &'static str) -> Result<i32, DecodeError> {
        self.need(4, reading)?;
        Ok(self.buf.get_i32())
    }

    pub(crate) fn i64(&mut self, reading: &'static str) -> Result<i64, DecodeError> {
        self.need(8, reading)?;
        Ok(self.buf.get_i64())
    }

    pub(crate) fn lsn(&mut self, reading: &'static str) -> Result<Lsn, DecodeError> {
        self.need(8, reading)?;
        Ok(Lsn(self.buf.get_u64()))
    }

    /// An `Int32` length followed by that many bytes, returned as a slice of the input.
    pub(crate) fn len_prefixed(&mut self, reading: &'static str) -> Result<Bytes, DecodeError> {
        let length = self.i32(reading)?;
        let len =
            usize::try_from(length).map_err(|_| DecodeError::NegativeLength { reading, length })?;
        if len > self.buf.len() {
            return Err(DecodeError::LengthExceedsInput {
                reading,
                length: len as u64,
                remaining: self.buf.len(),
            });
        }
        Ok(self.buf.split_to(len))
    }

    /// A NUL-terminated UTF-8 string (the terminator is consumed, not returned).
    pub(crate) fn cstring(&mut self, reading: &'static str) -> Result<String, DecodeError> {
        let end = self
            .buf
            .iter()
            .position(|&b| b == 0)
            .ok_or(DecodeError::MissingNulTerminator { reading })?;
        let s = std::str::from_utf8(&self.buf[..end])
            .map_err(|_| DecodeError::InvalidUtf8 { reading })?
            .to_owned();
        self.buf.advance(end + 1);
        Ok(s)
    }

    /// Checks that `count` entries of at least `min_size` bytes each can fit in the
    /// rest of the input, so that a count read from the wire can size an allocation.
    pub(crate) fn check_count(
        &self,
        count: u64,
        min_size: u64,
        reading: &'static str,
    ) -> Result<usize, DecodeError> {
        let fits = count
            .checked_mul(min_size)
            .is_some_and(|n| n <= self.buf.len() as u64);
        match usize::try_from(count) {
            Ok(count) if fits => Ok(count),
            _ => Err(DecodeError::CountExceedsInput {
                reading,
                count,
                remaining: self.buf.len(),
            }),
        }
    }

    /// The rest of the input, without copying.
    pub(crate) fn rest(self) -> Bytes {
        self.buf
    }

    /// Fails if any byte is left after a complete `message`.
    pub(crate) fn finish(&self, message: &'static str) -> Result<(), DecodeError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(DecodeError::TrailingBytes {
                message,
                count: self.buf.len(),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn reads_fields_and_reports_truncation() {
        let mut c = Cursor::new(Bytes::from_static(&[0, 1, 0, 0, 0, 2, 7]));
        assert_eq!(c.u16("a").unwrap(), 1);
        assert_eq!(c.u32("b").unwrap(), 2);
        assert_eq!(
            c.u16("c"),
            Err(DecodeError::UnexpectedEnd {
                reading: "c",
                needed: 2,
                remaining: 1
            })
        );
        assert_eq!(
            c.finish("m"),
            Err(DecodeError::TrailingBytes {
                message: "m",
                count: 1
            })
        );
    }

    #[test]
    fn len_prefixed_slices_without_copying() {
        let input = Bytes::from_static(&[0, 0, 0, 3, b'a', b'b', b'c', b'd']);
        let base = input.as_ptr();
        let mut c = Cursor::new(input);
        let v = c.len_prefixed("value").unwrap();
        assert_eq!(&v[..], b"abc");
        assert_eq!(
            v.as_ptr(),
            base.wrapping_add(4),
            "the value is a slice of the input"
        );
        assert_eq!(c.remaining(), 1);
    }

    #[test]
    fn len_prefixed_rejects_negative_and_oversized_lengths() {
        let mut c = Cursor::new(Bytes::from_static(&[0xff, 0xff, 0xff, 0xff]));
        assert_eq!(
            c.len_prefixed("v"),
            Err(DecodeError::NegativeLength {
                reading: "v",
                length: -1
            })
        );
        let mut c = Cursor::new(Bytes::from_static(&[0x7f, 0xff, 0xff, 0xff, 1]));
        assert_eq!(
            c.len_prefixed("v"),
            Err(DecodeError::LengthExceedsInput {
                reading: "v",
                length: 0x7fff_ffff,
                remaining: 1
            })
        );
    }

    #[test]
    fn cstring_needs_terminator_and_utf8() {
        let mut c = Cursor::new(Bytes::from_static(b"public\0x"));
        assert_eq!(c.cstring("n").unwrap(), "public");
        assert_eq!(
            c.cstring("n"),
            Err(DecodeError::MissingNulTerminator { reading: "n" })
        );
        let mut c = Cursor::new(Bytes::from_static(b"\xff\xfe\0"));
        assert_eq!(
            c.cstring("n"),
            Err(DecodeError::InvalidUtf8 { reading: "n" })
        );
    }

    #[test]
    fn check_count_bounds_by_remaining_bytes() {
        let c = Cursor::new(Bytes::from_static(&[0; 20]));
        assert_eq!(c.check_count(2, 10, "n").unwrap(), 2);
        assert!(c.check_count(3, 10, "n").is_err());
        assert!(
            c.check_count(u64::MAX, 2, "n").is_err(),
            "overflow is an error"
        );
    }
}
