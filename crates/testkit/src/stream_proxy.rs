//! A proxy that speaks the RabbitMQ stream protocol's framing, between a stream client
//! and the real broker, to make the broker behave as another one would:
//!
//! - **a lower, enforced frame maximum** ([`StreamProxy::set_frame_max`]): the broker's
//!   `Tune` proposal is lowered, and a client frame larger than what the client then
//!   agreed to closes the connection, as RabbitMQ 4.x does (`FRAME_TOO_LARGE`; the
//!   3.10 broker of these machines does not check). Each such closing is counted
//!   ([`StreamProxy::oversized`]).
//! - **a refusal** ([`StreamProxy::refuse_next_publish`]): the next `Publish` frame is
//!   not forwarded; the client gets a `PublishError` for every id in it (code 16,
//!   access refused), and then either later frames go on to the broker (it stores
//!   them: "refused, but a later one stored"; the error is held until the next
//!   publish frame has been forwarded, so one always is) or the connection is cut.
//!
//! Frames are forwarded whole, so what the proxy injects never splits one.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

const PUBLISH: u16 = 0x0002;
const PUBLISH_ERROR: u16 = 0x0004;
const TUNE: u16 = 0x0014;
const RESPONSE: u16 = 0x8000;
/// The stream protocol's "access refused".
const ACCESS_REFUSED: u16 = 16;

/// What happens after a refused publish frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterRefusal {
    /// Later frames reach the broker (which stores them); the error is sent once the
    /// next publish frame has gone to the broker (a caller must make one come).
    Pass,
    /// The connection is cut after the error is sent.
    Cut,
}

const REFUSE_NONE: u8 = 0;
const REFUSE_PASS: u8 = 1;
const REFUSE_CUT: u8 = 2;

struct Shared {
    /// The frame maximum proposed to clients at most (0: the broker's own).
    frame_max: AtomicU32,
    oversized: AtomicU64,
    refuse: AtomicU8,
    refused_frames: AtomicU64,
    connections: AtomicU64,
    /// The frame maximum the last client agreed to (0: none yet).
    agreed: AtomicU32,
}

/// A running proxy to a stream broker; stops when dropped.
pub struct StreamProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl StreamProxy {
    /// Listens on an ephemeral port of 127.0.0.1 and forwards to `target`.
    pub async fn start(target: SocketAddr) -> StreamProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().expect("proxy address");
        let shared = Arc::new(Shared {
            frame_max: AtomicU32::new(0),
            oversized: AtomicU64::new(0),
            refuse: AtomicU8::new(REFUSE_NONE),
            refused_frames: AtomicU64::new(0),
            connections: AtomicU64::new(0),
            agreed: AtomicU32::new(0),
        });
        let task = {
            let shared = shared.clone();
            tokio::spawn(async move {
                while let Ok((client, _)) = listener.accept().await {
                    let shared = shared.clone();
                    shared.connections.fetch_add(1, Ordering::SeqCst);
                    tokio::spawn(async move {
                        if let Ok(server) = TcpStream::connect(target).await {
                            connection(client, server, shared).await;
                        }
                    });
                }
            })
        };
        StreamProxy { addr, shared, task }
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// Proposes at most `max` bytes per frame to new connections and enforces what
    /// the client agrees to (`None`: the broker's proposal, not enforced).
    pub fn set_frame_max(&self, max: Option<u32>) {
        self.shared
            .frame_max
            .store(max.unwrap_or(0), Ordering::SeqCst);
    }

    /// Connections closed because a client frame was over the agreed maximum.
    pub fn oversized(&self) -> u64 {
        self.shared.oversized.load(Ordering::SeqCst)
    }

    /// Refuses the next publish frame (module docs).
    pub fn refuse_next_publish(&self, after: AfterRefusal) {
        let mode = match after {
            AfterRefusal::Pass => REFUSE_PASS,
            AfterRefusal::Cut => REFUSE_CUT,
        };
        self.shared.refuse.store(mode, Ordering::SeqCst);
    }

    /// Publish frames refused so far.
    pub fn refused_frames(&self) -> u64 {
        self.shared.refused_frames.load(Ordering::SeqCst)
    }

