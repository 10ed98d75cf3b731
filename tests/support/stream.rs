//! Reading a RabbitMQ stream from its first offset, for the stream target's tests
//! (docs/streams.md): every message with its body, properties and application
//! properties as text.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use testkit::stream::Value;

pub use testkit::stream::{delete as delete_stream, stream_url};

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

    /// The publishing id the relay derives from the message's place in the WAL
    /// (docs/design.md §4): the commit LSN's low 43 bits, shifted left by 20, plus
    /// the index in the transaction.
    pub fn expected_publishing_id(&self) -> u64 {
        let (lsn, index) = self.order_key();
        ((lsn & ((1u64 << 43) - 1)) << 20) + index
    }

    /// `(commit_lsn, tx_index)`: the commit order key.
    pub fn order_key(&self) -> (u64, u64) {
        let lsn = self
            .prop("commit_lsn")
            .and_then(parse_lsn)
            .unwrap_or_else(|| panic!("no commit_lsn property: {self:?}"));
        let index = self
            .prop("tx_index")
            .and_then(|i| i.parse().ok())
            .unwrap_or_else(|| panic!("no tx_index property: {self:?}"));
        (lsn, index)
    }
}

/// `X/Y` → u64 (testkit's).
pub use testkit::parse_lsn;

fn text_of(v: &Value) -> String {
    match v {
        Value::Null => "null".to_string(),
        Value::Str(s) => s.clone(),
        Value::U64(n) => n.to_string(),
        Value::I64(n) => n.to_string(),
        Value::Bool(b) => b.to_string(),
        Value::Other(s) => s.clone(),
    }
}

async fn read_once(url: &str, stream: &str) -> Vec<StreamMsg> {
    testkit::stream::read_at(url, stream, 0)
        .await
        .into_iter()
        .map(|m| StreamMsg {
            offset: m.offset,
            props: m
                .application_properties
                .iter()
                .map(|(k, v)| (k.clone(), text_of(v)))
                .collect(),
            body: m.body,
            message_id: m.message_id,
            content_type: m.content_type,
            has_creation_time: m.creation_time_ms.is_some(),
        })
        .collect()
}

/// Reads `stream` whole from its first offset, again until at least `at_least`
/// messages are in it (or `timeout` passed), then once more after `quiet` so that
/// messages arriving late — duplicates — are seen too. In offset order.
pub async fn read_stream(
    stream: &str,
    at_least: usize,
    quiet: Duration,
    timeout: Duration,
) -> Vec<StreamMsg> {
    read_stream_at(&stream_url(), stream, at_least, quiet, timeout).await
}

/// [`read_stream`] through the node of the plain stream URL `url` (a node of the test
/// cluster).
pub async fn read_stream_at(
    url: &str,
    stream: &str,
    at_least: usize,
    quiet: Duration,
    timeout: Duration,
) -> Vec<StreamMsg> {
    let deadline = Instant::now() + timeout;
    let seen = loop {
        let got = read_once(url, stream).await;
        if got.len() >= at_least || Instant::now() >= deadline {
            break got.len();
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    tokio::time::sleep(quiet).await;
    // A read that ends early (the broker slow to deliver a chunk) returns less than
    // the stream holds: read again rather than report rows missing. Only retention
    // makes a stream shorter, and then the third read is the answer.
    let mut last = read_once(url, stream).await;
    for _ in 0..2 {
        if last.len() >= seen {
            break;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
        last = read_once(url, stream).await;
    }
    last
}

/// Whether the stream exists (its metadata names a leader).
pub async fn stream_exists(stream: &str) -> bool {
    let client = testkit::stream::client().await;
    let found = client
        .metadata(vec![stream.to_string()])
        .await
        .map(|m| {
            m.get(stream)
                .is_some_and(|s| format!("{:?}", s.response_code) == "Ok")
        })
        .unwrap_or(false);
    let _ = client.close().await;
    found
}

/// The checks of exactly once: `msgs` (a whole stream in offset order) holds every
/// The row's seq of a message of `Env::insert_seq`: its `aggregate_id` under
/// `aggregate_type = 'seq'`, or, with `[message] headers = "minimal"` (no
/// `aggregate_type` property), the body's `seq`. `None` for any other message.
pub fn seq_of(m: &StreamMsg) -> Option<u64> {
    match (m.prop("aggregate_type"), m.prop("aggregate_id")) {
        (Some("seq"), Some(id)) => Some(id.parse().unwrap_or_else(|_| panic!("seq {id:?}"))),
        (Some(_), _) => None,
        (None, _) if m.prop("event_type") == Some("tick") => {
            serde_json::from_slice::<serde_json::Value>(&m.body)
                .ok()?
                .get("seq")?
                .as_u64()
        }
        (None, _) => None,
    }
}

/// `seq` of `1..=n` exactly once under `aggregate_type = 'seq'`, nothing else, in
/// strictly increasing `(commit_lsn, tx_index)` and seq order. Returns the number of
/// duplicates (always 0 when it returns).
pub fn assert_exactly_once(msgs: &[StreamMsg], n: u64) -> usize {
    let mut seen = vec![0u32; n as usize + 1];
    let mut foreign = Vec::new();
    for m in msgs {
        match seq_of(m) {
            Some(s) => {
                let s = usize::try_from(s).unwrap();
                assert!(s >= 1 && s <= n as usize, "seq {s} out of range 1..={n}");
                seen[s] += 1;
            }
            None => foreign.push(m.clone()),
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
        let (a, b) = (seq_of(&w[0]).unwrap(), seq_of(&w[1]).unwrap());
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

/// The `aggregate_id`s (row numbers of [`crate::Env::insert_tagged`]) of the
/// messages whose `aggregate_type` is `tag`, in stream order.
pub fn tagged(msgs: &[StreamMsg], tag: &str) -> Vec<u64> {
    msgs.iter()
        .filter(|m| m.prop("aggregate_type") == Some(tag))
        .filter_map(|m| m.prop("aggregate_id")?.parse().ok())
        .collect()
}

/// Rows `from..from + n` of `tag` are each in `msgs` exactly once, in commit order
/// (their numbers increase in stream order).
pub fn assert_tag_exactly_once(msgs: &[StreamMsg], tag: &str, from: u64, n: u64) {
    let got = tagged(msgs, tag);
    let want: Vec<u64> = (from..from + n).collect();
    let missing = want.iter().filter(|w| !got.contains(w)).count();
    assert_eq!(
        missing,
        0,
        "{missing} of {n} rows of {tag} missing from the stream (got {})",
        got.len()
    );
    assert_eq!(got.len(), want.len(), "{tag}: duplicates in the stream");
    assert_eq!(got, want, "{tag}: not in commit order");
}
