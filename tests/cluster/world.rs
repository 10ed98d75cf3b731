//! One test's world: a database, the queue or stream, the consumer and samplers, and
//! the relay's configuration.
use super::*;

pub(crate) struct World {
    pub(crate) target: Target,
    pub(crate) db: TestDb,
    pub(crate) slot: String,
    pub(crate) publication: String,
    pub(crate) exchange: String,
    /// The quorum queue, or the stream.
    pub(crate) queue: String,
    pub(crate) dir: PathBuf,
    pub(crate) consumer: Option<Consumer>,
    pub(crate) sampler: Option<Sampler>,
    pub(crate) stream_sampler: Option<StreamSampler>,
    pub(crate) watch: Option<Watch>,
}

impl World {
    pub(crate) async fn new(target: Target) -> World {
        bin();
        let db = TestDb::new("cluster");
        db.psql(OUTBOX_DDL);
        // Declared through node 3, the queue's or stream's leader starts there (the
        // default leader locator is the declaring client's node), while the relay
        // connects to node 1 first (URLs in order): the first faults then hit a node
        // that is connected but not the leader, and a leader the relay is not
        // connected to.
        let conn = amqp_at(&[2, 0, 1]).await;
        let ch = conn.create_channel().await.unwrap();
        let exchange = unique_name("cex");
        let queue = unique_name(match target {
            Target::QuorumQueue => "quorum",
            Target::Stream => "cstream",
        });
        let durable = QueueDeclareOptions {
            durable: true,
            ..Default::default()
        };
        let mut args = FieldTable::default();
        match target {
            Target::QuorumQueue => {
                ch.exchange_declare(
                    exchange.as_str().into(),
                    ExchangeKind::Topic,
                    ExchangeDeclareOptions {
                        durable: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                )
                .await
                .unwrap();
                args.insert(
                    "x-queue-type".into(),
                    AMQPValue::LongString("quorum".into()),
                );
                args.insert("x-quorum-initial-group-size".into(), AMQPValue::LongInt(3));
                ch.queue_declare(queue.as_str().into(), durable, args)
                    .await
                    .unwrap();
                ch.queue_bind(
                    queue.as_str().into(),
                    exchange.as_str().into(),
                    "#".into(),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await
                .unwrap();
            }
            Target::Stream => {
                args.insert(
                    "x-queue-type".into(),
                    AMQPValue::LongString("stream".into()),
                );
                args.insert("x-initial-cluster-size".into(), AMQPValue::LongInt(3));
                ch.queue_declare(queue.as_str().into(), durable, args)
                    .await
                    .unwrap();
            }
        }
        let _ = conn.close(0, "".into()).await;
        let dir = std::env::temp_dir().join(unique_name("cluster"));
        std::fs::create_dir_all(&dir).unwrap();
        let mut w = World {
            target,
            db,
            slot: unique_name("slot"),
            publication: unique_name("pub"),
            exchange,
            queue,
            dir,
            consumer: None,
            sampler: None,
            stream_sampler: None,
            watch: None,
        };
        let out = Command::new(bin())
            .arg("--config")
            .arg(w.config())
            .args(["slot", "create"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "slot create: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        match target {
            Target::QuorumQueue => {
                w.consumer = Some(Consumer::start_on(w.queue.clone(), amqp_urls()));
                w.sampler = Some(Sampler::start_on(
                    w.db.conninfo(),
                    w.slot.clone(),
                    w.queue.clone(),
                    amqp_urls(),
                ));
            }
            Target::Stream => {
                let system_id =
                    w.db.psql("SELECT system_identifier FROM pg_control_system()");
                let producer = format!(
                    "outbox-relay/{}/{}/{}/tl1",
                    system_id.trim(),
                    w.db.name,
                    w.slot
                );
                w.stream_sampler = Some(StreamSampler::start(
                    w.db.conninfo(),
                    w.slot.clone(),
                    w.queue.clone(),
                    producer,
                ));
            }
        }
        w.watch = Some(Watch::start(w.db.conninfo(), w.slot.clone()));
        w
    }

    /// The relay's config: every node's URL, a short heartbeat.
    pub(crate) fn config(&self) -> PathBuf {
        let pg = format!(
            "postgresql://postgres@127.0.0.1:{}/{}?connect_timeout=5",
            self.db.port, self.db.name
        );
        let target = match self.target {
            Target::QuorumQueue => String::new(),
            Target::Stream => format!(
                "stream = {:?}\nstream_url = {:?}\ndeclare_stream = false\n",
                self.queue,
                stream_urls()
            ),
        };
        let toml = format!(
            "[postgres]\nurl = {pg:?}\nslot = {:?}\npublication = {:?}\ntables = [\"public.outbox\"]\n\n\
             [rabbitmq]\nurl = {:?}\nexchange = {:?}\nmax_in_flight = {MAX_IN_FLIGHT}\n\
             heartbeat_secs = {HEARTBEAT_SECS}\n{target}\n\
             [relay]\nstatus_interval_ms = 200\nmetrics_listen = \"\"\nshutdown_timeout_ms = 10000\n",
            self.slot,
            self.publication,
            amqp_urls(),
            self.exchange,
        );
        let path = self.dir.join("outbox-relay.toml");
        testkit::write_atomic(&path, &toml);
        path
    }

    pub(crate) fn start(&self) -> Relay {
        let log = self.dir.join(format!("{}.log", unique_name("relay")));
        let child = Command::new(bin())
            .arg("--config")
            .arg(self.config())
            .arg("run")
            .current_dir(&self.dir)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        Relay { child, log }
    }

    pub(crate) fn port(&self) -> u16 {
        match self.target {
            Target::QuorumQueue => 5672,
            Target::Stream => 5552,
        }
    }

    pub(crate) async fn sql(&self, sql: &str) -> String {
        let (port, name, sql) = (self.db.port, self.db.name.clone(), sql.to_string());
        tokio::task::spawn_blocking(move || testkit::psql_at(port, &name, &sql))
            .await
            .unwrap()
    }

    /// Waits until the slot confirmed everything committed before this call.
    pub(crate) async fn wait_caught_up(&self, relay: &Relay) {
        let target = parse_lsn(&self.sql("SELECT pg_current_wal_lsn()").await).unwrap();
        // The longest fault (a 20 s partition) costs well under this.
        let deadline = Instant::now() + Duration::from_secs(120);
        while self.watch.as_ref().unwrap().now() < target {
            assert!(
                Instant::now() < deadline,
                "the relay did not confirm everything: {}",
                tail(&relay.log_text())
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Queue: waits until the consumer received every row committed so far; the
    /// duplicates it has seen.
    pub(crate) async fn queue_duplicates(&self) -> usize {
        let c = self.consumer.as_ref().unwrap();
        let expected: usize = self
            .sql("SELECT count(*) FROM outbox")
            .await
            .parse()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(120);
        while c.distinct() < expected {
            assert!(
                Instant::now() < deadline,
                "{} of {expected} rows arrived",
                c.distinct()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        c.total() - c.distinct()
    }

    pub(crate) async fn leader(&self) -> u8 {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(Ok(out)) = tokio::task::spawn_blocking({
                let q = self.queue.clone();
                move || {
                    Command::new("bash")
                        .arg(script())
                        .args(["leader", &q])
                        .output()
                }
            })
            .await
            {
                if let Ok(n) = String::from_utf8_lossy(&out.stdout).trim().parse() {
                    return n;
                }
            }
            assert!(Instant::now() < deadline, "no leader of {}", self.queue);
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    pub(crate) async fn cleanup(mut self) {
        if let Some(c) = self.consumer.take() {
            c.stop();
        }
        if let Some(s) = self.sampler.take() {
            s.stop();
        }
        self.stream_sampler.take();
        self.watch.take();
        let conn = amqp_any().await;
        if let Ok(ch) = conn.create_channel().await {
            let _ = ch
                .queue_delete(self.queue.as_str().into(), QueueDeleteOptions::default())
                .await;
            let _ = ch
                .exchange_delete(self.exchange.as_str().into(), Default::default())
                .await;
        }
        let _ = conn.close(0, "".into()).await;
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
