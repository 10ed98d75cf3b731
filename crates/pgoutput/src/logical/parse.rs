//! Body parsers: each reads one message's fields after the tag byte. The caller
//! ([`super::Decoder`]) reads the tag, the optional streamed-transaction xid and checks
//! for trailing bytes.

use crate::cursor::Cursor;
use crate::error::DecodeError;

use super::messages::*;

/// Smallest encoding of a Relation column: flags, empty name's NUL, type OID, typmod.
const MIN_RELATION_COLUMN_LEN: u64 = 1 + 1 + 4 + 4;

pub(super) fn begin(c: &mut Cursor) -> Result<Begin, DecodeError> {
    Ok(Begin {
        final_lsn: c.lsn("Begin final LSN")?,
        commit_time: c.i64("Begin commit time")?,
        xid: c.u32("Begin xid")?,
    })
}

pub(super) fn commit(c: &mut Cursor) -> Result<Commit, DecodeError> {
    Ok(Commit {
        flags: c.u8("Commit flags")?,
        commit_lsn: c.lsn("Commit LSN")?,
        end_lsn: c.lsn("Commit end LSN")?,
        commit_time: c.i64("Commit time")?,
    })
}

pub(super) fn origin(c: &mut Cursor) -> Result<Origin, DecodeError> {
    Ok(Origin {
        commit_lsn: c.lsn("Origin commit LSN")?,
        name: c.cstring("Origin name")?,
    })
}

pub(super) fn relation(c: &mut Cursor, xid: Option<u32>) -> Result<Relation, DecodeError> {
    let id = c.u32("Relation OID")?;
    let namespace = c.cstring("Relation namespace")?;
    let name = c.cstring("Relation name")?;
    let replica_identity = c.u8("Relation replica identity")?;
    let count = c.u16("Relation column count")?;
    let count = c.check_count(
        u64::from(count),
        MIN_RELATION_COLUMN_LEN,
        "Relation column count",
    )?;
    let mut columns = Vec::with_capacity(count);
    for _ in 0..count {
        columns.push(RelationColumn {
            flags: c.u8("Relation column flags")?,
            name: c.cstring("Relation column name")?,
            type_oid: c.u32("Relation column type OID")?,
            type_modifier: c.i32("Relation column type modifier")?,
        });
    }
    Ok(Relation {
        xid,
        id,
        namespace,
        name,
        replica_identity,
        columns,
    })
}

pub(super) fn type_message(c: &mut Cursor, xid: Option<u32>) -> Result<TypeMessage, DecodeError> {
    Ok(TypeMessage {
        xid,
        id: c.u32("Type OID")?,
        namespace: c.cstring("Type namespace")?,
        name: c.cstring("Type name")?,
    })
}

pub(super) fn insert(c: &mut Cursor, xid: Option<u32>) -> Result<Insert, DecodeError> {
    let relation_id = c.u32("Insert relation OID")?;
    match c.u8("Insert tuple marker")? {
        b'N' => Ok(Insert {
            xid,
            relation_id,
            tuple: tuple(c)?,
        }),
        found => Err(DecodeError::UnexpectedTupleMarker {
            message: "Insert",
            found,
            expected: "'N'",
        }),
    }
}

pub(super) fn update(c: &mut Cursor, xid: Option<u32>) -> Result<Update, DecodeError> {
    let relation_id = c.u32("Update relation OID")?;
    let (mut old_key, mut old_tuple) = (None, None);
    let mut marker = c.u8("Update tuple marker")?;
    if marker == b'K' || marker == b'O' {
        let old = tuple(c)?;
        if marker == b'K' {
            old_key = Some(old);
        } else {
            old_tuple = Some(old);
        }
        marker = c.u8("Update new tuple marker")?;
        if marker != b'N' {
            return Err(DecodeError::UnexpectedTupleMarker {
                message: "Update",
                found: marker,
                expected: "'N' after the old tuple",
            });
        }
    }
    if marker != b'N' {
        return Err(DecodeError::UnexpectedTupleMarker {
            message: "Update",
            found: marker,
            expected: "'K', 'O' or 'N'",
        });
    }
    Ok(Update {
        xid,
        relation_id,
        old_key,
        old_tuple,
        new_tuple: tuple(c)?,
    })
}

pub(super) fn delete(c: &mut Cursor, xid: Option<u32>) -> Result<Delete, DecodeError> {
    let relation_id = c.u32("Delete relation OID")?;
    let (old_key, old_tuple) = match c.u8("Delete tuple marker")? {
        b'K' => (Some(tuple(c)?), None),
        b'O' => (None, Some(tuple(c)?)),
        found => {
            return Err(DecodeError::UnexpectedTupleMarker {
                message: "Delete",
                found,
                expected: "'K' or 'O'",
            })
        }
    };
    Ok(Delete {
        xid,
        relation_id,
        old_key,
        old_tuple,
    })
}

pub(super) fn truncate(c: &mut Cursor, xid: Option<u32>) -> Result<Truncate, DecodeError> {
    let count = c.u32("Truncate relation count")?;
    let options = c.u8("Truncate options")?;
    let count = c.check_count(u64::from(count), 4, "Truncate relation count")?;
    let mut relation_ids = Vec::with_capacity(count);
    for _ in 0..count {
        relation_ids.push(c.u32("Truncate relation OID")?);
    }
    Ok(Truncate {
        xid,
        options,
        relation_ids,
    })
}

