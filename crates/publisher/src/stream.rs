//! PLACEHOLDER for branch `stream`'s RabbitMQ stream sink (interface only): replaced
//! by that branch's module when it is merged. Every call fails.

use std::path::PathBuf;
use std::time::Duration;

use outbox_event::{Lsn, WalBatch};
use tokio::sync::{mpsc, watch};

use crate::{PublishError, PublisherReport, PublisherStatus};

#[derive(Debug, Clone)]
pub struct StreamConfig {
    pub urls: Vec<String>,
    pub stream: String,
    pub declare_stream: bool,
    pub max_length_bytes: Option<u64>,
    pub max_age: Option<Duration>,
    pub producer_reference: Option<String>,
    pub max_in_flight: usize,
    pub extra_properties: Vec<(String, String)>,
    pub ca_file: Option<PathBuf>,
    pub backoff_initial: Duration,
    pub backoff_max: Duration,
    pub shutdown_timeout: Duration,
}

impl StreamConfig {
    pub fn new(url: impl Into<String>, stream: impl Into<String>) -> Self {
        StreamConfig {
            urls: vec![url.into()],
            stream: stream.into(),
            declare_stream: true,
            max_length_bytes: None,
            max_age: None,
            producer_reference: None,
            max_in_flight: crate::DEFAULT_MAX_IN_FLIGHT,
            extra_properties: Vec::new(),
            ca_file: None,
            backoff_initial: Duration::from_millis(100),
            backoff_max: Duration::from_secs(10),
            shutdown_timeout: Duration::from_secs(30),
        }
    }
}

pub struct StreamPublisher {
    status: PublisherStatus,
}

impl StreamPublisher {
    pub async fn connect(_cfg: StreamConfig) -> Result<StreamPublisher, PublishError> {
        unimplemented!("branch stream")
    }
    pub fn status(&self) -> PublisherStatus {
        self.status.clone()
    }
    pub async fn run(
        self,
        _input: mpsc::Receiver<WalBatch>,
        _watermark: watch::Sender<Lsn>,
    ) -> Result<PublisherReport, PublishError> {
        unimplemented!("branch stream")
    }
    pub async fn run_with_flushed(
        self,
        _input: mpsc::Receiver<WalBatch>,
        _watermark: watch::Sender<Lsn>,
        _flushed: watch::Receiver<Lsn>,
    ) -> Result<PublisherReport, PublishError> {
        unimplemented!("branch stream")
    }
}
