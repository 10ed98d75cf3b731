//! What the broker does without the relay: lapin and stream-protocol baselines, and the share of publishing.

use super::*;

/// The message a raw baseline publishes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Shape {
    /// The relay's message: properties and the headers table.
    Full,
    /// The relay's properties and the headers of `[message] headers = "minimal"`
    /// (event_type, commit_lsn, tx_index).
    Minimal,
    /// The relay's properties (message id, type, content type, timestamp, app id,
    /// persistent), no headers.
    NoHeaders,
    /// The body, persistent, nothing else.
    BodyOnly,
    /// The lighter message a hand-written relay sends (issue #33): persistent,
    /// message id, type and content type, no headers (mandatory, as every shape).
    Light,
}

impl Shape {
    pub(super) fn figure(self) -> &'static str {
        match self {
            Shape::Full => "shape: full message",
            Shape::Minimal => "shape: minimal headers",
            Shape::NoHeaders => "shape: no headers",
            Shape::BodyOnly => "shape: body only",
            Shape::Light => "shape: light message",
        }
    }

    pub(super) fn conditions(self) -> &'static str {
        match self {
            Shape::Full => "the relay's properties and its 7 headers",
            Shape::Minimal => "the relay's properties and the 3 minimal headers",
            Shape::NoHeaders => "the relay's properties, no headers",
            Shape::BodyOnly => "body and delivery mode 2 only",
            Shape::Light => "persistent, mandatory, message_id, type and content_type, no headers",
        }
    }
}

/// `lapin` and `lapin-light`: the broker's limit for the relay's message, and for the
/// lighter message a hand-written relay sends (issue #33): persistent, mandatory,
/// message_id, type and content_type, no headers.
pub(super) async fn lapin_scenarios(args: &Args, report: &mut Report) {
    for (scenario, shape, name, what) in [
        ("lapin", Shape::Full, LAPIN, "the relay's message"),
        (
            "lapin-light",
            Shape::Light,
            LAPIN_LIGHT,
            Shape::Light.conditions(),
        ),
    ] {
        if !wants(args, scenario) {
            continue;
        }
        report.expect(&[name]);
        match lapin_runs(args, 1, shape).await {
            Ok(rates) => report.add(
                name,
                median(rates),
                "msgs/s",
                format!(
                    "N={}, window={}, {what}, until the consumer has all",
                    args.events, args.window
                ),
            ),
            Err(e) => report.fail(scenario, &e),
        }
    }
}

/// `shape`: what the message's shape costs the broker: the relay's full message, the
/// same with the minimal headers, without the headers table, and the body with
/// delivery mode alone. The shapes alternate within each run so that noise hits all
/// alike.
pub(super) async fn shape_scenario(args: &Args, report: &mut Report) {
    if !wants(args, "shape") {
        return;
    }
    let shapes = [
        Shape::Full,
        Shape::Minimal,
        Shape::NoHeaders,
        Shape::BodyOnly,
    ];
    for shape in shapes {
        report.expect(&[shape.figure()]);
    }
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); shapes.len()];
    let result: anyhow::Result<()> = async {
        for _ in 0..args.runs {
            for (k, shape) in shapes.iter().enumerate() {
                rates[k].push(lapin_baseline(args, 1, *shape).await?);
            }
        }
        Ok(())
    }
    .await;
    match result {
        Ok(()) => {
            for (shape, r) in shapes.iter().zip(rates) {
                report.add(
                    shape.figure(),
                    median(r),
                    "msgs/s",
                    format!(
                        "N={}, window={}, {}, until the consumer has all",
                        args.events,
                        args.window,
                        shape.conditions()
                    ),
                );
            }
        }
        Err(e) => report.fail("shape", &e),
    }
}

