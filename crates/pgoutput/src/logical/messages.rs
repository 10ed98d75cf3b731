//! One struct per pgoutput message. Field names follow the protocol documentation
//! ("Logical Replication Message Formats"); times are raw Postgres timestamps
//! (µs since 2000-01-01 UTC). `xid: Option<u32>` fields are `Some` exactly for messages
//! that arrive inside a Stream Start..Stream Stop block; the xid is that of the
//! (sub)transaction that made the change, which is either the Stream Start's xid or one
//! of its subtransactions' (the `subxid` a later Stream Abort may name).

use bytes::Bytes;

use crate::Lsn;

/// A decoded pgoutput message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LogicalMessage {
    Begin(Begin),
    Commit(Commit),
    Origin(Origin),
    Relation(Relation),
    Type(TypeMessage),
    Insert(Insert),
    Update(Update),
    Delete(Delete),
    Truncate(Truncate),
    Message(LogicalDecodingMessage),
    StreamStart(StreamStart),
    StreamStop,
    StreamCommit(StreamCommit),
    StreamAbort(StreamAbort),
    BeginPrepare(BeginPrepare),
    Prepare(Prepare),
    CommitPrepared(CommitPrepared),
    RollbackPrepared(RollbackPrepared),
    StreamPrepare(StreamPrepare),
}

impl LogicalMessage {
    /// The message type's name as the protocol documentation spells it.
    pub fn name(&self) -> &'static str {
        match self {
            LogicalMessage::Begin(_) => "Begin",
            LogicalMessage::Commit(_) => "Commit",
            LogicalMessage::Origin(_) => "Origin",
            LogicalMessage::Relation(_) => "Relation",
            LogicalMessage::Type(_) => "Type",
            LogicalMessage::Insert(_) => "Insert",
            LogicalMessage::Update(_) => "Update",
            LogicalMessage::Delete(_) => "Delete",
            LogicalMessage::Truncate(_) => "Truncate",
            LogicalMessage::Message(_) => "Message",
            LogicalMessage::StreamStart(_) => "Stream Start",
            LogicalMessage::StreamStop => "Stream Stop",
            LogicalMessage::StreamCommit(_) => "Stream Commit",
            LogicalMessage::StreamAbort(_) => "Stream Abort",
            LogicalMessage::BeginPrepare(_) => "Begin Prepare",
            LogicalMessage::Prepare(_) => "Prepare",
            LogicalMessage::CommitPrepared(_) => "Commit Prepared",
            LogicalMessage::RollbackPrepared(_) => "Rollback Prepared",
            LogicalMessage::StreamPrepare(_) => "Stream Prepare",
        }
    }
}

/// `B`: a transaction starts (sent when it commits, unless streamed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Begin {
    /// The LSN of the commit record.
    pub final_lsn: Lsn,
    pub commit_time: i64,
    pub xid: u32,
}

/// `C`: the transaction begun by the last [`Begin`] committed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Commit {
    /// Currently unused (0).
    pub flags: u8,
    /// The LSN of the commit record.
    pub commit_lsn: Lsn,
    /// The LSN just past the commit record: the position to confirm as flushed.
    pub end_lsn: Lsn,
    pub commit_time: i64,
}

/// `O`: the transaction was replayed from another node (`pg_replication_origin_*`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Origin {
    /// The commit LSN on the origin server (0/0 when the origin session did not set it).
    pub commit_lsn: Lsn,
    pub name: String,
}

/// `R`: describes a table before the first change to it in a session (and after
/// schema changes). Changes refer to it by `id`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Relation {
    pub xid: Option<u32>,
    /// The table's OID.
    pub id: u32,
    /// The schema; empty for `pg_catalog`.
    pub namespace: String,
    pub name: String,
    /// `relreplident`: b'd' default, b'n' nothing, b'f' full, b'i' index.
    pub replica_identity: u8,
    pub columns: Vec<RelationColumn>,
}

/// A column of a [`Relation`], in table order (dropped and generated columns omitted).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelationColumn {
    /// `flags & 1`: the column is part of the replica identity key.
    pub flags: u8,
    pub name: String,
    pub type_oid: u32,
    /// `atttypmod` (-1 when there is none).
    pub type_modifier: i32,
}

impl RelationColumn {
    /// Whether the column is part of the replica identity key.
    pub fn is_key(&self) -> bool {
        self.flags & 1 != 0
    }
}

