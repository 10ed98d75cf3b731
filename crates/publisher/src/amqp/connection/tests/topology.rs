//! The declarations of `[topology]` (issue #43, part 3) against the scripted
//! broker: `queue.declare` active and passive, `queue.bind`, `exchange.bind` and
//! `exchange.declare` with flags and arguments all go on the control channel (1)
//! with every field as configured; a 406 PRECONDITION_FAILED closes the control
//! channel, its text reaches the caller, and the next request opens the channel
//! again while the publishing channel stays open.

use amq_protocol::protocol::{channel, exchange, queue, AMQPClass};
use amq_protocol::types::{AMQPValue, FieldTable, LongString, ShortString};
use tokio::net::TcpStream;

use super::super::channels::QueueCounts;
use super::super::{ConnError, Declare, ExchangeFlags};
use super::broker::*;

/// The broker closes the control channel with `code` and `text` (as RabbitMQ does
/// on a refused declaration) and reads the client's close-ok.
async fn close_control(socket: &mut TcpStream, code: u16, text: &str, class_id: u16) {
    let close = channel::Close {
        reply_code: code,
        reply_text: text.into(),
        class_id,
        method_id: 10,
    };
    send(
        socket,
        &[method(
            1,
            AMQPClass::Channel(channel::AMQPMethod::Close(close)),
        )],
    )
    .await;
    assert!(
        matches!(
            expect_method(socket, 1).await,
            AMQPClass::Channel(channel::AMQPMethod::CloseOk(_))
        ),
        "the client answers the close with close-ok"
    );
}

fn args(pairs: &[(&str, AMQPValue)]) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in pairs {
        t.insert(ShortString::from(*k), v.clone());
    }
    t
}

fn text(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s))
}

#[tokio::test]
async fn queues_are_declared_actively_and_passively_with_their_arguments() {
    let queue_args = args(&[
        ("x-queue-type", text("quorum")),
        ("x-delivery-limit", AMQPValue::LongLongInt(5)),
    ]);
    let expected = queue_args.clone();
    let (mut conn, broker) = pair(Script::default(), move |mut socket| async move {
        accept_control(&mut socket).await;
        let mut seen = Vec::new();
        for counts in [(0, 0), (7, 2)] {
            let declare = match expect_method(&mut socket, 1).await {
                AMQPClass::Queue(queue::AMQPMethod::Declare(d)) => d,
                other => panic!("expected queue.declare, got {other:?}"),
            };
            assert!(!declare.exclusive && !declare.auto_delete && !declare.nowait);
            seen.push((
                declare.queue.to_string(),
                declare.passive,
                declare.durable,
                declare.arguments == expected,
            ));
            let ok = queue::DeclareOk {
                queue: declare.queue.clone(),
                message_count: counts.0,
                consumer_count: counts.1,
            };
            send(
                &mut socket,
                &[method(
                    1,
                    AMQPClass::Queue(queue::AMQPMethod::DeclareOk(ok)),
                )],
            )
            .await;
        }
        seen
    })
    .await;
    let created = conn
        .declare_queue("billing", true, queue_args.clone(), Declare::Active)
        .await
        .unwrap();
    assert_eq!(created, QueueCounts::default());
    let found = conn
        .declare_queue("billing", true, queue_args, Declare::Passive)
        .await
        .unwrap();
    assert_eq!(
        found,
        QueueCounts {
            messages: 7,
            consumers: 2
        }
    );
    let (_, seen) = broker.done().await;
    assert_eq!(
        seen,
        vec![
            ("billing".to_string(), false, true, true),
            ("billing".to_string(), true, true, true),
        ]
    );
}