/// `channels`: would publishing over several channels (e.g. partitioned by
/// aggregate_id) raise the total? Same messages, one queue, the window split between
/// them.
pub(super) async fn channels_scenario(args: &Args, report: &mut Report) {
    if !wants(args, "channels") {
        return;
    }
    for channels in [2usize, 4] {
        let name = format!("lapin raw publisher, {channels} channels");
        report.expect(&[&name]);
        match lapin_runs(args, channels, Shape::Full).await {
            Ok(rates) => report.add(
                name,
                median(rates),
                "msgs/s",
                format!(
                    "N={}, window={} in total, one queue",
                    args.events, args.window
                ),
            ),
            Err(e) => report.fail(format!("channels ({channels})"), &e),
        }
    }
}

/// `stream-raw`: a named producer on the stream protocol, until a consumer has all and
/// until the broker confirmed all.
pub(super) async fn stream_raw_scenario(args: &Args, report: &mut Report) {
    if !wants(args, "stream-raw") {
        return;
    }
    report.expect(&[
        "stream raw publisher",
        "stream raw publisher: all confirmed",
    ]);
    let (mut consumed, mut confirmed) = (Vec::new(), Vec::new());
    let result: anyhow::Result<()> = async {
        for _ in 0..args.runs {
            let r = stream_baseline(args).await?;
            consumed.push(r.consumed);
            confirmed.push(r.confirmed);
        }
        Ok(())
    }
    .await;
    match result {
        Ok(()) => {
            let cond = format!(
                "N={}, window={}, frames ≤ {STREAM_BATCH} msgs, named producer",
                args.events, args.window
            );
            report.add(
                "stream raw publisher",
                median(consumed),
                "msgs/s",
                format!("{cond}, until a consumer from the first offset has all"),
            );
            report.add(
                "stream raw publisher: all confirmed",
                median(confirmed),
                "msgs/s",
                format!("{cond}, until the broker confirmed all"),
            );
        }
        Err(e) => report.fail("stream-raw", &e),
    }
}

pub(super) async fn lapin_baseline(
    args: &Args,
    channels: usize,
    shape: Shape,
) -> anyhow::Result<f64> {
    let (n, window) = (args.events, args.window);
    let sink = Sink::new(false).await?;
    let conn = Connection::connect(&testkit::amqp_url(), ConnectionProperties::default()).await?;
    let start = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..channels {
        let ch = conn.create_channel().await?;
        ch.confirm_select(ConfirmSelectOptions::default()).await?;
        let exchange = sink.exchange.clone();
        let share = n / channels + usize::from(c < n % channels);
        tasks.push(tokio::spawn(publish_share(
            ch,
            exchange,
            share,
            c * n,
            window / channels,
            shape,
        )));
    }
    for t in tasks {
        t.await??;
    }
    let end = sink.wait_for(n, wait(args)).await?;
    let rate = n as f64 / (end - start).as_secs_f64();
    let _ = conn.close(200, "done".into()).await;
    sink.cleanup().await;
    Ok(rate)
}

/// The body of every baseline message: the relay's (the payload's jsonb text).
pub(super) fn bench_body() -> String {
    format!(
        "{{\"n\": 1, \"pad\": \"{}\", \"customer\": \"c-1\"}}",
        "x".repeat(240)
    )
}

pub(super) struct StreamBaseline {
    /// Messages/s until the consumer held all.
    pub(super) consumed: f64,
    /// Messages/s until the broker confirmed all.
    pub(super) confirmed: f64,
}

/// A raw stream publisher into a fresh stream, read by a consumer from the first
/// offset.
pub(super) async fn stream_baseline(args: &Args) -> anyhow::Result<StreamBaseline> {
    let n = args.events;
    let sink = StreamSink::new().await?;
    let result = async {
        let (start, confirmed) = stream_publish(&sink.stream, n, args.window).await?;
        let end = sink.wait_for(n, wait(args)).await?;
        Ok(StreamBaseline {
            consumed: n as f64 / (end - start).as_secs_f64(),
            confirmed: n as f64 / (confirmed - start).as_secs_f64(),
        })
    }
    .await;
    sink.cleanup().await;
    result
}