/// `Y`: names a user-defined type used by a following [`Relation`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TypeMessage {
    pub xid: Option<u32>,
    /// The type's OID.
    pub id: u32,
    /// The schema; empty for `pg_catalog`.
    pub namespace: String,
    pub name: String,
}

/// `I`: a new row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Insert {
    pub xid: Option<u32>,
    pub relation_id: u32,
    pub tuple: TupleData,
}

/// `U`: a changed row. `old_key` (`K`) is sent when a replica identity key column
/// changed, `old_tuple` (`O`) under REPLICA IDENTITY FULL; at most one is `Some`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Update {
    pub xid: Option<u32>,
    pub relation_id: u32,
    pub old_key: Option<TupleData>,
    pub old_tuple: Option<TupleData>,
    pub new_tuple: TupleData,
}

/// `D`: a deleted row, identified by its key (`K`) or, under REPLICA IDENTITY FULL,
/// the whole old row (`O`); exactly one is `Some`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delete {
    pub xid: Option<u32>,
    pub relation_id: u32,
    pub old_key: Option<TupleData>,
    pub old_tuple: Option<TupleData>,
}

/// `T`: tables truncated together.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Truncate {
    pub xid: Option<u32>,
    /// Bit 1: CASCADE; bit 2: RESTART IDENTITY.
    pub options: u8,
    pub relation_ids: Vec<u32>,
}

/// `M`: a message from `pg_logical_emit_message` (needs `messages 'true'`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogicalDecodingMessage {
    pub xid: Option<u32>,
    /// 1: transactional (sent inside its transaction); 0: sent when decoded.
    pub flags: u8,
    pub lsn: Lsn,
    pub prefix: String,
    /// A slice of the input.
    pub content: Bytes,
}

/// `S`: the start of a block of changes of an in-progress (streamed) transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamStart {
    pub xid: u32,
    /// The first block of this transaction.
    pub first_segment: bool,
}

/// `c`: a streamed transaction committed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamCommit {
    pub xid: u32,
    /// Currently unused (0).
    pub flags: u8,
    pub commit_lsn: Lsn,
    /// The position to confirm as flushed.
    pub end_lsn: Lsn,
    pub commit_time: i64,
}

/// `A`: a streamed transaction (`subxid == xid`) or one of its subtransactions aborted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamAbort {
    pub xid: u32,
    pub subxid: u32,
    /// Only with protocol version 4 and streaming = 'parallel'.
    pub abort_lsn: Option<Lsn>,
    /// Only with protocol version 4 and streaming = 'parallel'.
    pub abort_time: Option<i64>,
}

/// `b`: a two-phase transaction's changes follow (protocol version 3).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BeginPrepare {
    pub prepare_lsn: Lsn,
    pub end_lsn: Lsn,
    pub prepare_time: i64,
    pub xid: u32,
    /// The `PREPARE TRANSACTION` identifier.
    pub gid: String,
}

/// `P`: the transaction begun by [`BeginPrepare`] was prepared.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prepare {
    pub flags: u8,
    pub prepare_lsn: Lsn,
    pub end_lsn: Lsn,
    pub prepare_time: i64,
    pub xid: u32,
    pub gid: String,
}

/// `K`: a prepared transaction was committed (`COMMIT PREPARED`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommitPrepared {
    pub flags: u8,
    pub commit_lsn: Lsn,
    pub end_lsn: Lsn,
    pub commit_time: i64,
    pub xid: u32,
    pub gid: String,
}

/// `r`: a prepared transaction was rolled back (`ROLLBACK PREPARED`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RollbackPrepared {
    pub flags: u8,
    pub prepare_end_lsn: Lsn,
    pub rollback_end_lsn: Lsn,
    pub prepare_time: i64,
    pub rollback_time: i64,
    pub xid: u32,
    pub gid: String,
}

/// `p`: a streamed transaction was prepared.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamPrepare {
    pub flags: u8,
    pub prepare_lsn: Lsn,
    pub end_lsn: Lsn,
    pub prepare_time: i64,
    pub xid: u32,
    pub gid: String,
}

/// The columns of one row, in the order of the [`Relation`]'s columns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TupleData {
    pub columns: Vec<Column>,
}

/// One column value of a [`TupleData`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Column {
    /// `n`: SQL NULL.
    Null,
    /// `u`: a TOASTed value that did not change; the value itself is not sent.
    UnchangedToast,
    /// `t`: the value in the type's text output format, a slice of the input.
    Text(Bytes),
    /// `b`: the value in the type's binary send format (`binary 'true'`), a slice of
    /// the input.
    Binary(Bytes),
}
