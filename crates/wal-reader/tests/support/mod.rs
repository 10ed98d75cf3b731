//! Shared setup for the wal-reader integration tests.
#![allow(dead_code, clippy::unwrap_used)]

use std::time::Duration;

use outbox_event::{Lsn, WalBatch, WalItem};
use testkit::{unique_name, TestDb};
use tokio::sync::{mpsc, watch};
use wal_reader::{
    ColumnMapping, PgConnectOptions, ReaderConfig, ReaderError, ReaderExit, TableName, WalReader,
};

pub const OUTBOX_DDL: &str = "CREATE TABLE outbox (
    id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    aggregate_type text NOT NULL,
    aggregate_id text NOT NULL,
    event_type text NOT NULL,
    payload jsonb NOT NULL,
    headers jsonb,
    created_at timestamptz NOT NULL DEFAULT now());";

/// A database with the default outbox table, a publication and a pgoutput slot.
pub struct Fixture {
    pub db: TestDb,
    pub slot: String,
    pub publication: String,
}

impl Fixture {
    pub fn new() -> Fixture {
        Self::with_ddl(OUTBOX_DDL, "public.outbox")
    }

    pub fn with_ddl(ddl: &str, tables: &str) -> Fixture {
        let db = TestDb::new("wr");
        db.psql(ddl);
        let publication = unique_name("pub");
        let slot = unique_name("slot");
        db.psql(&format!(
            "CREATE PUBLICATION {publication} FOR TABLE {tables} WITH (publish = 'insert')"
        ));
        db.psql(&format!(
            "SELECT pg_create_logical_replication_slot('{slot}', 'pgoutput')"
        ));
        Fixture {
            db,
            slot,
            publication,
        }
    }

    pub fn config(&self) -> ReaderConfig {
        ReaderConfig {
            conn: PgConnectOptions::parse(&self.db.conninfo()).unwrap(),
            slot: self.slot.clone(),
            publication: self.publication.clone(),
            tables: vec![TableName::parse("public.outbox").unwrap()],
            messages: Vec::new(),
            mapping: ColumnMapping::default(),
            start_lsn: None,
            status_interval: Duration::from_millis(200),
            max_in_flight: 1000,
        }
    }

    pub fn confirmed_flush(&self) -> Lsn {
        self.db
            .psql(&format!(
                "SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = '{}'",
                self.slot
            ))
            .parse()
            .unwrap()
    }
}

/// A running reader and the ends of its channels.
pub struct Running {
    pub rx: mpsc::Receiver<WalBatch>,
    pub acked: watch::Sender<Lsn>,
    pub stop: watch::Sender<bool>,
    pub task: tokio::task::JoinHandle<Result<ReaderExit, ReaderError>>,
}

pub async fn spawn_reader(cfg: ReaderConfig) -> Running {
    let reader = WalReader::start(cfg).await.expect("reader starts");
    let (tx, rx) = mpsc::channel(16);
    let (acked, acked_rx) = watch::channel(Lsn::ZERO);
    let (stop, stop_rx) = watch::channel(false);
    let task = tokio::spawn(reader.run(tx, acked_rx, stop_rx));
    Running {
        rx,
        acked,
        stop,
        task,
    }
}

impl Running {
    /// Receives items until `pred` holds for the collected list (or 30 s pass).
    pub async fn collect_until(&mut self, pred: impl Fn(&[WalItem]) -> bool) -> Vec<WalItem> {
        let mut items = Vec::new();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while !pred(&items) {
            match tokio::time::timeout_at(deadline, self.rx.recv()).await {
                Ok(Some(batch)) => items.extend(batch),
                Ok(None) => break,
                Err(_) => panic!("timed out; collected {items:#?}"),
            }
        }
        items
    }

    /// Stops cleanly and returns the exit.
    pub async fn stop(mut self) -> ReaderExit {
        self.stop.send(true).unwrap();
        // Drain whatever is left so the reader can reach a boundary.
        while self.rx.recv().await.is_some() {}
        drop(self.acked);
        self.task.await.unwrap().expect("reader ends cleanly")
    }
}

pub fn commits(items: &[WalItem]) -> usize {
    items
        .iter()
        .filter(|i| matches!(i, WalItem::Commit(_)))
        .count()
}

pub fn text(b: &Option<bytes::Bytes>) -> String {
    String::from_utf8(b.as_ref().expect("not null").to_vec()).unwrap()
}
