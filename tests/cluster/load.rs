//! The load (rows in transactions of mixed sizes), the slot's position over time, and
//! the stream's stored publishing ids sampled beside it.
use super::*;

/// Rows `1..` (aggregate_id = seq) in transactions of pseudo-random sizes (a third
/// single rows, the rest 2 … 200), until stopped; each transaction guarded by its
/// first seq, so a retry after an unknown outcome cannot insert it twice.
pub(crate) struct Loader {
    pub(crate) stop: Arc<AtomicBool>,
    pub(crate) done: Arc<AtomicU64>,
    pub(crate) task: Option<tokio::task::JoinHandle<u64>>,
}

impl Loader {
    pub(crate) fn start(db: &TestDb) -> Loader {
        let stop = Arc::new(AtomicBool::new(false));
        let done = Arc::new(AtomicU64::new(0));
        let (port, name) = (db.port, db.name.clone());
        let (s, d) = (stop.clone(), done.clone());
        let task = tokio::task::spawn_blocking(move || {
            let mut x: u64 = 0x9E37_79B9_7F4A_7C15 ^ harness::rand_below(u64::MAX);
            let mut i = 1;
            while !s.load(Ordering::SeqCst) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let size = if x % 3 == 0 { 1 } else { 2 + (x >> 8) % 199 };
                let end = i + size - 1;
                let sql = format!(
                    "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
                     SELECT 'seq', s.n::text, 'tick', jsonb_build_object('seq', s.n)
                       FROM generate_series({i}, {end}) AS s(n)
                      WHERE NOT EXISTS (SELECT 1 FROM outbox WHERE aggregate_type = 'seq' AND aggregate_id = '{i}')
                      ORDER BY s.n"
                );
                while !try_psql(port, &name, &sql) {
                    std::thread::sleep(Duration::from_millis(200));
                }
                d.store(end, Ordering::SeqCst);
                i = end + 1;
                std::thread::sleep(Duration::from_millis(25));
            }
            i - 1
        });
        Loader {
            stop,
            done,
            task: Some(task),
        }
    }

    pub(crate) async fn wait_more(&self, rows: u64) {
        let target = self.done.load(Ordering::SeqCst) + rows;
        while self.done.load(Ordering::SeqCst) < target {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Stops and returns the last seq committed.
    pub(crate) async fn finish(mut self) -> u64 {
        self.stop.store(true, Ordering::SeqCst);
        self.task.take().unwrap().await.unwrap()
    }
}

/// A failed test must not leave the loader running: the runtime waits for its
/// blocking thread when it shuts down, and the next test would never start.
impl Drop for Loader {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// The slot's `confirmed_flush_lsn`, polled every 100 ms, with the time it was read.
pub(crate) struct Watch {
    pub(crate) points: Arc<Mutex<Vec<(Instant, u64)>>>,
    pub(crate) task: tokio::task::JoinHandle<()>,
}

impl Watch {
    pub(crate) fn start(conninfo: String, slot: String) -> Watch {
        let points = Arc::new(Mutex::new(Vec::new()));
        let out = points.clone();
        let task = tokio::spawn(async move {
            let (client, conn) = tokio_postgres::connect(&conninfo, tokio_postgres::NoTls)
                .await
                .unwrap();
            tokio::spawn(async move {
                let _ = conn.await;
            });
            loop {
                if let Ok(Some(row)) = client
                    .query_opt(
                        "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
                        &[&slot],
                    )
                    .await
                {
                    if let Some(lsn) = row.get::<_, Option<String>>(0).and_then(|s| parse_lsn(&s)) {
                        out.lock().unwrap().push((Instant::now(), lsn));
                    }
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
        Watch { points, task }
    }

    pub(crate) fn now(&self) -> u64 {
        self.points.lock().unwrap().last().map_or(0, |p| p.1)
    }

    /// The longest time between two advances of the position from `from` on: how long
    /// publishing paused (the load never stops, so a healthy relay moves it every few
    /// hundred ms).
    pub(crate) fn longest_stall(&self, from: Instant) -> Duration {
        let points = self.points.lock().unwrap();
        let mut last_move: Option<(Instant, u64)> = None;
        let mut longest = Duration::ZERO;
        for &(at, lsn) in points.iter() {
            match last_move {
                None => {
                    if at >= from {
                        last_move = Some((at, lsn));
                    }
                }
                Some((t, l)) if lsn != l => {
                    longest = longest.max(at - t);
                    last_move = Some((at, lsn));
                }
                Some(_) => {}
            }
        }
        longest
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// For the stream: samples the slot's confirmed position and, right after, the broker's
/// last stored publishing id of the relay's producer. A message below the sampled
/// position must have an id at or below the one the broker reported stored just after:
/// the relay may confirm only what the stream's majority stored.
pub(crate) struct StreamSampler {
    pub(crate) samples: Arc<Mutex<Vec<(u64, u64)>>>,
    pub(crate) task: tokio::task::JoinHandle<()>,
}

impl StreamSampler {
    pub(crate) fn start(
        conninfo: String,
        slot: String,
        stream: String,
        producer: String,
    ) -> StreamSampler {
        let samples = Arc::new(Mutex::new(Vec::new()));
        let out = samples.clone();
        let task = tokio::spawn(async move {
            let (pg, conn) = tokio_postgres::connect(&conninfo, tokio_postgres::NoTls)
                .await
                .unwrap();
            tokio::spawn(async move {
                let _ = conn.await;
            });
            let urls = stream_urls();
            let mut attempt = 0usize;
            let mut client: Option<testkit::stream::Client> = None;
            loop {
                tokio::time::sleep(Duration::from_millis(250)).await;
                let Ok(Some(row)) = pg
                    .query_opt(
                        "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
                        &[&slot],
                    )
                    .await
                else {
                    continue;
                };
                let Some(lsn) = row.get::<_, Option<String>>(0).and_then(|s| parse_lsn(&s)) else {
                    continue;
                };
                if client.is_none() {
                    let url = &urls[attempt % urls.len()];
                    attempt += 1;
                    client = testkit::stream::try_client_at(url, Duration::from_secs(3)).await;
                }
                let Some(c) = &client else { continue };
                match tokio::time::timeout(
                    Duration::from_secs(3),
                    c.query_publisher_sequence(&producer, &stream),
                )
                .await
                {
                    Ok(Ok(stored)) => out.lock().unwrap().push((lsn, stored)),
                    _ => client = None,
                }
            }
        });
        StreamSampler { samples, task }
    }

    pub(crate) fn samples(&self) -> Vec<(u64, u64)> {
        self.samples.lock().unwrap().clone()
    }
}

impl Drop for StreamSampler {
    fn drop(&mut self) {
        self.task.abort();
    }
}
