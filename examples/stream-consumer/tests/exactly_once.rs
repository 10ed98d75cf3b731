//! The stream consumer under crashes, against the real RabbitMQ (stream protocol) and
//! the test Postgres cluster: every message of the stream must be applied exactly
//! once, in stream order, and the stored offset must end at the stream's last offset.
//! size: the SIGKILL test is one scenario: each round resumes from the offset the last one stored
//!
//! Why these tests would catch a consumer that is not exactly once: `stream_effects`
//! has no unique key, so a message applied twice is a second row, and the tests
//! compare the whole table, row by row in insertion order, with the whole stream read
//! back from its first offset — a duplicate, a gap or a reordering fails them, and so
//! does a stored offset that is not the stream's last. The kills land at random
//! points (a fresh seed per run, printed), so a consumer that committed the effects
//! and the offset separately would fail whenever a kill fell between the two; the
//! server-offsets test makes that window deterministic with the `--exit-after-commit`
//! hook and shows the duplicates the lighter mode produces by design. (Checked while
//! developing: a consumer that resumed at the stored offset instead of one after it,
//! without the `offset > last_offset` guard, failed
//! `aborted_runs_and_concurrent_instances_apply_each_message_once` with 4,249 effects
//! for 2,500 messages.)
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::{Output, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rabbitmq_stream_client::types::{Message, SimpleValue};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use stream_consumer::{connect_postgres, init_schema, run, Config, Endpoint, Stats, Tracking};
use testkit::stream::{StreamMessage, TestStream};
use testkit::TestDb;

/// Bound on waiting for progress and for a run to end (never reached when things work).
const PATIENCE: Duration = Duration::from_secs(120);

fn rng() -> StdRng {
    let seed: u64 = rand::random();
    eprintln!("random seed: {seed}");
    StdRng::seed_from_u64(seed)
}

/// The consumer's stored offset for `stream` (`None`: no row or no offset yet).
fn stored(db: &TestDb, consumer: &str, stream: &str) -> Option<u64> {
    if db.psql("SELECT to_regclass('stream_offsets') IS NULL") == "t" {
        return None; // before the first run's --init
    }
    let out = db.psql(&format!(
        "SELECT last_offset FROM stream_offsets WHERE consumer = '{consumer}' AND stream = '{stream}'"
    ));
    out.trim().parse().ok()
}

/// Waits until the stored offset reaches `offset`, polling with a client of its own
/// (quick, so that the kill lands close to the chosen point); panics after
/// [`PATIENCE`] or when `alive` says the consumer is gone. Returns the offset seen.
async fn wait_for_offset(
    db: &TestDb,
    consumer: &str,
    stream: &str,
    offset: u64,
    mut alive: impl FnMut() -> bool,
) -> u64 {
    let client = db.client().await;
    let deadline = Instant::now() + PATIENCE;
    loop {
        // An error: the first run has not created the table yet.
        let at: Option<i64> = client
            .query_opt(
                "SELECT last_offset FROM stream_offsets WHERE consumer = $1 AND stream = $2",
                &[&consumer, &stream],
            )
            .await
            .ok()
            .flatten()
            .and_then(|row| row.get(0));
        if let Some(at) = at {
            if at as u64 >= offset {
                return at as u64;
            }
        }
        assert!(
            alive(),
            "the consumer ended before reaching offset {offset}"
        );
        assert!(
            Instant::now() < deadline,
            "the consumer did not reach offset {offset} in {PATIENCE:?} (at {at:?})"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// `(stream_offset, message_id, aggregate_id)` of every effect of `consumer`, in the
/// order they were inserted.
fn effects(db: &TestDb, consumer: &str) -> Vec<(u64, String, String)> {
    db.psql(&format!(
        "SELECT stream_offset, message_id, aggregate_id FROM stream_effects \
         WHERE consumer = '{consumer}' ORDER BY id"
    ))
    .lines()
    .filter(|l| !l.is_empty())
    .map(|l| {
        let mut f = l.split('|');
        (
            f.next().unwrap().parse().unwrap(),
            f.next().unwrap().to_string(),
            f.next().unwrap().to_string(),
        )
    })
    .collect()
}

/// The whole stream as `(offset, message_id, aggregate_id)`.
fn expected(msgs: &[StreamMessage]) -> Vec<(u64, String, String)> {
    msgs.iter()
        .map(|m| {
            (
                m.offset,
                m.message_id.clone().expect("message_id"),
                m.text("aggregate_id").expect("aggregate_id").to_string(),
            )
        })
        .collect()
}

/// Every message of `msgs` (the whole stream) applied exactly once, in stream order,
/// nothing else applied, and the stored offset at the last message.
fn assert_exactly_once(db: &TestDb, consumer: &str, stream: &str, msgs: &[StreamMessage]) {
    let want = expected(msgs);
    let got = effects(db, consumer);
    if got != want {
        let mut counts = std::collections::BTreeMap::<u64, usize>::new();
        for (offset, _, _) in &got {
            *counts.entry(*offset).or_default() += 1;
        }
        let twice: Vec<_> = counts
            .iter()
            .filter(|(_, n)| **n > 1)
            .map(|(o, _)| *o)
            .collect();
        let missing: Vec<_> = want
            .iter()
            .map(|w| w.0)
            .filter(|o| !counts.contains_key(o))
            .collect();
        panic!(
            "{} effects for {} messages: {} offsets applied more than once (first {:?}), \
             {} missing (first {:?}), or out of order",
            got.len(),
            want.len(),
            twice.len(),
            &twice[..twice.len().min(10)],
            missing.len(),
            &missing[..missing.len().min(10)],
        );
    }
    assert_eq!(
        stored(db, consumer, stream),
        msgs.last().map(|m| m.offset),
        "stored offset"
    );
}

/// The stream's messages in the relay's shape, seq `from..from + n`, published
/// directly with the stream client (waiting for every confirm).
async fn publish(stream: &str, from: u64, n: u64) {
    let endpoint = Endpoint::parse(&testkit::stream::stream_url()).unwrap();
    let environment = endpoint.environment(None).await.unwrap();
    let producer = environment.producer().build(stream).await.unwrap();
    let messages: Vec<Message> = (from..from + n)
        .map(|seq| {
            Message::builder()
                .body(format!(r#"{{"seq": {seq}}}"#).into_bytes())
                .properties()
                .message_id(format!("m-{seq}"))
                .content_type("application/json")
                .message_builder()
                .application_properties()
                .insert("aggregate_type", "seq")
                .insert("aggregate_id", seq.to_string())
                .insert("event_type", "tick")
                .insert("table", "public.outbox")
                .insert("commit_lsn", format!("0/{:X}", 0x1000 + seq))
                .insert("tx_index", SimpleValue::from(0u64))
                .insert("xid", SimpleValue::from(700 + seq))
                .message_builder()
                .build()
        })
        .collect();
    for chunk in messages.chunks(200) {
        let confirms = producer
            .batch_send_with_confirm(chunk.to_vec())
            .await
            .unwrap();
        assert!(
            confirms.iter().all(|c| c.confirmed()),
            "a publish was refused"
        );
    }
    producer.close().await.unwrap();
}

/// Reads the whole stream, waiting (bounded) until it holds `n` messages.
async fn read_whole(stream: &str, n: usize) -> Vec<StreamMessage> {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let msgs = testkit::stream::read(stream, 0).await;
        if msgs.len() >= n || Instant::now() >= deadline {
            assert_eq!(msgs.len(), n, "messages in stream {stream}");
            return msgs;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

fn config(db: &TestDb, stream: &str, consumer: &str, batch_size: usize) -> Config {
    Config {
        stream_url: testkit::stream::stream_url(),
        ca_file: None,
        stream: stream.to_string(),
        postgres_url: db.url(),
        consumer_name: consumer.to_string(),
        tracking: Tracking::Database,
        batch_size,
        init: false,
        exit_after_commit: None,
        exit_when_idle: None,
    }
}

/// The `key=value` of the summary line the binary prints to stdout.
fn summary(stdout: &str, key: &str) -> String {
    let line = stdout
        .lines()
        .find(|l| l.starts_with("stream-consumer:"))
        .unwrap_or_else(|| panic!("no summary line in {stdout:?}"));
    line.split_whitespace()
        .find_map(|kv| kv.strip_prefix(&format!("{key}=")))
        .unwrap_or_else(|| panic!("no {key} in {line:?}"))
        .to_string()
}

fn binary(args: &[String]) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_stream-consumer"));
    cmd.args(args)
        .env("RUST_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    cmd
}

/// Runs the binary until it exits (bounded).
async fn run_binary(args: &[String]) -> Output {
    let child = binary(args).output();
    tokio::time::timeout(PATIENCE, child)
        .await
        .expect("stream-consumer exits in time")
        .expect("stream-consumer starts")
}

fn common_args(db: &TestDb, stream: &str, consumer: &str) -> Vec<String> {
    vec![
        "--stream-url".into(),
        testkit::stream::stream_url(),
        "--stream".into(),
        stream.into(),
        "--postgres-url".into(),
        db.url(),
        "--consumer-name".into(),
        consumer.into(),
    ]
}

/// End to end: the real relay publishes outbox rows (1,000 at a time, in transactions
/// of 1 to 60 rows, more whenever the consumer is close to the end) into a fresh stream while the real consumer binary reads it
/// and is killed with SIGKILL at six random points, with a different batch size each
/// run; a last run until the stream is idle. The consumer's database holds every
/// message's effect exactly once, in stream order, and the stream's last offset.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_stream_applied_exactly_once_across_sigkills() {
    let env = support::Env::new().await;
    let stream = testkit::unique_name("sc_e2e");
    let vars = [
        ("OUTBOX_RELAY_RABBITMQ_STREAM", stream.as_str()),
        (
            "OUTBOX_RELAY_RABBITMQ_STREAM_URL",
            &testkit::stream::stream_url(),
        ),
    ];
    let vars: Vec<(&str, &str)> = vars.iter().map(|(k, v)| (*k, *v)).collect();
    env.create_slot();
    let db = TestDb::new("sc_e2e");
    let consumer = "billing";
    let mut rng = rng();

    // Rows seq 1..=n in transactions of random sizes.
    let mut next_seq = 1usize;
    let mut insert = |rng: &mut StdRng, n: usize| {
        let end = next_seq + n;
        while next_seq < end {
            let size = rng.gen_range(1..=60).min(end - next_seq);
            env.insert_seq(next_seq, size, size);
            next_seq += size;
        }
    };
    const PHASE: usize = 1000;
    insert(&mut rng, PHASE);
    let mut published = PHASE as u64;
    let relay = env.start_env(&[], &vars);
    let deadline = Instant::now() + PATIENCE;
    while !support::stream::stream_exists(&stream).await {
        assert!(Instant::now() < deadline, "the relay declared the stream");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let common = common_args(&db, &stream, consumer);
    let batch_sizes = [1usize, 100, 7, 500, 32, 3];
    for (round, batch) in batch_sizes.into_iter().enumerate() {
        let applied = stored(&db, consumer, &stream).map_or(0, |o| o + 1);
        if published - applied < 300 {
            // More rows, arriving while the consumer is being killed and restarted.
            insert(&mut rng, PHASE);
            published += PHASE as u64;
        }
        let room = published - applied;
        // Kill once the stored offset passed a random point ahead.
        let target = applied + rng.gen_range(1..room.min(300));
        let mut args = common.clone();
        args.extend(["--batch-size".into(), batch.to_string()]);
        if round == 0 {
            args.push("--init".into());
        }
        let mut child = binary(&args).spawn().unwrap();
        let reached = wait_for_offset(&db, consumer, &stream, target - 1, || {
            child.try_wait().unwrap().is_none()
        })
        .await;
        child.start_kill().unwrap();
        let out = child.wait_with_output().await.unwrap();
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&out.status),
            Some(9),
            "round {round}: killed by SIGKILL: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let after = stored(&db, consumer, &stream).unwrap();
        eprintln!(
            "round {round}: batch {batch}, target offset {}, stored {reached} when seen, \
             {after} after the kill",
            target - 1
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        if round > 0 {
            assert!(
                stderr.contains(&format!("stored_offset={}", applied - 1)),
                "round {round} resumes after offset {}: {stderr}",
                applied - 1
            );
        }
        assert!(!stderr.contains("guest:guest"), "password logged: {stderr}");
        assert!(
            !stderr.contains("removed by the stream's retention"),
            "round {round}: the first message after a restart is the stored offset + 1: {stderr}"
        );
    }

    // Everything is in the stream: one last run until idle.
    let msgs = read_whole(&stream, published as usize).await;
    let before = stored(&db, consumer, &stream).unwrap();
    let mut args = common.clone();
    args.extend(["--exit-when-idle-ms".into(), "3000".into()]);
    let out = run_binary(&args).await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        summary(&stdout, "applied"),
        (published - 1 - before).to_string(),
        "{stdout}"
    );
    assert_eq!(summary(&stdout, "skipped"), "0", "{stdout}");
    assert_eq!(
        summary(&stdout, "last_offset"),
        msgs.last().unwrap().offset.to_string()
    );

    assert_exactly_once(&db, consumer, &stream, &msgs);
    // And the messages are the outbox rows, seq 1, 2, … in commit order.
    let seqs: Vec<u64> = effects(&db, consumer)
        .iter()
        .map(|e| e.2.parse().unwrap())
        .collect();
    assert_eq!(seqs, (1..=published).collect::<Vec<_>>());

    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    support::stream::delete_stream(&stream).await;
    env.cleanup().await;
}

/// The library's loop aborted (its task dropped mid-transaction) at five random
/// points, then two instances of the same consumer running at once: each message is
/// still applied exactly once, in stream order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aborted_runs_and_concurrent_instances_apply_each_message_once() {
    let db = TestDb::new("sc_abort");
    init_schema(&connect_postgres(&db.url()).await.unwrap())
        .await
        .unwrap();
    let stream = TestStream::create("sc_abort").await;
    let consumer = "projection";
    let mut rng = rng();
    publish(&stream.name, 1, 2000).await;

    for round in 0..5 {
        let applied = stored(&db, consumer, &stream.name).map_or(0, |o| o + 1);
        let target = applied + rng.gen_range(1..300);
        let batch = [1usize, 50, 5, 200, 13][round];
        let config = config(&db, &stream.name, consumer, batch);
        let task = tokio::spawn(async move {
            run(&config, Arc::new(Stats::default()), std::future::pending()).await
        });
        wait_for_offset(&db, consumer, &stream.name, target - 1, || {
            !task.is_finished()
        })
        .await;
        task.abort();
        let end = task.await;
        assert!(end.as_ref().is_err_and(|e| e.is_cancelled()), "{end:?}");
    }

    // More messages, and two instances at once until the stream is idle.
    publish(&stream.name, 2001, 500).await;
    let msgs = read_whole(&stream.name, 2500).await;
    let mut a = config(&db, &stream.name, consumer, 1);
    a.exit_when_idle = Some(Duration::from_secs(3));
    let mut b = config(&db, &stream.name, consumer, 64);
    b.exit_when_idle = Some(Duration::from_secs(3));
    let (sa, sb) = (Arc::new(Stats::default()), Arc::new(Stats::default()));
    let (ra, rb) = tokio::time::timeout(
        PATIENCE,
        futures_util::future::join(
            run(&a, sa.clone(), std::future::pending()),
            run(&b, sb.clone(), std::future::pending()),
        ),
    )
    .await
    .expect("both instances end once the stream is idle");
    ra.unwrap();
    rb.unwrap();
    eprintln!("instance a: {sa}; instance b: {sb}");
    assert_exactly_once(&db, consumer, &stream.name, &msgs);
    stream.delete().await;
}

/// `--offsets server`: the offset stored on the broker after the commit. A crash
/// between the two (the `--exit-after-commit` hook) applies the messages after the
/// last stored offset again: at least once, as documented. The restart still resumes
/// after the stored offset, not from the start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_side_offsets_resume_but_repeat_after_a_crash() {
    let db = TestDb::new("sc_server");
    let stream = TestStream::create("sc_server").await;
    publish(&stream.name, 1, 300).await;
    let msgs = read_whole(&stream.name, 300).await;
    let consumer = testkit::unique_name("srv");
    let mut common = common_args(&db, &stream.name, &consumer);
    common.extend([
        "--offsets".into(),
        "server".into(),
        "--batch-size".into(),
        "10".into(),
    ]);

    let mut args = common.clone();
    args.extend(["--init".into(), "--exit-after-commit".into(), "105".into()]);
    let out = run_binary(&args).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "the hook exits 1: {stderr}");
    assert!(stderr.contains("exit-after-commit"), "{stderr}");
    assert!(stderr.contains("no stored offset"), "{stderr}");
    let first_run = effects(&db, &consumer).len() as u64;
    assert!(first_run >= 105, "{first_run} applied before the crash");

    let mut args = common.clone();
    args.extend(["--exit-when-idle-ms".into(), "3000".into()]);
    let out = run_binary(&args).await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}{stderr}");
    // Where the broker said the first run had got to.
    let resumed: u64 = stderr
        .split("stored_offset=")
        .nth(1)
        .and_then(|r| r.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("the second run resumes after a stored offset: {stderr}"));
    assert!(resumed + 1 < first_run, "the last batch was never stored");
    let applied: u64 = summary(&stdout, "applied").parse().unwrap();
    assert_eq!(applied, 300 - (resumed + 1), "{stdout}");

    // Every message at least once; exactly those after the stored offset that the
    // first run had applied are there twice.
    let got = effects(&db, &consumer);
    assert_eq!(got.len() as u64, first_run + applied);
    let mut counts = vec![0usize; 300];
    for (offset, _, _) in &got {
        counts[*offset as usize] += 1;
    }
    for (offset, n) in counts.iter().enumerate() {
        let want = if (offset as u64) > resumed && (offset as u64) < first_run {
            2
        } else {
            1
        };
        assert_eq!(*n, want, "applications of offset {offset}");
    }
    assert_eq!(msgs.last().unwrap().offset, 299);
    stream.delete().await;
}

/// Bad setup fails at once with one sentence naming the fix, and no password.
#[tokio::test]
async fn setup_errors_name_the_fix() {
    let db = TestDb::new("sc_errors");
    let stream = TestStream::create("sc_errors").await;

    // Tables missing and no --init.
    let out = run_binary(&common_args(&db, &stream.name, "c")).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("table stream_offsets does not exist") && stderr.contains("--init"),
        "{stderr}"
    );

    // A stream that does not exist.
    let mut args = common_args(&db, "sc_no_such_stream", "c");
    args.push("--init".into());
    let out = run_binary(&args).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("stream \"sc_no_such_stream\" does not exist; check --stream"),
        "{stderr}"
    );

    // Wrong credentials: named, password hidden.
    let mut args = common_args(&db, &stream.name, "c");
    args[1] = "rabbitmq-stream://guest:wrong-secret@127.0.0.1:5552/%2f".into();
    let out = run_binary(&args).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("check --stream-url"), "{stderr}");
    assert!(!stderr.contains("wrong-secret"), "{stderr}");
    stream.delete().await;
}
