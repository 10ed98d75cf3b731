//! Assembles decoded pgoutput messages into outbox events and commit markers.
//!
//! Shared by the live stream ([`crate::stream`]) and by anything else that reads
//! pgoutput messages (peeking at a slot with `pg_logical_slot_peek_binary_changes`,
//! replaying from a copied slot). It keeps the relation cache (a schema change
//! mid-stream arrives as a new Relation message and replaces the entry), maps the
//! configured columns by name, skips updates, deletes, truncates and other tables,
//! and tags each event with its transaction's xid, commit LSN and commit time.
//! With a [`MessageSource`], transactional logical messages of the relayed prefixes
//! are events too, in their place among the transaction's rows ([`crate::messages`]).

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;
use outbox_event::{CommitMarker, Lsn, OutboxEvent, OutboxTable, WalBatch, WalItem};
use pgoutput::logical::{Column, Decoder, LogicalMessage, Relation, TupleData};
use tracing::debug;

use crate::error::ReaderError;
use crate::mapping::{ColumnMapping, TableName};
use crate::messages::{MessageSource, TxOf};
use crate::pgtype::{self, pg_to_unix_micros};

/// Mapped column positions of a relayed relation.
#[derive(Debug, Clone)]
struct RelayedRelation {
    table: Arc<OutboxTable>,
    id: usize,
    aggregate_type: usize,
    aggregate_id: usize,
    event_type: usize,
    payload: usize,
    headers: Option<usize>,
    correlation_id: Option<usize>,
    exchange: Option<usize>,
    /// Property columns: (property, position).
    properties: Vec<(&'static str, usize)>,
}

#[derive(Debug, Clone, Copy)]
struct OpenTx {
    xid: u32,
    commit_lsn: Lsn,
    commit_time_micros: i64,
    events: u64,
}

/// Turns pgoutput messages (protocol version 1) into [`WalItem`]s.
pub struct Assembler {
    decoder: Decoder,
    tables: Vec<TableName>,
    mapping: ColumnMapping,
    /// Relation id → mapped columns, or `None` for a relation we skip.
    relations: HashMap<u32, Option<RelayedRelation>>,
    open: Option<OpenTx>,
    /// The logical messages that are events (`[postgres] messages`), if any.
    messages: Option<MessageSource>,
}

impl Assembler {
    /// An assembler relaying inserts into `tables`, mapped with `mapping`.
    pub fn new(tables: Vec<TableName>, mapping: ColumnMapping) -> Assembler {
        Assembler {
            decoder: Decoder::new(),
            tables,
            mapping,
            relations: HashMap::new(),
            open: None,
            messages: None,
        }
    }

    /// The same assembler relaying the logical messages `source` names as events
    /// (none when it lists no prefix).
    pub fn with_messages(mut self, source: Option<MessageSource>) -> Assembler {
        self.messages = source;
        self
    }

    /// True between a Begin and its Commit.
    pub fn in_transaction(&self) -> bool {
        self.open.is_some()
    }

    /// Handles one pgoutput message; returns true when it closed a transaction.
    pub fn handle(&mut self, data: Bytes, pending: &mut WalBatch) -> Result<bool, ReaderError> {
        match self.decoder.decode(data)? {
            LogicalMessage::Begin(b) => {
                self.open = Some(OpenTx {
                    xid: b.xid,
                    commit_lsn: b.final_lsn,
                    commit_time_micros: pg_to_unix_micros(b.commit_time),
                    events: 0,
                });
            }
            LogicalMessage::Commit(c) => {
                let tx = self
                    .open
                    .take()
                    .ok_or_else(|| ReaderError::Protocol("Commit without Begin".into()))?;
                pending.push(WalItem::Commit(CommitMarker {
                    xid: tx.xid,
                    commit_lsn: c.commit_lsn,
                    end_lsn: c.end_lsn,
                    commit_time_micros: pg_to_unix_micros(c.commit_time),
                    events: tx.events,
                }));
                return Ok(true);
            }
            LogicalMessage::Relation(r) => {
                let mapped = self.map_relation(&r)?;
                if let Some(m) = &mapped {
                    debug!(table = %m.table.qualified_name, relation_id = r.id, "outbox relation mapped");
                }
                self.relations.insert(r.id, mapped);
            }
            LogicalMessage::Insert(ins) => {
                let rel = match self.relations.get(&ins.relation_id) {
                    Some(Some(rel)) => rel,
                    Some(None) => return Ok(false),
                    None => {
                        return Err(ReaderError::Protocol(format!(
                            "insert into relation {} before its Relation message",
                            ins.relation_id
                        )))
                    }
                };
                let tx = self
                    .open
                    .as_mut()
                    .ok_or_else(|| ReaderError::Protocol("Insert outside a transaction".into()))?;
                pending.push(WalItem::Event(build_event(rel, tx, &ins.tuple)));
                tx.events += 1;
            }
            LogicalMessage::Message(m) => {
                let Some(source) = &mut self.messages else {
                    return Ok(false);
                };
                let tx = self.open.as_mut();
                let of = tx.as_ref().map(|tx| TxOf {
                    xid: tx.xid,
                    commit_lsn: tx.commit_lsn,
                    commit_time_micros: tx.commit_time_micros,
                    index: tx.events,
                });
                let of = match of {
                    Some(of) => of,
                    // Non-transactional messages come outside transactions: counted
                    // there, and never events.
                    None if m.flags & 1 == 0 => TxOf {
                        xid: 0,
                        commit_lsn: m.lsn,
                        commit_time_micros: 0,
                        index: 0,
                    },
                    None => {
                        return Err(ReaderError::Protocol(format!(
                            "transactional logical message at {} outside a transaction",
                            m.lsn
                        )))
                    }
                };
                if let Some(event) = source.event(&m, of) {
                    pending.push(WalItem::Event(event));
                    if let Some(tx) = tx {
                        tx.events += 1;
                    }
                }
            }
            // Updates, deletes, truncates, types and origins do not publish.
            LogicalMessage::Update(_)
            | LogicalMessage::Delete(_)
            | LogicalMessage::Truncate(_)
            | LogicalMessage::Type(_)
            | LogicalMessage::Origin(_) => {}
            other => {
                return Err(ReaderError::Protocol(format!(
                    "unexpected message with protocol version 1: {other:?}"
                )))
            }
        }
        Ok(false)
    }

