//! A TCP proxy for fault tests: put it between the relay and Postgres or RabbitMQ,
//! then cut every connection (as a network failure or a dead peer would), stall them
//! (stop forwarding without closing, as a black-holed network would), and restore.
//! It can also cut at an exact point of the stream: after a given number of bytes
//! from the target ([`Proxy::cut_after`]), e.g. in the middle of a transaction.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
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
    /// Where new connections go ([`Proxy::redirect`]).
    target: Arc<std::sync::Mutex<SocketAddr>>,
    state: Arc<AtomicU8>,
    changes: watch::Sender<u8>,
    task: tokio::task::JoinHandle<()>,
    down: Arc<Down>,
}

/// Bytes forwarded from the target to clients, over every connection, and where
/// to cut (`u64::MAX`: nowhere).
struct Down {
    forwarded: AtomicU64,
    cut_at: AtomicU64,
}

impl Proxy {
    /// Listens on an ephemeral port of 127.0.0.1 and forwards to `target`.
    pub async fn start(target: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().expect("proxy address");
        let state = Arc::new(AtomicU8::new(UP));
        let (changes, _) = watch::channel(UP);
        let down = Arc::new(Down {
            forwarded: AtomicU64::new(0),
            cut_at: AtomicU64::new(u64::MAX),
        });
        let target = Arc::new(std::sync::Mutex::new(target));
        let task = {
            let state = state.clone();
            let changes = changes.clone();
            let down = down.clone();
            let target = target.clone();
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
                    let link = Link {
                        state,
                        changes: changes.clone(),
                        down: down.clone(),
                    };
                    let to = *target.lock().expect("proxy target");
                    tokio::spawn(async move {
                        if let Ok(server) = TcpStream::connect(to).await {
                            pipe(client, server, link, rx).await;
                        }
                    });
                }
            })
        };
        Proxy {
            addr,
            target,
            state,
            changes,
            task,
            down,
        }
    }

    /// Bytes forwarded from the target to clients so far, over every connection.
    pub fn forwarded_from_target(&self) -> u64 {
        self.down.forwarded.load(Ordering::SeqCst)
    }

    /// Cuts (as [`Proxy::cut`]) once `more` further bytes have been forwarded from
    /// the target: exactly that many, the rest of the read is dropped.
    pub fn cut_after(&self, more: u64) {
        let at = self.forwarded_from_target() + more;
        self.down.cut_at.store(at, Ordering::SeqCst);
    }

    /// True while cut (by [`Proxy::cut`] or a [`Proxy::cut_after`] that was reached).
    pub fn is_cut(&self) -> bool {
        self.state.load(Ordering::SeqCst) == CUT
    }

    /// The proxy's address (connect here instead of the target).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The port of [`Proxy::addr`].
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// Sends new connections to `target` instead (open ones stay where they are:
    /// [`Proxy::cut`] and [`Proxy::restore`] end them), as a DNS change or a man in
    /// the middle would.
    pub fn redirect(&self, target: SocketAddr) {
        *self.target.lock().expect("proxy target") = target;
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

    /// Back to forwarding (and forgets a [`Proxy::cut_after`] not reached).
    pub fn restore(&self) {
        self.down.cut_at.store(u64::MAX, Ordering::SeqCst);
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

/// What one connection's copies share with the proxy.
#[derive(Clone)]
struct Link {
    state: Arc<AtomicU8>,
    changes: watch::Sender<u8>,
    down: Arc<Down>,
}

async fn pipe(client: TcpStream, server: TcpStream, link: Link, rx: watch::Receiver<u8>) {
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (cr, cw) = client.into_split();
    let (sr, sw) = server.into_split();
    let a = tokio::spawn(copy(cr, sw, link.clone(), rx.clone(), false));
    let b = tokio::spawn(copy(sr, cw, link, rx, true));
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

/// Copies until EOF or a cut; while stalled, holds the data read so far. `down`:
/// this is the target-to-client direction (counted, and cut by `cut_after`).
async fn copy(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    link: Link,
    mut rx: watch::Receiver<u8>,
    down: bool,
) {
    let state = &link.state;
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        // Wait while stalled; stop on a cut.
        if !wait_until_up(state, &mut rx).await {
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
        if !wait_until_up(state, &mut rx).await {
            return;
        }
        let mut n = n;
        let mut reached = false;
        if down {
            let d = &link.down;
            let before = d.forwarded.fetch_add(n as u64, Ordering::SeqCst);
            let at = d.cut_at.load(Ordering::SeqCst);
            if before + n as u64 >= at {
                n = at.saturating_sub(before) as usize;
                d.forwarded.store(at, Ordering::SeqCst);
                reached = true;
            }
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
        if reached {
            let _ = to.flush().await;
            state.store(CUT, Ordering::SeqCst);
            let _ = link.changes.send(CUT);
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
    async fn cuts_after_an_exact_number_of_bytes_from_the_target() {
        let proxy = Proxy::start(echo_server().await).await;
        let mut s = TcpStream::connect(proxy.addr()).await.unwrap();
        assert_eq!(roundtrip(&mut s, b"abc").await.unwrap(), b"abc");
        assert_eq!(proxy.forwarded_from_target(), 3);
        proxy.cut_after(5);
        s.write_all(b"hello world").await.unwrap();
        let mut got = Vec::new();
        tokio::time::timeout(Duration::from_secs(2), s.read_to_end(&mut got))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(got, b"hello", "exactly 5 bytes, then closed");
        assert!(proxy.is_cut());
        proxy.restore();
        let mut s2 = TcpStream::connect(proxy.addr()).await.unwrap();
        assert_eq!(roundtrip(&mut s2, b"again").await.unwrap(), b"again");
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
