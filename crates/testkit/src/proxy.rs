//! A TCP proxy for fault tests: put it between the relay and Postgres or RabbitMQ,
//! then cut every connection (as a network failure or a dead peer would), stall them
//! (stop forwarding without closing, as a black-holed network would), and restore.
//! It can also cut at an exact point of the stream: after a given number of bytes
//! from the target ([`Proxy::cut_after`]), e.g. in the middle of a transaction, or
//! when the client sends a given AMQP 0-9-1 method ([`Proxy::cut_at_client_method`]),
//! e.g. while an `exchange.declare` awaits its answer.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

const UP: u8 = 0;
const CUT: u8 = 1;
const STALLED: u8 = 2;
/// Only the client's bytes are held ([`Proxy::stop_reading`]).
const NOT_READING: u8 = 3;
/// Only the target's bytes are held ([`Proxy::stop_answering`]).
const NOT_ANSWERING: u8 = 4;

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
/// to cut (`u64::MAX`: nowhere); the AMQP method a client sends that cuts
/// (`class << 16 | method`, 0: none).
struct Down {
    forwarded: AtomicU64,
    cut_at: AtomicU64,
    cut_at_method: AtomicU32,
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
            cut_at_method: AtomicU32::new(0),
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

    /// Cuts (as [`Proxy::cut`]) when a client next sends an AMQP 0-9-1 method frame
    /// of `class_id`/`method_id` (e.g. 40/10, `exchange.declare`): the bytes before
    /// that frame are forwarded, the frame and everything after it are not, so the
    /// client's request is outstanding when its connection ends. Once.
    pub fn cut_at_client_method(&self, class_id: u16, method_id: u16) {
        let want = (u32::from(class_id) << 16) | u32::from(method_id);
        self.down.cut_at_method.store(want, Ordering::SeqCst);
    }

    /// True while cut (by [`Proxy::cut`] or a [`Proxy::cut_after`] or
    /// [`Proxy::cut_at_client_method`] that was reached).
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

    /// Stops forwarding the clients' bytes to the target while the target's still
    /// reach them, until [`Proxy::restore`]: a broker that stops reading its
    /// sockets but keeps sending heartbeats (as RabbitMQ does while an alarm blocks
    /// a connection), alive and answering nothing.
    pub fn stop_reading(&self) {
        self.set(NOT_READING);
    }

    /// Stops forwarding the target's bytes to the clients while the clients' still
    /// reach it, until [`Proxy::restore`]: a broker that reads every publish and
    /// confirms none (nor sends a heartbeat).
    pub fn stop_answering(&self) {
        self.set(NOT_ANSWERING);
    }

