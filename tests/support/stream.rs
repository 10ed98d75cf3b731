//! Reading a RabbitMQ stream from its first offset, for the stream target's tests
//! (docs/streams.md): every message with its body, properties and application
//! properties as text.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use rabbitmq_stream_client::types::{OffsetSpecification, SimpleValue};
use rabbitmq_stream_client::Environment;

/// The stream protocol URL of the test broker (`OUTBOX_TEST_STREAM_URL`).
pub fn stream_url() -> String {
    std::env::var("OUTBOX_TEST_STREAM_URL")
        .unwrap_or_else(|_| "rabbitmq-stream://guest:guest@127.0.0.1:5552/%2f".to_string())
}

/// One message read from a stream.
#[derive(Debug, Clone)]
pub struct StreamMsg {
    pub offset: u64,
    pub body: Vec<u8>,
    pub message_id: Option<String>,
    pub content_type: Option<String>,
    pub has_creation_time: bool,
    /// Application properties, each as text.
    pub props: BTreeMap<String, String>,
}

impl StreamMsg {
    pub fn prop(&self, key: &str) -> Option<&str> {
        self.props.get(key).map(String::as_str)
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// `(commit_lsn, tx_index)`: the commit order key.
    pub fn order_key(&self) -> (u64, u64) {
        let lsn = self
            .prop("commit_lsn")
            .and_then(parse_lsn)
            .unwrap_or_else(|| {
                panic!("no commit_lsn property: {self:?}");
            });
        let index = self
            .prop("tx_index")
            .and_then(|i| i.parse().ok())
            .unwrap_or_else(|| panic!("no tx_index property: {self:?}"));
        (lsn, index)
    }
}

/// `X/Y` → u64.
pub fn parse_lsn(s: &str) -> Option<u64> {
    let (hi, lo) = s.trim().split_once('/')?;
    Some((u64::from_str_radix(hi, 16).ok()? << 32) | u64::from_str_radix(lo, 16).ok()?)
}

fn text_of(v: &SimpleValue) -> String {
    match v {
        SimpleValue::String(s) => s.clone(),
        SimpleValue::Symbol(s) => s.to_string(),
        SimpleValue::Boolean(b) => b.to_string(),
        SimpleValue::Ubyte(n) => n.to_string(),
        SimpleValue::Ushort(n) => n.to_string(),
        SimpleValue::Uint(n) => n.to_string(),
        SimpleValue::Ulong(n) => n.to_string(),
        SimpleValue::Byte(n) => n.to_string(),
        SimpleValue::Short(n) => n.to_string(),
        SimpleValue::Int(n) => n.to_string(),
        SimpleValue::Long(n) => n.to_string(),
        SimpleValue::Binary(b) => String::from_utf8_lossy(b).into_owned(),
        other => format!("{other:?}"),
    }
}

/// The message id as text (the client does not export the id's type: its Debug form
/// `String("...")` is unwrapped).
fn id_text(id: &impl std::fmt::Debug) -> String {
    let d = format!("{id:?}");
    match d
        .strip_prefix("String(\"")
        .and_then(|r| r.strip_suffix("\")"))
    {
        Some(s) => s.to_string(),
        None => d,
    }
}

async fn environment() -> Environment {
    let url = stream_url();
    let rest = url.split_once("://").map_or(url.as_str(), |(_, r)| r);
    let (userinfo, hostpart) = rest.rsplit_once('@').unwrap_or(("guest:guest", rest));
    let (user, password) = userinfo.split_once(':').unwrap_or((userinfo, ""));
    let hostport = hostpart.split('/').next().unwrap_or("127.0.0.1:5552");
    let (host, port) = hostport.rsplit_once(':').unwrap_or((hostport, "5552"));
    Environment::builder()
        .host(host)
        .port(port.parse().unwrap_or(5552))
        .username(user)
        .password(password)
        .virtual_host("/")
        .build()
        .await
        .expect("connect to the RabbitMQ stream port")
}

/// Reads `stream` from its first offset until at least `at_least` messages were
/// read and then nothing more arrived for `quiet` (so extra messages — duplicates —
/// would be seen), or `timeout` passed. Returns every message in offset order.
pub async fn read_stream(
    stream: &str,
    at_least: usize,
    quiet: Duration,
    timeout: Duration,
) -> Vec<StreamMsg> {
    let env = environment().await;
    let mut consumer = env
        .consumer()
        .offset(OffsetSpecification::First)
        .build(stream)
        .await
        .unwrap_or_else(|e| panic!("consume stream {stream}: {e:?}"));
    let deadline = Instant::now() + timeout;
    let mut out = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        let wait = if out.len() >= at_least {
            quiet.min(left)
        } else {
            left.min(Duration::from_secs(5))
        };
        match tokio::time::timeout(wait, consumer.next()).await {
            Ok(Some(Ok(d))) => {
                let m = d.message();
                let props = m
                    .application_properties()
                    .map(|p| p.iter().map(|(k, v)| (k.clone(), text_of(v))).collect())
                    .unwrap_or_default();
                let p = m.properties();
                out.push(StreamMsg {
                    offset: d.offset(),
                    body: m.data().map(<[u8]>::to_vec).unwrap_or_default(),
                    message_id: p.and_then(|p| p.message_id.as_ref()).map(id_text),
                    content_type: p
                        .and_then(|p| p.content_type.as_ref())
                        .map(|s| s.to_string()),
                    has_creation_time: p.is_some_and(|p| p.creation_time.is_some()),
                    props,
                });
            }
            Ok(Some(Err(e))) => panic!("reading stream {stream}: {e:?}"),
            Ok(None) => break,
            Err(_) if out.len() >= at_least => break,
            Err(_) => {}
        }
    }
    let _ = consumer.handle().close().await;
    out
}