#[tokio::test]
async fn queue_and_exchange_bindings_and_exchange_flags_go_out_as_configured() {
    let (mut conn, broker) = pair(Script::default(), |mut socket| async move {
        accept_control(&mut socket).await;
        let declare = match expect_method(&mut socket, 1).await {
            AMQPClass::Exchange(exchange::AMQPMethod::Declare(d)) => d,
            other => panic!("expected exchange.declare, got {other:?}"),
        };
        send(
            &mut socket,
            &[method(
                1,
                AMQPClass::Exchange(exchange::AMQPMethod::DeclareOk(exchange::DeclareOk {})),
            )],
        )
        .await;
        let qbind = match expect_method(&mut socket, 1).await {
            AMQPClass::Queue(queue::AMQPMethod::Bind(b)) => b,
            other => panic!("expected queue.bind, got {other:?}"),
        };
        send(
            &mut socket,
            &[method(
                1,
                AMQPClass::Queue(queue::AMQPMethod::BindOk(queue::BindOk {})),
            )],
        )
        .await;
        let xbind = match expect_method(&mut socket, 1).await {
            AMQPClass::Exchange(exchange::AMQPMethod::Bind(b)) => b,
            other => panic!("expected exchange.bind, got {other:?}"),
        };
        send(
            &mut socket,
            &[method(
                1,
                AMQPClass::Exchange(exchange::AMQPMethod::BindOk(exchange::BindOk {})),
            )],
        )
        .await;
        (declare, qbind, xbind)
    })
    .await;
    let flags = ExchangeFlags {
        durable: false,
        auto_delete: true,
        internal: true,
    };
    conn.declare_exchange_with(
        "orders.unrouted",
        "x-consistent-hash",
        flags,
        args(&[("alternate-exchange", text("ae"))]),
        Declare::Active,
    )
    .await
    .unwrap();
    let headers = args(&[("x-match", text("all")), ("event_type", text("Placed"))]);
    conn.bind_queue("billing", "amq.headers", "", headers.clone())
        .await
        .unwrap();
    conn.bind_exchange("orders", "outbox", "orders.#", FieldTable::default())
        .await
        .unwrap();
    let (_, (declare, qbind, xbind)) = broker.done().await;
    assert_eq!(declare.exchange.as_str(), "orders.unrouted");
    assert_eq!(declare.kind.as_str(), "x-consistent-hash");
    assert!(!declare.passive && !declare.durable && declare.auto_delete && declare.internal);
    assert_eq!(
        declare.arguments,
        args(&[("alternate-exchange", text("ae"))])
    );
    assert_eq!(
        (
            qbind.queue.as_str(),
            qbind.exchange.as_str(),
            qbind.routing_key.as_str()
        ),
        ("billing", "amq.headers", "")
    );
    assert_eq!(qbind.arguments, headers);
    assert_eq!(
        (
            xbind.destination.as_str(),
            xbind.source.as_str(),
            xbind.routing_key.as_str()
        ),
        ("orders", "outbox", "orders.#")
    );
}

/// RabbitMQ refuses a declaration whose arguments differ from the queue's with a
/// channel.close 406 naming the argument: the caller gets that code and text, the
/// publishing channel is untouched, and the next declaration opens the control
/// channel again (a binding too: the same applies to every request on it).
#[tokio::test]
async fn a_406_closes_the_control_channel_reports_the_text_and_the_next_request_reopens_it() {
    const TEXT: &str = "PRECONDITION_FAILED - inequivalent arg 'x-queue-type' for queue 'billing' in vhost '/': received 'quorum' but current is 'classic'";
    let (mut conn, broker) = pair(Script::default(), |mut socket| async move {
        accept_control(&mut socket).await;
        assert!(matches!(
            expect_method(&mut socket, 1).await,
            AMQPClass::Queue(queue::AMQPMethod::Declare(_))
        ));
        close_control(&mut socket, 406, TEXT, 50).await;
        // The next request reopens the channel before it is sent.
        accept_control(&mut socket).await;
        assert!(matches!(
            expect_method(&mut socket, 1).await,
            AMQPClass::Queue(queue::AMQPMethod::Bind(_))
        ));
        close_control(
            &mut socket,
            404,
            "NOT_FOUND - no exchange 'gone' in vhost '/'",
            50,
        )
        .await;
        accept_control(&mut socket).await;
        match expect_method(&mut socket, 1).await {
            AMQPClass::Queue(queue::AMQPMethod::Declare(d)) => assert!(d.passive),
            other => panic!("expected queue.declare, got {other:?}"),
        }
        let ok = queue::DeclareOk {
            queue: "billing".into(),
            message_count: 0,
            consumer_count: 0,
        };
        send(
            &mut socket,
            &[method(
                1,
                AMQPClass::Queue(queue::AMQPMethod::DeclareOk(ok)),
            )],
        )
        .await;
    })
    .await;
    let quorum = args(&[("x-queue-type", text("quorum"))]);
    let refused = conn
        .declare_queue("billing", true, quorum.clone(), Declare::Active)
        .await;
    assert_eq!(
        refused,
        Err(ConnError::ChannelClosed {
            code: 406,
            text: TEXT.to_string()
        })
    );
    assert!(conn.channel_open(), "the publishing channel stays open");
    assert!(conn.is_alive());
    let missing = conn
        .bind_queue("billing", "gone", "k", FieldTable::default())
        .await;
    assert!(
        matches!(&missing, Err(ConnError::ChannelClosed { code: 404, .. })),
        "{missing:?}"
    );
    conn.declare_queue("billing", true, quorum, Declare::Passive)
        .await
        .expect("the control channel was opened again");
    broker.done().await;
}
