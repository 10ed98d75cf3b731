//! pgoutput messages: the `data` of each XLogData frame.
//!
//! # Message layout
//!
//! Every message is one tag byte followed by big-endian fields (`Int8/16/32/64`,
//! NUL-terminated UTF-8 `String`s, `Int32`-length-prefixed byte strings). With the
//! tags this decoder knows:
//!
//! ```text
//! B Begin            final LSN, commit time, xid
//! C Commit           flags, commit LSN, end LSN, commit time
//! O Origin           commit LSN, name
//! R Relation         [xid] OID, namespace, name, replica identity, Int16 n, n × column
//!                    (flags, name, type OID, typmod)
//! Y Type             [xid] OID, namespace, name
//! I Insert           [xid] relation OID, 'N' tuple
//! U Update           [xid] relation OID, ['K' tuple | 'O' tuple], 'N' tuple
//! D Delete           [xid] relation OID, 'K' tuple | 'O' tuple
//! T Truncate         [xid] Int32 n, options, n × relation OID
//! M Message          [xid] flags, LSN, prefix, Int32 length, content
//! S Stream Start     xid, first-segment flag                          (v2+)
//! E Stream Stop      —                                                (v2+)
//! c Stream Commit    xid, flags, commit LSN, end LSN, commit time     (v2+)
//! A Stream Abort     xid, subxid, [abort LSN, abort time]             (v2+; [..] v4 parallel)
//! b Begin Prepare    prepare LSN, end LSN, prepare time, xid, gid     (v3+)
//! P Prepare          flags, prepare LSN, end LSN, prepare time, xid, gid
//! K Commit Prepared  flags, commit LSN, end LSN, commit time, xid, gid
//! r Rollback Prep.   flags, prepare end LSN, rollback end LSN, prepare time,
//!                    rollback time, xid, gid
//! p Stream Prepare   flags, prepare LSN, end LSN, prepare time, xid, gid
//! tuple              Int16 n, n × ('n' | 'u' | 't' Int32 len, bytes | 'b' Int32 len, bytes)
//! ```
//!
//! # Stream state
//!
//! Nothing in a message says whether its optional leading `[xid]` is there: the server
//! adds it to Relation, Type, Insert, Update, Delete, Truncate and Message exactly while
//! it is inside a Stream Start..Stream Stop block (an in-progress transaction streamed
//! with `streaming 'on'`). That xid is the (sub)transaction's that made the change:
//! the Stream Start xid or a subtransaction of it (observed on Postgres 15 after a
//! `SAVEPOINT`), which a Stream Abort with `subxid != xid` later discards. [`Decoder`] therefore keeps one bit, `in_stream`, set by a
//! successfully decoded Stream Start and cleared by Stream Stop, and the order of
//! messages matters: use one `Decoder` per replication connection and give it every
//! message in order. Messages that cannot occur inside a block (Begin, Commit, the
//! stream and two-phase control messages) are rejected there, and Stream Stop is
//! rejected outside one, so a decoder that lost track fails loudly instead of
//! misreading an xid as a relation OID. A message that fails to decode leaves the
//! state unchanged.
//!
//! Stream Abort carries an abort LSN and time only when protocol version 4 was
//! requested with `streaming 'parallel'`; nothing in the message says so either, hence
//! [`Decoder::with_parallel_streaming`].
//!
//! # Errors and allocation
//!
//! Malformed input is a [`DecodeError`], never a panic. Every message must be consumed
//! exactly: bytes left over are [`DecodeError::TrailingBytes`] (the usual symptom of a
//! decoder built for the wrong streaming mode). Counts read from the wire size a `Vec`
//! only after checking that the remaining input can hold that many entries. Column
//! values and message contents are slices of the input `Bytes`; the only allocations
//! are a tuple's `Vec<Column>`, Relation's column `Vec` and truncated relation list,
//! and the `String`s of names, prefixes and gids.

mod messages;
mod parse;

use bytes::Bytes;

pub use messages::*;

use crate::cursor::Cursor;
use crate::error::DecodeError;

/// Decodes pgoutput messages, tracking whether it is inside a Stream Start..Stream
/// Stop block (see the [module docs](self)).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Decoder {
    streaming_parallel: bool,
    in_stream: bool,
}

impl Decoder {
    /// A decoder for protocol versions 1 to 4 without `streaming 'parallel'`.
    pub fn new() -> Decoder {
        Decoder::default()
    }

    /// `streaming_parallel`: true when the connection asked for streaming = 'parallel' (proto v4), which adds abort LSN/time to Stream Abort.
    pub fn with_parallel_streaming(streaming_parallel: bool) -> Decoder {
        Decoder {
            streaming_parallel,
            in_stream: false,
        }
    }

