//! The cluster: its script, the nodes' URLs, restoring it, and which node the relay
//! is connected to.
use super::*;

pub(crate) fn script() -> PathBuf {
    std::env::var("OUTBOX_TEST_CLUSTER_SCRIPT")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            PathBuf::from(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../scripts/rabbitmq-cluster.sh"
            ))
        })
}

pub(crate) fn urls(var: &str, scheme: &str, port: u16) -> Vec<String> {
    match std::env::var(var) {
        Ok(v) if !v.trim().is_empty() => v.split(',').map(str::to_string).collect(),
        _ => (1..=3)
            .map(|n| format!("{scheme}://guest:guest@10.77.0.1{n}:{port}/%2f"))
            .collect(),
    }
}

pub(crate) fn amqp_urls() -> Vec<String> {
    urls("OUTBOX_TEST_CLUSTER_AMQP_URLS", "amqp", 5672)
}

pub(crate) fn stream_urls() -> Vec<String> {
    urls("OUTBOX_TEST_CLUSTER_STREAM_URLS", "rabbitmq-stream", 5552)
}

/// Runs `scripts/rabbitmq-cluster.sh ARGS` (off the async workers); its stdout.
pub(crate) async fn cluster(args: &[&str]) -> String {
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    tokio::task::spawn_blocking(move || {
        let out = Command::new("bash")
            .arg(script())
            .args(&args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "rabbitmq-cluster.sh {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    })
    .await
    .unwrap()
}

/// Puts the cluster back as the tests need it when dropped: every node resumed, every
/// partition healed, every node started and joined (the script's `start` is
/// idempotent). Taken at the start of each test, so a test that fails half-way (or a
/// test process killed outright, at the next test's start) leaves nothing broken.
pub(crate) struct Restore;

impl Restore {
    pub(crate) async fn take() -> Restore {
        let r = Restore;
        tokio::task::spawn_blocking(restore).await.unwrap();
        r
    }
}

pub(crate) fn restore() {
    let run = |args: &[&str]| {
        Command::new("bash")
            .arg(script())
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
    };
    for n in ["1", "2", "3"] {
        let _ = run(&["resume", n]);
    }
    let _ = run(&["heal"]);
    let ok = run(&["start"]).is_ok_and(|s| s.success());
    assert!(
        ok,
        "the test cluster does not start: see `scripts/rabbitmq-cluster.sh start`"
    );
}

impl Drop for Restore {
    fn drop(&mut self) {
        // Even while unwinding from a failed assertion: never panic here.
        let _ = std::panic::catch_unwind(restore);
    }
}

/// The node (1–3) that holds the relay's established connection to `port`. Only
/// established ones: a connection to a node that died can linger in CLOSE-WAIT.
pub(crate) fn connected_node(pid: u32, port: u16) -> Option<u8> {
    let out = Command::new("ss")
        .args(["-tnpH", "state", "established"])
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let pid = format!("pid={pid},");
    for line in text.lines().filter(|l| l.contains(&pid)) {
        for token in line.split_whitespace() {
            for n in 1..=3u8 {
                if token == format!("10.77.0.1{n}:{port}") {
                    return Some(n);
                }
            }
        }
    }
    None
}

/// The end of a relay's log, for a failure message.
pub(crate) fn tail(log: &str) -> &str {
    let mut start = log.len().saturating_sub(6000);
    while !log.is_char_boundary(start) {
        start += 1;
    }
    &log[start..]
}

pub(crate) async fn wait_connected(relay: &Relay, port: u16) -> u8 {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(n) = connected_node(relay.pid(), port) {
            return n;
        }
        assert!(
            Instant::now() < deadline,
            "the relay is connected to no node: {}",
            tail(&relay.log_text())
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// An AMQP connection to the first node that answers.
pub(crate) async fn amqp_any() -> Connection {
    amqp_at(&[0, 1, 2]).await
}

/// An AMQP connection to the first node of `order` (indexes into the URLs) that answers.
pub(crate) async fn amqp_at(order: &[usize]) -> Connection {
    let urls = amqp_urls();
    for url in order.iter().map(|&i| &urls[i]) {
        if let Ok(Ok(c)) = tokio::time::timeout(
            Duration::from_secs(5),
            Connection::connect(url, ConnectionProperties::default()),
        )
        .await
        {
            return c;
        }
    }
    panic!("no node of the test cluster answers (scripts/rabbitmq-cluster.sh status)");
}
