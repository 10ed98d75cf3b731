//! A pure decoder of Postgres' pgoutput logical replication protocol (versions 1–4)
//! and of the streaming replication CopyData frames. No I/O.
//!
//! # Layout
//!
//! ```text
//!  CopyData payload ──► replication::parse_copy_data ──► XLogData { data, .. } | PrimaryKeepalive
//!                                                            │
//!                      logical::Decoder::decode(data) ◄──────┘
//!                                  │
//!                                  ▼
//!          LogicalMessage::{Begin, Relation, Insert, …, Commit, StreamStart, …}
//!
//!  replication::encode_standby_status_update ──► payload of the client's CopyData
//! ```
//!
//! - [`replication`]: the `w`/`k` frames the server sends after `START_REPLICATION`,
//!   and the standby status update (`r`) the client sends back.
//! - [`logical`]: pgoutput messages; [`logical::Decoder`] tracks the one bit of state
//!   the protocol needs (inside a streamed-transaction block or not).
//! - [`Lsn`]: WAL positions.
//!
//! The decoder is zero-copy: the input is a [`bytes::Bytes`] and column values,
//! message contents and XLogData payloads are slices of it. Malformed or truncated
//! input is a [`DecodeError`], never a panic; wire lengths and counts are checked
//! against the remaining input before anything is allocated from them.
//!
//! # Example
//!
//! ```
//! use bytes::Bytes;
//! use pgoutput::logical::{Decoder, LogicalMessage};
//! use pgoutput::replication::{parse_copy_data, ReplicationMessage};
//!
//! // An XLogData frame carrying a Stream Stop message.
//! let mut frame = vec![b'w'];
//! frame.extend_from_slice(&[0; 24]);
//! frame.push(b'E');
//!
//! let mut decoder = Decoder::new();
//! if let ReplicationMessage::XLogData(x) = parse_copy_data(Bytes::from(frame)).unwrap() {
//!     // Stream Stop outside a stream block is a protocol error.
//!     assert!(decoder.decode(x.data).is_err());
//! }
//! // A Begin message: tag, final LSN, commit time, xid.
//! let mut begin = vec![b'B'];
//! begin.extend_from_slice(&0x0100_0000u64.to_be_bytes());
//! begin.extend_from_slice(&0i64.to_be_bytes());
//! begin.extend_from_slice(&42u32.to_be_bytes());
//! match decoder.decode(Bytes::from(begin)).unwrap() {
//!     LogicalMessage::Begin(b) => {
//!         assert_eq!(b.xid, 42);
//!         assert_eq!(b.final_lsn.to_string(), "0/1000000");
//!     }
//!     other => panic!("expected Begin, got {other:?}"),
//! }
//! ```

mod cursor;
mod error;
pub mod logical;
mod lsn;
pub mod replication;

pub use error::DecodeError;
pub use lsn::{Lsn, ParseLsnError};