/// Publishes `n` relay-shaped stream messages under a named producer with explicit
/// publishing ids 1..=n, at most `window` unconfirmed; returns when it started (after
/// connecting) and when the last confirm arrived.
pub(super) async fn stream_publish(
    stream: &str,
    n: usize,
    window: usize,
) -> anyhow::Result<(Instant, Instant)> {
    const PUBLISHER: u8 = 1;
    let window = window.max(1);
    let client = stream_client().await?;
    let (tx, mut confirms) = mpsc::unbounded_channel::<Result<usize, String>>();
    let handler = move |item: MessageResult| {
        let tx = tx.clone();
        async move {
            let event = match item {
                Some(Ok(response)) => match response.kind() {
                    ResponseKind::PublishConfirm(c) => Some(Ok(c.publishing_ids.len())),
                    ResponseKind::PublishError(e) => Some(Err(format!(
                        "the broker refused {} message(s): {:?}",
                        e.publishing_errors.len(),
                        e.publishing_errors.first().map(|p| &p.error_code)
                    ))),
                    _ => None,
                },
                Some(Err(e)) => Some(Err(e.to_string())),
                None => Some(Err("connection closed".into())),
            };
            if let Some(event) = event {
                let _ = tx.send(event);
            }
            Ok(())
        }
    };
    client.set_handler(handler).await;
    let producer = testkit::unique_name("bench-producer");
    let response = client
        .declare_publisher(PUBLISHER, Some(producer.clone()), stream)
        .await
        .context("declare the stream publisher")?;
    if !response.is_ok() {
        bail!("declaring a publisher on {stream}: {:?}", response.code());
    }
    let body = bench_body().into_bytes();
    let start = Instant::now();
    let (mut sent, mut confirmed) = (0usize, 0usize);
    while confirmed < n {
        if sent < n && sent - confirmed < window {
            let room = (n - sent).min(window - (sent - confirmed));
            let mut batch = Vec::with_capacity(room.min(STREAM_BATCH));
            let mut bytes = 0;
            while batch.len() < room.min(STREAM_BATCH) && bytes < STREAM_BATCH_BYTES {
                let id = (sent + batch.len() + 1) as u64;
                bytes += body.len() + 256;
                batch.push(stream_message(&body, &producer, id));
            }
            sent += batch.len();
            client
                .publish(PUBLISHER, batch)
                .await
                .context("publish to the stream")?;
            while let Ok(c) = confirms.try_recv() {
                confirmed += c.map_err(anyhow::Error::msg)?;
            }
            continue;
        }
        match confirms.recv().await {
            Some(c) => confirmed += c.map_err(anyhow::Error::msg)?,
            None => bail!("the stream connection closed"),
        }
    }
    let done = Instant::now();
    let _ = client.close().await;
    Ok((start, done))
}

/// One event as the relay puts it into a stream (publisher::stream::message): body,
/// message-id, content-type, creation-time and the same application properties.
pub(super) fn stream_message(body: &[u8], producer: &str, id: u64) -> Message {
    let app = Message::builder()
        .body(body.to_vec())
        .properties()
        .message_id(format!("00000000-0000-4000-8000-{id:012}"))
        .content_type("application/json")
        .creation_time(chrono::Utc::now())
        .message_builder()
        .application_properties()
        .insert("aggregate_type", "bench")
        .insert("aggregate_id", id.to_string())
        .insert("event_type", "tick")
        .insert("table", "public.outbox")
        .insert("commit_lsn", "0/16B3748")
        .insert("tx_index", SimpleValue::from(0u64))
        .insert("xid", SimpleValue::from(id))
        .insert(PRODUCER_PROPERTY, producer)
        .insert(PUBLISHING_ID_PROPERTY, SimpleValue::from(id));
    app.message_builder().publising_id(id).build()
}

/// Publishes `n` messages of `shape` on `ch`, mandatory, with a pipelined confirm
/// window.
pub(super) async fn publish_share(
    ch: lapin::Channel,
    exchange: String,
    n: usize,
    first: usize,
    window: usize,
    shape: Shape,
) -> anyhow::Result<()> {
    let body = bench_body();
    let mut confirms = Confirms::new(window);
    for i in first..first + n {
        confirms
            .push(publish_one(&ch, &exchange, i, shape, body.as_bytes()).await?)
            .await?;
    }
    confirms.finish().await
}