    fn map_relation(&self, r: &Relation) -> Result<Option<RelayedRelation>, ReaderError> {
        let Some(table) = self
            .tables
            .iter()
            .find(|t| t.schema == r.namespace && t.name == r.name)
        else {
            return Ok(None);
        };
        let find = |name: &str| r.columns.iter().position(|c| c.name == name);
        let m = &self.mapping;
        let require = |key: &str, name: &str| {
            find(name).ok_or_else(|| {
                ReaderError::Precondition(format!(
                    "table {table} has no column {name:?} (mapping.{key}): add the column or set [mapping] {key} to an existing column"
                ))
            })
        };
        let payload = require("payload", &m.payload)?;
        let headers = m.headers.as_deref().and_then(find);
        let rel = RelayedRelation {
            id: require("id", &m.id)?,
            aggregate_type: require("aggregate_type", &m.aggregate_type)?,
            aggregate_id: require("aggregate_id", &m.aggregate_id)?,
            event_type: require("event_type", &m.event_type)?,
            payload,
            headers,
            correlation_id: match m.correlation_id.as_deref() {
                Some(c) => Some(require("correlation_id", c)?),
                None => None,
            },
            exchange: match m.exchange.as_deref() {
                Some(c) => Some(require("exchange", c)?),
                None => None,
            },
            properties: m
                .properties
                .iter()
                .map(|(key, c)| Ok((*key, require(key, c)?)))
                .collect::<Result<_, ReaderError>>()?,
            table: Arc::new(pgtype::outbox_table(
                table,
                r.columns[payload].type_oid,
                headers.map(|h| r.columns[h].type_oid),
            )),
        };
        Ok(Some(rel))
    }
}

fn column(tuple: &TupleData, i: usize) -> Option<Bytes> {
    match tuple.columns.get(i) {
        Some(Column::Text(b)) | Some(Column::Binary(b)) => Some(b.clone()),
        _ => None,
    }
}

fn build_event(rel: &RelayedRelation, tx: &OpenTx, tuple: &TupleData) -> OutboxEvent {
    let payload = column(tuple, rel.payload);
    OutboxEvent {
        body: pgtype::body(rel.table.payload_type, payload.as_ref()),
        table: rel.table.clone(),
        xid: tx.xid,
        commit_lsn: tx.commit_lsn,
        commit_time_micros: tx.commit_time_micros,
        index: tx.events,
        id: column(tuple, rel.id),
        aggregate_type: column(tuple, rel.aggregate_type),
        aggregate_id: column(tuple, rel.aggregate_id),
        event_type: column(tuple, rel.event_type),
        payload,
        headers: rel.headers.and_then(|i| column(tuple, i)),
        correlation_id: rel.correlation_id.and_then(|i| column(tuple, i)),
        exchange: rel.exchange.and_then(|i| column(tuple, i)),
        properties: rel
            .properties
            .iter()
            .filter_map(|&(key, i)| Some((key, column(tuple, i)?)))
            .collect(),
        malformed: None,
    }
}