/// Deletes `stream` (best effort).
pub async fn delete_stream(stream: &str) {
    let env = environment().await;
    let _ = env.delete_stream(stream).await;
}

/// Whether the stream exists (a consumer can attach to it).
pub async fn stream_exists(stream: &str) -> bool {
    let env = environment().await;
    match env
        .consumer()
        .offset(OffsetSpecification::First)
        .build(stream)
        .await
    {
        Ok(c) => {
            let _ = c.handle().close().await;
            true
        }
        Err(_) => false,
    }
}

/// The checks of exactly once: `msgs` (a whole stream in offset order) holds every
/// `seq` of `1..=n` exactly once under `aggregate_type = 'seq'`, nothing else, in
/// strictly increasing `(commit_lsn, tx_index)` and seq order. Returns the number of
/// duplicates (always 0 when it returns).
pub fn assert_exactly_once(msgs: &[StreamMsg], n: u64) -> usize {
    let mut seen = vec![0u32; n as usize + 1];
    let mut foreign = Vec::new();
    for m in msgs {
        match (m.prop("aggregate_type"), m.prop("aggregate_id")) {
            (Some("seq"), Some(id)) => {
                let s: usize = id.parse().unwrap_or_else(|_| panic!("seq {id:?}"));
                assert!(s >= 1 && s <= n as usize, "seq {s} out of range 1..={n}");
                seen[s] += 1;
            }
            _ => foreign.push(m.clone()),
        }
    }
    assert!(
        foreign.is_empty(),
        "unexpected messages: {:?}",
        &foreign[..foreign.len().min(5)]
    );
    let duplicates: Vec<usize> = (1..=n as usize).filter(|&s| seen[s] > 1).collect();
    let missing: Vec<usize> = (1..=n as usize).filter(|&s| seen[s] == 0).collect();
    assert!(
        duplicates.is_empty() && missing.is_empty(),
        "{} messages for {n} rows: {} duplicated (first {:?}), {} missing (first {:?})",
        msgs.len(),
        duplicates.len(),
        &duplicates[..duplicates.len().min(10)],
        missing.len(),
        &missing[..missing.len().min(10)]
    );
    assert_eq!(msgs.len() as u64, n, "exactly one message per row");
    for w in msgs.windows(2) {
        assert!(
            w[0].order_key() < w[1].order_key(),
            "not in commit order at offsets {} and {}: {:?} then {:?}",
            w[0].offset,
            w[1].offset,
            w[0].props,
            w[1].props
        );
        let (a, b): (u64, u64) = (
            w[0].prop("aggregate_id").unwrap().parse().unwrap(),
            w[1].prop("aggregate_id").unwrap().parse().unwrap(),
        );
        assert_eq!(
            a + 1,
            b,
            "seq order at offsets {} and {}",
            w[0].offset,
            w[1].offset
        );
    }
    0
}