pub(super) fn message(
    c: &mut Cursor,
    xid: Option<u32>,
) -> Result<LogicalDecodingMessage, DecodeError> {
    Ok(LogicalDecodingMessage {
        xid,
        flags: c.u8("Message flags")?,
        lsn: c.lsn("Message LSN")?,
        prefix: c.cstring("Message prefix")?,
        content: c.len_prefixed("Message content")?,
    })
}

pub(super) fn stream_start(c: &mut Cursor) -> Result<StreamStart, DecodeError> {
    Ok(StreamStart {
        xid: c.u32("Stream Start xid")?,
        first_segment: c.u8("Stream Start first-segment flag")? != 0,
    })
}

pub(super) fn stream_commit(c: &mut Cursor) -> Result<StreamCommit, DecodeError> {
    Ok(StreamCommit {
        xid: c.u32("Stream Commit xid")?,
        flags: c.u8("Stream Commit flags")?,
        commit_lsn: c.lsn("Stream Commit LSN")?,
        end_lsn: c.lsn("Stream Commit end LSN")?,
        commit_time: c.i64("Stream Commit time")?,
    })
}

pub(super) fn stream_abort(c: &mut Cursor, parallel: bool) -> Result<StreamAbort, DecodeError> {
    let xid = c.u32("Stream Abort xid")?;
    let subxid = c.u32("Stream Abort subtransaction xid")?;
    let (abort_lsn, abort_time) = if parallel {
        (
            Some(c.lsn("Stream Abort LSN")?),
            Some(c.i64("Stream Abort time")?),
        )
    } else {
        (None, None)
    };
    Ok(StreamAbort {
        xid,
        subxid,
        abort_lsn,
        abort_time,
    })
}

pub(super) fn begin_prepare(c: &mut Cursor) -> Result<BeginPrepare, DecodeError> {
    Ok(BeginPrepare {
        prepare_lsn: c.lsn("Begin Prepare LSN")?,
        end_lsn: c.lsn("Begin Prepare end LSN")?,
        prepare_time: c.i64("Begin Prepare time")?,
        xid: c.u32("Begin Prepare xid")?,
        gid: c.cstring("Begin Prepare gid")?,
    })
}

pub(super) fn prepare(c: &mut Cursor) -> Result<Prepare, DecodeError> {
    Ok(Prepare {
        flags: c.u8("Prepare flags")?,
        prepare_lsn: c.lsn("Prepare LSN")?,
        end_lsn: c.lsn("Prepare end LSN")?,
        prepare_time: c.i64("Prepare time")?,
        xid: c.u32("Prepare xid")?,
        gid: c.cstring("Prepare gid")?,
    })
}

pub(super) fn commit_prepared(c: &mut Cursor) -> Result<CommitPrepared, DecodeError> {
    Ok(CommitPrepared {
        flags: c.u8("Commit Prepared flags")?,
        commit_lsn: c.lsn("Commit Prepared LSN")?,
        end_lsn: c.lsn("Commit Prepared end LSN")?,
        commit_time: c.i64("Commit Prepared time")?,
        xid: c.u32("Commit Prepared xid")?,
        gid: c.cstring("Commit Prepared gid")?,
    })
}

pub(super) fn rollback_prepared(c: &mut Cursor) -> Result<RollbackPrepared, DecodeError> {
    Ok(RollbackPrepared {
        flags: c.u8("Rollback Prepared flags")?,
        prepare_end_lsn: c.lsn("Rollback Prepared prepare end LSN")?,
        rollback_end_lsn: c.lsn("Rollback Prepared rollback end LSN")?,
        prepare_time: c.i64("Rollback Prepared prepare time")?,
        rollback_time: c.i64("Rollback Prepared rollback time")?,
        xid: c.u32("Rollback Prepared xid")?,
        gid: c.cstring("Rollback Prepared gid")?,
    })
}

pub(super) fn stream_prepare(c: &mut Cursor) -> Result<StreamPrepare, DecodeError> {
    Ok(StreamPrepare {
        flags: c.u8("Stream Prepare flags")?,
        prepare_lsn: c.lsn("Stream Prepare LSN")?,
        end_lsn: c.lsn("Stream Prepare end LSN")?,
        prepare_time: c.i64("Stream Prepare time")?,
        xid: c.u32("Stream Prepare xid")?,
        gid: c.cstring("Stream Prepare gid")?,
    })
}

/// TupleData: `Int16` column count, then per column a kind byte (`n`, `u`, `t`, `b`)
/// and, for `t`/`b`, an `Int32` length and the value. The `Vec` is sized from the count
/// only after checking the input can hold that many columns (one byte each at least).
fn tuple(c: &mut Cursor) -> Result<TupleData, DecodeError> {
    let count = c.u16("tuple column count")?;
    let count = c.check_count(u64::from(count), 1, "tuple column count")?;
    let mut columns = Vec::with_capacity(count);
    for _ in 0..count {
        columns.push(match c.u8("tuple column kind")? {
            b'n' => Column::Null,
            b'u' => Column::UnchangedToast,
            b't' => Column::Text(c.len_prefixed("text column value")?),
            b'b' => Column::Binary(c.len_prefixed("binary column value")?),
            kind => return Err(DecodeError::UnknownColumnKind { kind }),
        });
    }
    Ok(TupleData { columns })
}