/// A pipelined window of publisher confirms: at most `window` unconfirmed.
pub(super) struct Confirms {
    pending: VecDeque<lapin::PublisherConfirm>,
    window: usize,
}

impl Confirms {
    pub(super) fn new(window: usize) -> Confirms {
        let window = window.max(1);
        Confirms {
            pending: VecDeque::with_capacity(window),
            window,
        }
    }

    /// Adds the confirm of a message just published; waits for the oldest while the
    /// window is full.
    pub(super) async fn push(&mut self, confirm: lapin::PublisherConfirm) -> anyhow::Result<()> {
        self.pending.push_back(confirm);
        while self.pending.len() >= self.window {
            if let Some(c) = self.pending.pop_front() {
                c.await?;
            }
        }
        Ok(())
    }

    /// Waits for every confirm still pending.
    pub(super) async fn finish(self) -> anyhow::Result<()> {
        for c in self.pending {
            c.await?;
        }
        Ok(())
    }
}

/// Publishes message `i` of `shape` with `body` on `ch` (mandatory); returns its
/// confirm, not awaited.
pub(super) async fn publish_one(
    ch: &lapin::Channel,
    exchange: &str,
    i: usize,
    shape: Shape,
    body: &[u8],
) -> anyhow::Result<lapin::PublisherConfirm> {
    Ok(ch
        .basic_publish(
            exchange.into(),
            "bench.tick".into(),
            BasicPublishOptions {
                mandatory: true,
                ..Default::default()
            },
            body,
            properties(i, shape),
        )
        .await?)
}

/// The properties (and headers) of message `i` of `shape`.
fn properties(i: usize, shape: Shape) -> BasicProperties {
    let mut headers = FieldTable::default();
    if shape == Shape::Full {
        headers.insert(
            "aggregate_type".into(),
            AMQPValue::LongString(LongString::from("bench")),
        );
        headers.insert(
            "aggregate_id".into(),
            AMQPValue::LongString(LongString::from(i.to_string())),
        );
        headers.insert(
            "outbox_table".into(),
            AMQPValue::LongString(LongString::from("public.outbox")),
        );
        headers.insert("xid".into(), AMQPValue::LongLongInt(i as i64));
    }
    headers.insert(
        "event_type".into(),
        AMQPValue::LongString(LongString::from("tick")),
    );
    headers.insert(
        "commit_lsn".into(),
        AMQPValue::LongString(LongString::from("0/16B3748")),
    );
    headers.insert("tx_index".into(), AMQPValue::LongLongInt(i as i64));
    match shape {
        Shape::BodyOnly => BasicProperties::default().with_delivery_mode(2),
        Shape::Light => BasicProperties::default()
            .with_message_id(ShortString::from(format!(
                "00000000-0000-4000-8000-{i:012}"
            )))
            .with_type("tick".into())
            .with_content_type("application/json".into())
            .with_delivery_mode(2),
        Shape::Full | Shape::Minimal | Shape::NoHeaders => {
            let props = BasicProperties::default()
                .with_message_id(ShortString::from(format!(
                    "00000000-0000-4000-8000-{i:012}"
                )))
                .with_type("tick".into())
                .with_content_type("application/json".into())
                .with_delivery_mode(2)
                .with_timestamp(1)
                .with_app_id("outbox-relay".into());
            if shape == Shape::NoHeaders {
                props
            } else {
                props.with_headers(headers)
            }
        }
    }
}

/// The raw publisher's rate in each of `args.runs` runs.
async fn lapin_runs(args: &Args, channels: usize, shape: Shape) -> anyhow::Result<Vec<f64>> {
    let mut rates = Vec::new();
    for _ in 0..args.runs {
        rates.push(lapin_baseline(args, channels, shape).await?);
    }
    Ok(rates)
}
