//! A deterministic simulation of the connection against a scripted broker on a
//! real socket, over thousands of seeded random schedules (issue 40, "Tests at
//! the level of the risk"). Invariants are checked after every step; a failing
//! seed prints a one-line reproduction.
//!
//! Each schedule makes a Unix socket pair with small kernel buffers (so writes and
//! reads are partial), puts the production [`Connection`] on one end and the
//! scripted broker (`sim/broker.rs`, frames encoded with the connection's own
//! codec) on the other, and drives both from one seeded RNG in one task of a
//! current-thread runtime with paused time: the client is polled with a counting
//! waker, the broker does non-blocking reads and writes, and `yield_now` lets the
//! runtime's reactor see the socket between steps. Apart from the kernel's
//! buffering a schedule is deterministic.
//!
//! What happens: the handshake (the broker's half: start, sometimes
//! `connection.secure`, tune with a random `frame_max` of 4,096..=131,072, a
//! heartbeat of 0 or 1..=4 s and a random `channel_max`, open-ok), `open_channel`,
//! then random steps: the client publishes (bodies from empty to several frames,
//! now and then 1.5 MB; properties with headers; now and then a header that
//! cannot fit a frame), the broker reads a random number of bytes or stops reading
//! for a while, writes what it queued in random pieces, acks and nacks (single, out
//! of order, `multiple` for a run), returns messages (method, header and body
//! frames of random sizes, always before the confirm), blocks and unblocks,
//! closes the channel (the client answers close-ok and opens the next one: tags
//! restart at 1) or the connection, confirms a tag never published, hangs up, or
//! goes silent; the client closes its channel or the connection, declares
//! exchanges on the control channel, and both sides close at once (channel and
//! connection); paused time moves on, with or without the broker's heartbeats.
//!
//! Checked after every step (`sim/model.rs`, `sim/checks.rs`):
//! (a) every confirm handed out names a tag published on the current channel, is
//! its first, and is what the broker sent (ack or nack); the broker checks every
//! publish it reads byte for byte against what the client published, and every
//! frame against `frame_max`;
//! (b) every return is handed out complete (properties intact) and before the
//! confirm of its message; blocked/unblocked and channel closes in the order sent;
//! (c) memory stays bounded: the bytes not written are at most what was encoded
//! and not read by the broker, the read buffer at most one frame (or its initial
//! size), and once everything is written the write buffer's capacity is back to
//! at most 1 MiB;
//! (d) the client never panics; the end of the connection (the broker's close,
//! a protocol error of the broker, a hang-up, two silent heartbeat intervals) is
//! reported once, with the right reason, and then nothing; no silence is reported
//! too early, and a connection with nothing waiting sends heartbeats in time.
//! When everything sent was read (now and then, and at the end), nothing the broker
//! sent is lost, the connection does not wake itself with nothing to do (a spin),
//! and it is woken when bytes arrive.
//!
//! `cargo test` runs 2000 schedules. Run longer with
//! `OUTBOX_SIM_SCHEDULES=100000 cargo test -p publisher --release connection::sim`;
//! replay one with `OUTBOX_SIM_SEED=<seed>`. Test code only (`#[cfg(test)]`).

mod broker;
mod checks;
mod model;
mod steps;

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use amq_protocol::uri::AMQPUri;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::time::Instant;

use super::{ConnError, Connection};
use broker::Broker;
use model::{Gen, Model};

/// Counts the client's wake-ups.
struct Wakes(AtomicUsize);

impl Wake for Wakes {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// A request of the connection, driven while the broker serves it.
#[derive(Debug, Clone, Copy)]
enum Req {
    Handshake,
    Open,
    CloseChannel,
    Declare { passive: bool },
    Close,
}

type Request<'a> = Pin<Box<dyn Future<Output = Result<(), ConnError>> + 'a>>;

struct Sim {
    rng: StdRng,
    conn: Connection,
    broker: Broker,
    model: Model,
    wakes: Arc<Wakes>,
    waker: Waker,
    /// Bytes of the publishes encoded, and the largest message.
    encoded: usize,
    largest: usize,
    /// Requests made and heartbeat periods: an allowance for the client's frames
    /// other than publishes.
    control: usize,
    /// When the client was first polled after the broker last wrote (when it
    /// last read).
    fed_at: Instant,
}

impl Sim {
    fn new(seed: u64) -> Sim {
        let mut rng = StdRng::seed_from_u64(seed);
        let (ours, theirs) = std::os::unix::net::UnixStream::pair().expect("socket pair");
        for sock in [&ours, &theirs] {
            sock.set_nonblocking(true).expect("non-blocking");
            let size = [4096, 8192, 16384, 65536][rng.gen_range(0..4)];
            let sock = socket2::SockRef::from(sock);
            sock.set_send_buffer_size(size).expect("SO_SNDBUF");
            sock.set_recv_buffer_size(size).expect("SO_RCVBUF");
        }
        let client = tokio::net::UnixStream::from_std(ours).expect("into tokio");
        let broker = Broker::new(theirs, &mut rng);
        let wakes = Arc::new(Wakes(AtomicUsize::new(0)));
        Sim {
            rng,
            conn: {
                let mut conn = Connection::new(Box::new(client), 0);
                // The request deadline is the publisher simulation's to check
                // (`amqp/run/sim.rs`); here silences are only heartbeats'.
                conn.request_timeout = std::time::Duration::from_secs(86_400);
                conn
            },
            broker,
            model: Model::default(),
            waker: Waker::from(wakes.clone()),
            wakes,
            encoded: 0,
            largest: 0,
            control: 0,
            fed_at: Instant::now(),
        }
    }

