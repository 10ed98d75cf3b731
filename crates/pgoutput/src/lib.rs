//! A pure decoder of Postgres' pgoutput logical replication protocol (versions 1–4)
//! and of the streaming replication CopyData frames. No I/O.

mod lsn;

pub use lsn::{Lsn, ParseLsnError};