    /// Back to forwarding (and forgets a [`Proxy::cut_after`] or
    /// [`Proxy::cut_at_client_method`] not reached).
    pub fn restore(&self) {
        self.down.cut_at.store(u64::MAX, Ordering::SeqCst);
        self.down.cut_at_method.store(0, Ordering::SeqCst);
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

/// Waits while the proxy is stalled (for the client-to-target direction, `!down`,
/// also while it does not read). False when it is cut (or dropped).
async fn wait_until_up(state: &AtomicU8, rx: &mut watch::Receiver<u8>, down: bool) -> bool {
    loop {
        match state.load(Ordering::SeqCst) {
            CUT => return false,
            NOT_READING if down => return true,
            NOT_ANSWERING if !down => return true,
            STALLED | NOT_READING | NOT_ANSWERING => {
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
    let mut frames = Frames::default();
    loop {
        // Wait while stalled; stop on a cut.
        if !wait_until_up(state, &mut rx, down).await {
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
        if !wait_until_up(state, &mut rx, down).await {
            return;
        }
        let mut n = n;
        let mut reached = false;
        if !down {
            let want = link.down.cut_at_method.load(Ordering::SeqCst);
            if let Some(at) = frames.feed(&buf[..n], want) {
                link.down.cut_at_method.store(0, Ordering::SeqCst);
                n = at;
                reached = true;
            }
        }
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

/// Where the AMQP 0-9-1 frames of a client's byte stream begin: after the
/// 8-byte protocol header, each frame is type (1), channel (2), size (4), payload
/// (size), end (1); a method frame's payload begins with class (2), method (2).
#[derive(Default)]
struct Frames {
    /// Bytes of the stream seen before the current chunk.
    seen: u64,
    /// Where the next frame begins (`None`: the protocol header's end, 8).
    next: Option<u64>,
    /// Its first bytes, up to the method's ids.
    head: Vec<u8>,
}

impl Frames {
    /// Takes the next `chunk` of the stream; when a method frame of `want`
    /// (`class << 16 | method`, 0: none) begins in it or began in an earlier chunk
    /// and is completed by it, the index in `chunk` where that frame begins (0 when
    /// it began earlier).
    fn feed(&mut self, chunk: &[u8], want: u32) -> Option<usize> {
        let mut found = None;
        let mut i = 0usize;
        while i < chunk.len() {
            let at = self.seen + i as u64;
            let next = *self.next.get_or_insert(8);
            if at < next {
                i += usize::try_from(next - at)
                    .unwrap_or(usize::MAX)
                    .min(chunk.len() - i);
                continue;
            }
            self.head.push(chunk[i]);
            i += 1;
            let h = &self.head;
            let size = |h: &[u8]| u64::from(u32::from_be_bytes([h[3], h[4], h[5], h[6]]));
            let done = match h.len() {
                7 if h[0] != 1 || size(h) < 4 => true,
                11 => {
                    let method = u32::from_be_bytes([h[7], h[8], h[9], h[10]]);
                    if want != 0 && method == want && found.is_none() {
                        found = Some(usize::try_from(next.saturating_sub(self.seen)).unwrap_or(0));
                    }
                    true
                }
                _ => false,
            };
            if done {
                self.next = Some(next + 8 + size(&self.head));
                self.head.clear();
            }
        }
        self.seen += chunk.len() as u64;
        found.map(|at| at.min(chunk.len()))
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

    /// A method frame of `class`/`method` on channel 1 with `extra` payload bytes.
    fn method_frame(class: u16, method: u16, extra: usize) -> Vec<u8> {
        let size = 4 + extra as u32;
        let mut f = vec![1, 0, 1];
        f.extend_from_slice(&size.to_be_bytes());
        f.extend_from_slice(&class.to_be_bytes());
        f.extend_from_slice(&method.to_be_bytes());
        f.extend(std::iter::repeat_n(7u8, extra));
        f.push(0xCE);
        f
    }

    #[test]
    fn finds_a_method_frame_across_chunks() {
        const DECLARE: u32 = (40 << 16) | 10;
        let mut stream = b"AMQP\x00\x00\x09\x01".to_vec();
        stream.extend(method_frame(10, 11, 30)); // connection.start-ok
        stream.extend([8, 0, 0, 0, 0, 0, 0, 0xCE]); // a heartbeat
                                                    // A payload that holds the declare's bytes does not match.
        let mut body = method_frame(60, 40, 20);
        body[11..15].copy_from_slice(&[0, 40, 0, 10]);
        stream.extend(body);
        let declare_at = stream.len();
        stream.extend(method_frame(40, 10, 12));
        for split in 1..stream.len() {
            let mut frames = Frames::default();
            let (a, b) = stream.split_at(split);
            let found = match frames.feed(a, DECLARE) {
                Some(at) => Some(at),
                None => frames.feed(b, DECLARE).map(|at| at + split),
            };
            // A frame whose ids arrive in the second chunk began in the first: the
            // second chunk is cut from its start.
            let want = if split > declare_at && split < declare_at + 11 {
                split
            } else {
                declare_at
            };
            assert_eq!(found, Some(want), "split at {split}");
        }
        let mut frames = Frames::default();
        assert_eq!(frames.feed(&stream, 0), None, "nothing wanted");
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

    /// A server that sends `t` every 50 ms and reports what it receives.
    async fn ticking_server() -> (SocketAddr, tokio::sync::mpsc::UnboundedReceiver<Vec<u8>>) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            let (s, _) = l.accept().await.unwrap();
            let (mut r, mut w) = s.into_split();
            tokio::spawn(async move {
                while w.write_all(b"t").await.is_ok() {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            });
            let mut b = [0u8; 64];
            while let Ok(n) = r.read(&mut b).await {
                if n == 0 || tx.send(b[..n].to_vec()).is_err() {
                    break;
                }
            }
        });
        (addr, rx)
    }

    #[tokio::test]
    async fn a_target_that_stops_reading_still_sends() {
        let (target, mut received) = ticking_server().await;
        let proxy = Proxy::start(target).await;
        let mut s = TcpStream::connect(proxy.addr()).await.unwrap();
        proxy.stop_reading();
        s.write_all(b"hello").await.unwrap();
        let mut b = [0u8; 1];
        for _ in 0..3 {
            let n = tokio::time::timeout(Duration::from_secs(2), s.read(&mut b))
                .await
                .unwrap()
                .unwrap();
            assert_eq!(&b[..n], b"t", "the target's bytes still arrive");
        }
        assert!(
            tokio::time::timeout(Duration::from_millis(300), received.recv())
                .await
                .is_err(),
            "the client's bytes are held"
        );
        proxy.restore();
        let got = tokio::time::timeout(Duration::from_secs(2), received.recv())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(got, b"hello", "and forwarded once it reads again");
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
