//! A TCP proxy for fault tests: put it between the relay and Postgres or RabbitMQ,
//! then cut every connection (as a network failure or a dead peer would), stall them
//! (stop forwarding without closing, as a black-holed network would), and restore.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

const UP: u8 = 0;
const CUT: u8 = 1;
const STALLED: u8 = 2;

/// A running proxy to `target`; stops when dropped.
pub struct Proxy {
    addr: SocketAddr,
    state: Arc<AtomicU8>,
    changes: watch::Sender<u8>,
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    /// Listens on an ephemeral port of 127.0.0.1 and forwards to `target`.
    pub async fn start(target: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().expect("proxy address");
        let state = Arc::new(AtomicU8::new(UP));
        let (changes, _) = watch::channel(UP);
        let task = {
            let state = state.clone();
            let changes = changes.clone();
            tokio::spawn(async move {
                loop {
                    let Ok((client, _)) = listener.accept().await else {
                        continue;
                    };
                    if state.load(Ordering::SeqCst) == CUT {
                        drop(client);
                        continue;
                    }
                    let state = state.clone();
                    let rx = changes.subscribe();
                    tokio::spawn(async move {
                        if let Ok(server) = TcpStream::connect(target).await {
                            pipe(client, server, state, rx).await;
                        }
                    });
                }
            })
        };
        Proxy {
            addr,
            state,
            changes,
            task,
        }
    }

    /// The proxy's address (connect here instead of the target).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The port of [`Proxy::addr`].
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// Closes every open connection and refuses new ones until [`Proxy::restore`].
    pub fn cut(&self) {
        self.set(CUT);
    }

    /// Stops forwarding bytes on every connection (new ones too) without closing
    /// anything, until [`Proxy::restore`].
    pub fn stall(&self) {
        self.set(STALLED);
    }

    /// Back to forwarding.
    pub fn restore(&self) {
        self.set(UP);
    }

    fn set(&self, s: u8) {
        self.state.store(s, Ordering::SeqCst);
        let _ = self.changes.send(s);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.set(CUT);
        self.task.abort();
    }
}

async fn pipe(client: TcpStream, server: TcpStream, state: Arc<AtomicU8>, rx: watch::Receiver<u8>) {
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (cr, cw) = client.into_split();
    let (sr, sw) = server.into_split();
    let a = tokio::spawn(copy(cr, sw, state.clone(), rx.clone()));
    let b = tokio::spawn(copy(sr, cw, state, rx));
    let _ = a.await;
    let _ = b.await;
}

/// Waits while the proxy is stalled. False when it is cut (or dropped).
async fn wait_until_up(state: &AtomicU8, rx: &mut watch::Receiver<u8>) -> bool {
    loop {
        match state.load(Ordering::SeqCst) {
            CUT => return false,
            STALLED => {
                if tokio::time::timeout(Duration::from_millis(200), rx.changed())
                    .await
                    .is_ok_and(|r| r.is_err())
                {
                    return false;
                }
            }
            _ => return true,
        }
    }
}

/// Copies until EOF or a cut; while stalled, holds the data read so far.
async fn copy(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    state: Arc<AtomicU8>,
    mut rx: watch::Receiver<u8>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        // Wait while stalled; stop on a cut.
        if !wait_until_up(&state, &mut rx).await {
            return;
        }
        let n = tokio::select! {
            r = from.read(&mut buf) => match r {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            },
            _ = rx.changed() => continue,
        };
        // Data read just before a stall is held until the stall ends.
        if !wait_until_up(&state, &mut rx).await {
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn echo_server() -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                tokio::spawn(async move {
                    let mut b = [0u8; 1024];
                    while let Ok(n) = s.read(&mut b).await {
                        if n == 0 || s.write_all(&b[..n]).await.is_err() {
                            break;
                        }
                    }
                });
            }
        });
        addr
    }

    async fn roundtrip(s: &mut TcpStream, msg: &[u8]) -> Option<Vec<u8>> {
        s.write_all(msg).await.ok()?;
        let mut b = vec![0u8; msg.len()];
        tokio::time::timeout(Duration::from_millis(500), s.read_exact(&mut b))
            .await
            .ok()?
            .ok()?;
        Some(b)
    }

    #[tokio::test]
    async fn forwards_stalls_and_cuts() {
        let proxy = Proxy::start(echo_server().await).await;
        let mut s = TcpStream::connect(proxy.addr()).await.unwrap();
        assert_eq!(roundtrip(&mut s, b"hello").await.unwrap(), b"hello");

        proxy.stall();
        assert!(roundtrip(&mut s, b"stalled").await.is_none());
        proxy.restore();
        // The stalled bytes arrive after the stall.
        let mut b = vec![0u8; 7];
        tokio::time::timeout(Duration::from_secs(2), s.read_exact(&mut b))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(b, b"stalled");

        proxy.cut();
        let mut b = [0u8; 1];
        let r = tokio::time::timeout(Duration::from_secs(2), s.read(&mut b))
            .await
            .unwrap();
        assert!(matches!(r, Ok(0) | Err(_)), "connection closed by the cut");
        // Refused (closed at once) while cut; accepted again after restore.
        let mut s2 = TcpStream::connect(proxy.addr()).await.unwrap();
        assert!(roundtrip(&mut s2, b"x").await.is_none());
        proxy.restore();
        let mut s3 = TcpStream::connect(proxy.addr()).await.unwrap();
        assert_eq!(roundtrip(&mut s3, b"back").await.unwrap(), b"back");
    }
}