    /// Whether the last Stream Start has not yet been followed by its Stream Stop.
    pub fn in_stream(&self) -> bool {
        self.in_stream
    }

    /// Decodes one pgoutput message (the `data` of one XLogData). Inside a stream block, Relation/Type/Insert/Update/Delete/Truncate/Message carry a leading xid: the decoder knows because it saw Stream Start.
    pub fn decode(&mut self, data: Bytes) -> Result<LogicalMessage, DecodeError> {
        let mut c = Cursor::new(data);
        let tag = c.u8("pgoutput message tag")?;
        self.check_state(tag)?;
        let xid = if self.in_stream && carries_stream_xid(tag) {
            Some(c.u32("streamed transaction xid")?)
        } else {
            None
        };
        let message = match tag {
            b'B' => LogicalMessage::Begin(parse::begin(&mut c)?),
            b'C' => LogicalMessage::Commit(parse::commit(&mut c)?),
            b'O' => LogicalMessage::Origin(parse::origin(&mut c)?),
            b'R' => LogicalMessage::Relation(parse::relation(&mut c, xid)?),
            b'Y' => LogicalMessage::Type(parse::type_message(&mut c, xid)?),
            b'I' => LogicalMessage::Insert(parse::insert(&mut c, xid)?),
            b'U' => LogicalMessage::Update(parse::update(&mut c, xid)?),
            b'D' => LogicalMessage::Delete(parse::delete(&mut c, xid)?),
            b'T' => LogicalMessage::Truncate(parse::truncate(&mut c, xid)?),
            b'M' => LogicalMessage::Message(parse::message(&mut c, xid)?),
            b'S' => LogicalMessage::StreamStart(parse::stream_start(&mut c)?),
            b'E' => LogicalMessage::StreamStop,
            b'c' => LogicalMessage::StreamCommit(parse::stream_commit(&mut c)?),
            b'A' => {
                LogicalMessage::StreamAbort(parse::stream_abort(&mut c, self.streaming_parallel)?)
            }
            b'b' => LogicalMessage::BeginPrepare(parse::begin_prepare(&mut c)?),
            b'P' => LogicalMessage::Prepare(parse::prepare(&mut c)?),
            b'K' => LogicalMessage::CommitPrepared(parse::commit_prepared(&mut c)?),
            b'r' => LogicalMessage::RollbackPrepared(parse::rollback_prepared(&mut c)?),
            b'p' => LogicalMessage::StreamPrepare(parse::stream_prepare(&mut c)?),
            tag => return Err(DecodeError::UnknownMessageTag { tag }),
        };
        c.finish(message.name())?;
        match message {
            LogicalMessage::StreamStart(_) => self.in_stream = true,
            LogicalMessage::StreamStop => self.in_stream = false,
            _ => {}
        }
        Ok(message)
    }

    /// Rejects a message the protocol does not allow in the current stream state.
    fn check_state(&self, tag: u8) -> Result<(), DecodeError> {
        let allowed_in_stream = carries_stream_xid(tag) || matches!(tag, b'O' | b'E');
        let (ok, context) = if self.in_stream {
            (
                allowed_in_stream || !is_known_tag(tag),
                "inside a Stream Start..Stream Stop block",
            )
        } else {
            (tag != b'E', "outside a Stream Start..Stream Stop block")
        };
        if ok {
            return Ok(());
        }
        Err(DecodeError::UnexpectedMessage {
            message: tag_name(tag),
            context,
        })
    }
}

/// Tags that carry a leading xid inside a stream block.
fn carries_stream_xid(tag: u8) -> bool {
    matches!(tag, b'R' | b'Y' | b'I' | b'U' | b'D' | b'T' | b'M')
}

fn is_known_tag(tag: u8) -> bool {
    tag_name(tag) != "unknown"
}

fn tag_name(tag: u8) -> &'static str {
    match tag {
        b'B' => "Begin",
        b'C' => "Commit",
        b'O' => "Origin",
        b'R' => "Relation",
        b'Y' => "Type",
        b'I' => "Insert",
        b'U' => "Update",
        b'D' => "Delete",
        b'T' => "Truncate",
        b'M' => "Message",
        b'S' => "Stream Start",
        b'E' => "Stream Stop",
        b'c' => "Stream Commit",
        b'A' => "Stream Abort",
        b'b' => "Begin Prepare",
        b'P' => "Prepare",
        b'K' => "Commit Prepared",
        b'r' => "Rollback Prepared",
        b'p' => "Stream Prepare",
        _ => "unknown",
    }
}

#[cfg(test)]
mod tests;