    /// The frame maximum the last client agreed to, which the proxy enforces when a
    /// maximum is set (0: no client agreed to one yet).
    pub fn agreed_frame_max(&self) -> u32 {
        self.shared.agreed.load(Ordering::SeqCst)
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> u64 {
        self.shared.connections.load(Ordering::SeqCst)
    }
}

impl Drop for StreamProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Reads one frame (size prefix included); `None` at the end of the stream.
async fn read_frame(r: &mut OwnedReadHalf) -> Option<Vec<u8>> {
    let size = r.read_u32().await.ok()?;
    let mut frame = vec![0u8; 4 + size as usize];
    frame[..4].copy_from_slice(&size.to_be_bytes());
    r.read_exact(&mut frame[4..]).await.ok()?;
    Some(frame)
}

fn key(frame: &[u8]) -> u16 {
    u16::from_be_bytes([frame[4], frame[5]])
}

async fn connection(client: TcpStream, server: TcpStream, shared: Arc<Shared>) {
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (mut client_r, client_w) = client.into_split();
    let (mut server_r, mut server_w) = server.into_split();
    let (to_client, from_proxy) = mpsc::unbounded_channel::<Vec<u8>>();
    let writer = tokio::spawn(write_all(client_w, from_proxy));
    let agreed = Arc::new(AtomicU32::new(0));
    let proposed = shared.frame_max.load(Ordering::SeqCst);
    // Broker → client: the Tune proposal lowered.
    let down = {
        let to_client = to_client.clone();
        tokio::spawn(async move {
            while let Some(mut frame) = read_frame(&mut server_r).await {
                if key(&frame) == TUNE && proposed > 0 && frame.len() >= 16 {
                    let offered = u32::from_be_bytes([frame[8], frame[9], frame[10], frame[11]]);
                    let lowered = if offered == 0 {
                        proposed
                    } else {
                        offered.min(proposed)
                    };
                    frame[8..12].copy_from_slice(&lowered.to_be_bytes());
                }
                if to_client.send(frame).is_err() {
                    return;
                }
            }
        })
    };
    // Client → broker: the agreed maximum enforced, refusals injected.
    let mut held_error: Option<Vec<u8>> = None;
    while let Some(frame) = read_frame(&mut client_r).await {
        let k = key(&frame);
        // The client's answer to the broker's Tune (sent with or without the response
        // bit, depending on the client).
        if k & !RESPONSE == TUNE && frame.len() >= 12 {
            let value = u32::from_be_bytes([frame[8], frame[9], frame[10], frame[11]]);
            agreed.store(value, Ordering::SeqCst);
            shared.agreed.store(value, Ordering::SeqCst);
        }
        let limit = agreed.load(Ordering::SeqCst);
        if proposed > 0 && limit > 0 && frame.len() as u64 > u64::from(limit) {
            shared.oversized.fetch_add(1, Ordering::SeqCst);
            break;
        }
        if k == PUBLISH {
            let mode = shared.refuse.swap(REFUSE_NONE, Ordering::SeqCst);
            if mode == REFUSE_CUT {
                shared.refused_frames.fetch_add(1, Ordering::SeqCst);
                let _ = to_client.send(publish_error(&frame));
                // Let the error reach the client before the connection ends.
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                break;
            }
            if mode == REFUSE_PASS {
                shared.refused_frames.fetch_add(1, Ordering::SeqCst);
                held_error = Some(publish_error(&frame));
                continue;
            }
        }
        if server_w.write_all(&frame).await.is_err() {
            break;
        }
        if k == PUBLISH {
            if let Some(error) = held_error.take() {
                // The error goes out once a later frame is on its way to the broker,
                // and late enough for the broker to have stored it: "refused, but a
                // later one stored", whatever the client's timing.
                let to_client = to_client.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                    let _ = to_client.send(error);
                });
            }
        }
    }
    down.abort();
    drop(to_client);
    writer.abort();
}

async fn write_all(mut w: OwnedWriteHalf, mut frames: mpsc::UnboundedReceiver<Vec<u8>>) {
    while let Some(frame) = frames.recv().await {
        if w.write_all(&frame).await.is_err() {
            return;
        }
    }
}

/// A `PublishError` for every publishing id of a `Publish` frame (protocol v1:
/// publisher id, count, then per message its id, its length and its bytes).
fn publish_error(publish: &[u8]) -> Vec<u8> {
    let publisher_id = publish[8];
    let count = u32::from_be_bytes([publish[9], publish[10], publish[11], publish[12]]);
    let mut ids = Vec::new();
    let mut at = 13;
    for _ in 0..count {
        if at + 12 > publish.len() {
            break;
        }
        let id = u64::from_be_bytes(publish[at..at + 8].try_into().unwrap_or([0; 8]));
        let len = u32::from_be_bytes(publish[at + 8..at + 12].try_into().unwrap_or([0; 4]));
        ids.push(id);
        at += 12 + len as usize;
    }
    let mut body = Vec::new();
    body.extend_from_slice(&PUBLISH_ERROR.to_be_bytes());
    body.extend_from_slice(&1u16.to_be_bytes());
    body.push(publisher_id);
    body.extend_from_slice(&(ids.len() as u32).to_be_bytes());
    for id in ids {
        body.extend_from_slice(&id.to_be_bytes());
        body.extend_from_slice(&ACCESS_REFUSED.to_be_bytes());
    }
    let mut frame = (body.len() as u32).to_be_bytes().to_vec();
    frame.extend_from_slice(&body);
    frame
}
