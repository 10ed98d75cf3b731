//! Declares a queue bound to an exchange and prints every message that arrives: the
//! quick start's window onto what the relay publishes.
//!
//! ```text
//! cargo run -p outbox-relay --example watch_queue -- AMQP_URL EXCHANGE QUEUE COUNT TIMEOUT_SECS
//! ```
//! Exits 0 once COUNT messages arrived, 1 on timeout.

use std::time::Duration;

use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, ExchangeDeclareOptions, QueueBindOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Connection, ConnectionProperties, ExchangeKind};

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [url, exchange, queue, count, timeout] = args.as_slice() else {
        anyhow::bail!("usage: watch_queue AMQP_URL EXCHANGE QUEUE COUNT TIMEOUT_SECS");
    };
    let count: usize = count.parse()?;
    let timeout = Duration::from_secs(timeout.parse()?);
    let conn = Connection::connect(url, ConnectionProperties::default()).await?;
    let ch = conn.create_channel().await?;
    let durable = ExchangeDeclareOptions {
        durable: true,
        ..Default::default()
    };
    ch.exchange_declare(
        exchange.as_str().into(),
        ExchangeKind::Topic,
        durable,
        FieldTable::default(),
    )
    .await?;
    let qopts = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    ch.queue_declare(queue.as_str().into(), qopts, FieldTable::default())
        .await?;
    ch.queue_bind(
        queue.as_str().into(),
        exchange.as_str().into(),
        "#".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await?;
    println!("watching queue {queue} (bound to exchange {exchange} with '#')");
    let mut consumer = ch
        .basic_consume(
            queue.as_str().into(),
            "watch_queue".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let mut seen = 0;
    let deadline = tokio::time::Instant::now() + timeout;
    while seen < count {
        let Ok(Some(delivery)) = tokio::time::timeout_at(deadline, consumer.next()).await else {
            eprintln!("timed out after {timeout:?} with {seen} of {count} messages");
            std::process::exit(1);
        };
        let d = delivery?;
        let p = &d.properties;
        let header = |k: &str| {
            p.headers()
                .as_ref()
                .and_then(|h| h.inner().get(k).cloned())
                .map(|v| match v {
                    AMQPValue::LongString(s) => s.to_string(),
                    other => format!("{other:?}"),
                })
                .unwrap_or_default()
        };
        println!(
            "received routing_key={} message_id={} type={} commit_lsn={} body={}",
            d.routing_key,
            p.message_id().as_ref().map(|s| s.as_str()).unwrap_or(""),
            p.kind().as_ref().map(|s| s.as_str()).unwrap_or(""),
            header("commit_lsn"),
            String::from_utf8_lossy(&d.data)
        );
        d.ack(BasicAckOptions::default()).await?;
        seen += 1;
    }
    conn.close(200, "done".into()).await?;
    Ok(())
}
