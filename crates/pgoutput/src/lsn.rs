//! Log sequence numbers.

use std::fmt;
use std::str::FromStr;

/// A WAL position. Prints and parses Postgres' `X/Y` form (hex, upper case when
/// printed); orders as the 64-bit integer it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Lsn(pub u64);

impl Lsn {
    /// `0/0`: "no position" (as a start position: resume from the slot).
    pub const ZERO: Lsn = Lsn(0);
}

impl fmt::Display for Lsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:X}/{:X}", self.0 >> 32, self.0 & 0xFFFF_FFFF)
    }
}

/// The text is not an LSN of the form `X/Y` (hexadecimal halves of at most 8 digits).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid LSN {0:?}: expected the form X/Y in hexadecimal, e.g. 0/16B3748")]
pub struct ParseLsnError(pub String);

impl FromStr for Lsn {
    type Err = ParseLsnError;

    fn from_str(s: &str) -> Result<Lsn, ParseLsnError> {
        let err = || ParseLsnError(s.to_string());
        let (hi, lo) = s.trim().split_once('/').ok_or_else(err)?;
        let half = |h: &str| {
            if h.is_empty() || h.len() > 8 {
                return Err(err());
            }
            u32::from_str_radix(h, 16).map_err(|_| err())
        };
        Ok(Lsn(((half(hi)? as u64) << 32) | half(lo)? as u64))
    }
}

impl From<u64> for Lsn {
    fn from(v: u64) -> Lsn {
        Lsn(v)
    }
}

impl From<Lsn> for u64 {
    fn from(l: Lsn) -> u64 {
        l.0
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn parses_and_prints() {
        let l: Lsn = "16/B374D848".parse().unwrap();
        assert_eq!(l.0, 0x16_B374_D848);
        assert_eq!(l.to_string(), "16/B374D848");
        assert_eq!("0/0".parse::<Lsn>().unwrap(), Lsn::ZERO);
        assert_eq!("0/a".parse::<Lsn>().unwrap().to_string(), "0/A");
    }

    #[test]
    fn rejects_malformed() {
        for bad in ["", "0", "/1", "1/", "x/1", "1/2/3", "123456789/0", "-1/0"] {
            assert!(bad.parse::<Lsn>().is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn orders_numerically() {
        let a: Lsn = "0/FFFFFFFF".parse().unwrap();
        let b: Lsn = "1/0".parse().unwrap();
        assert!(a < b);
    }
}