    fn wakes(&self) -> usize {
        self.wakes.0.load(Ordering::SeqCst)
    }

    /// Runs a request of the client to its end while the broker serves it (and
    /// now and then does something of its own meanwhile).
    async fn request(&mut self, req: Req) -> Result<(), ConnError> {
        self.control += 1;
        if matches!(req, Req::Open) {
            self.model.gens.push(Gen::default());
        }
        let uri: AMQPUri = "amqp://guest:guest@localhost/%2f".parse().expect("uri");
        let Sim {
            conn,
            broker,
            model,
            rng,
            waker,
            fed_at,
            ..
        } = self;
        let mut fut: Request<'_> = match req {
            Req::Handshake => Box::pin(conn.handshake_on(&uri)),
            Req::Open => Box::pin(conn.open_channel()),
            Req::CloseChannel => Box::pin(conn.close_channel()),
            Req::Declare { passive } => Box::pin(conn.declare_exchange(
                "sim.exchange",
                "topic",
                if passive {
                    super::Declare::Passive
                } else {
                    super::Declare::Active
                },
            )),
            Req::Close => Box::pin(async {
                conn.close().await;
                Ok(())
            }),
        };
        trace(|| format!("client: {req:?}"));
        let mut cx = Context::from_waker(waker);
        for _ in 0..100_000 {
            if std::mem::take(&mut broker.wrote) {
                *fed_at = Instant::now();
            }
            if let Poll::Ready(result) = fut.as_mut().poll(&mut cx) {
                trace(|| format!("client: {req:?} -> {result:?}"));
                return result;
            }
            broker.turns += 1;
            let n = read_size(rng);
            broker.read(n, model, rng);
            // Meanwhile (once the connection is open) the broker does its own things.
            let roll = if matches!(req, Req::Handshake) {
                1000
            } else {
                rng.gen_range(0..1000)
            };
            match roll {
                0..=39 => broker.confirm(model, rng),
                40..=44 => broker.toggle_blocked(model),
                45..=49 => broker.close_channel(model),
                50 => broker.close(model),
                51..=59 => broker.paused_until = broker.turns + rng.gen_range(1..20),
                _ => {}
            }
            let n = read_size(rng);
            broker.write(n);
            tokio::task::yield_now().await;
        }
        panic!("the request {req:?} never finished");
    }

    /// One schedule: handshake, a channel, random steps, then everything read.
    async fn run(mut self) {
        self.request(Req::Handshake).await.expect("the handshake");
        assert_eq!(self.conn.frame_max(), self.broker.frame_max);
        self.fed_at = Instant::now();
        self.open().await;
        let steps = self.rng.gen_range(30..200);
        let mut after_end = 0;
        for _ in 0..steps {
            self.step().await;
            self.check();
            if !self.conn.is_alive() {
                after_end += 1;
                if after_end > 6 {
                    break;
                }
            }
        }
        self.settle().await;
        if self.conn.is_alive() && self.rng.gen_bool(0.5) {
            self.client_close().await;
        }
        self.after_the_end().await;
    }

    /// Opens the next publishing channel.
    async fn open(&mut self) {
        let r = self.request(Req::Open).await;
        self.request_result(Req::Open, r);
    }
}

/// With `OUTBOX_SIM_TRACE` set, prints what happens (for a replayed seed).
fn trace(what: impl FnOnce() -> String) {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if *ON.get_or_init(|| std::env::var_os("OUTBOX_SIM_TRACE").is_some()) {
        let mut line = what();
        outbox_event::redact::truncate_at_char(&mut line, 240);
        eprintln!("{line}");
    }
}

/// How many bytes a read or write of the broker takes at most.
fn read_size(rng: &mut StdRng) -> usize {
    match rng.gen_range(0..4) {
        0 => rng.gen_range(1..64),
        1 => rng.gen_range(64..4096),
        2 => rng.gen_range(4096..65536),
        _ => usize::MAX,
    }
}

fn run_schedule(seed: u64) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .expect("runtime");
    runtime.block_on(async move { Sim::new(seed).run().await });
}

/// Runs the schedules (or the one of `OUTBOX_SIM_SEED`): `testkit::sim`.
fn run_schedules(test: &str, base: u64, default: u64) {
    let path = format!("amqp::connection::sim::{test}");
    testkit::sim::Schedules {
        test_path: &path,
        krate: "publisher",
        base,
        default,
        run: &|seed, _| run_schedule(seed),
        steps: None,
    }
    .run();
}

#[test]
fn the_connection_against_a_scripted_broker() {
    run_schedules("the_connection_against_a_scripted_broker", 0xc0_0000, 2000);
}

/// Schedules that found a defect, run whatever `OUTBOX_SIM_SCHEDULES` says (seeds of
/// this version of the simulation: a change to it changes what a seed does).
#[test]
fn regressions() {
    // `channel.close` in the same read as `confirm.select-ok`: `open_channel`
    // answered close-ok yet said the channel was open, and the relay published on
    // a channel the broker had closed.
    run_schedule(0xc0_005b);
    // The broker's close in the same read as the control channel's open-ok: the
    // declaration after it returned the end without marking it reported, and
    // `poll_io` reported it a second time.
    run_schedule(0xc0_00fb);
    // A confirm of a tag never published, read while the relay's own
    // `connection.close` waited for close-ok: the relay sent a second close (406)
    // instead of discarding the frame.
    run_schedule(0xc0_0550);
}
