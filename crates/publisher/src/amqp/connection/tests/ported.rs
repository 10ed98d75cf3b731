//! The scripted-broker tests of the publishing connection that once ran beside
//! lapin (removed since), ported to this connection: the publishing channel is 2
//! (1 is the control channel) and a `multiple` confirm comes out as one event per tag.

use std::time::Duration;

use amq_protocol::frame::{AMQPContentHeader, AMQPFrame};
use amq_protocol::protocol::{basic, channel, connection, exchange, AMQPClass};
use tokio::time::Instant;

use super::super::{ConnError, Declare, Event};
use super::broker::*;
use crate::error::PublishError;

fn returned(routing_key: &str) -> AMQPFrame {
    method(
        2,
        AMQPClass::Basic(basic::AMQPMethod::Return(basic::Return {
            reply_code: 312,
            reply_text: "NO_ROUTE".into(),
            exchange: "orders".into(),
            routing_key: routing_key.into(),
        })),
    )
}

#[tokio::test]
async fn publishes_go_out_framed_and_confirms_and_returns_come_back_in_order() {
    let (mut conn, broker) = pair(Script::default(), |mut socket| async move {
        let mut seen = Vec::new();
        for _ in 0..3 {
            seen.push(read_publish(&mut socket, 2, 4096).await);
        }
        // Publish 2 comes back unroutable: its return (method, header, body in
        // pieces and separate writes) before the multiple ack of all three.
        send(&mut socket, &[returned("b")]).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
        let header = AMQPFrame::Header(
            2,
            AMQPContentHeader {
                class_id: 60,
                body_size: 6,
                properties: properties("m2"),
            },
        );
        send(&mut socket, &[header, AMQPFrame::Body(2, b"abc".to_vec())]).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
        send(
            &mut socket,
            &[AMQPFrame::Body(2, b"def".to_vec()), ack(2, 3, true)],
        )
        .await;
        seen
    })
    .await;
    assert_eq!(conn.frame_max(), 4096, "the broker's smaller limit");
    // A body larger than the frame size goes out in several frames.
    let big: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
    assert_eq!(conn.publish("orders", "a", properties("m1"), b"one"), Ok(1));
    assert_eq!(conn.publish("orders", "b", properties("m2"), &big), Ok(2));
    assert_eq!(
        conn.publish("orders", "c", properties("m3"), b"three"),
        Ok(3)
    );
    assert!(
        conn.unwritten() > big.len(),
        "nothing written before a poll"
    );
    let mut events = Vec::new();
    while events.len() < 4 {
        events.extend(next_events(&mut conn).await.unwrap());
    }
    let (login, seen) = broker.done().await;
    assert_eq!(login.response, "\0relay\0s3cret");
    assert_eq!(login.tune_ok.frame_max, 4096);
    assert_eq!(login.tune_ok.heartbeat, 0);
    assert_eq!(seen[0], ("a".into(), "m1".into(), b"one".to_vec()));
    assert_eq!(seen[1].1, "m2");
    assert_eq!(seen[1].2, big, "the large body arrives whole");
    assert_eq!(seen[2], ("c".into(), "m3".into(), b"three".to_vec()));
    match &events[0] {
        Event::Return(r) => {
            assert_eq!(r.reply_code, 312);
            assert_eq!(
                (r.exchange.as_str(), r.routing_key.as_str()),
                ("orders", "b")
            );
            assert_eq!(r.properties.message_id().as_ref().unwrap().as_str(), "m2");
        }
        other => panic!("expected the return first, got {other:?}"),
    }
    let confirms: Vec<_> = (1..=3)
        .map(|tag| Event::Confirm { tag, ack: true })
        .collect();
    assert_eq!(
        events[1..],
        confirms[..],
        "the multiple ack, one event per tag"
    );
    assert_eq!(conn.unconfirmed(), 0);
}

#[tokio::test]
async fn a_channel_the_broker_closes_is_answered_and_the_next_one_is_renumbered() {
    let (mut conn, broker) = pair(Script::default(), |mut socket| async move {
        read_publish(&mut socket, 2, 4096).await;
        send(
            &mut socket,
            &[method(
                2,
                AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
                    reply_code: 406,
                    reply_text: "PRECONDITION_FAILED - message size too large".into(),
                    class_id: 60,
                    method_id: 40,
                })),
            )],
        )
        .await;
        assert!(matches!(
            expect_method(&mut socket, 2).await,
            AMQPClass::Channel(channel::AMQPMethod::CloseOk(_))
        ));
        accept_channel(&mut socket, 3, &[], &[]).await;
        // A late ack of the closed channel is not the new channel's.
        send(&mut socket, &[ack(2, 1, false)]).await;
        // The next publish goes out on channel 3, numbered from 1 again.
        let (_, id, _) = read_publish(&mut socket, 3, 4096).await;
        send(&mut socket, &[ack(3, 1, false)]).await;
        id
    })
    .await;
    conn.publish("orders", "a", properties("m1"), b"x").unwrap();
    let events = next_events(&mut conn).await.unwrap();
    assert_eq!(
        events,
        vec![Event::ChannelClosed {
            code: 406,
            text: "PRECONDITION_FAILED - message size too large".into()
        }]
    );
    assert!(!conn.channel_open());
    conn.open_channel().await.unwrap();
    assert!(conn.channel_open());
    assert_eq!(conn.publish("orders", "a", properties("m2"), b"x"), Ok(1));
    // The stray ack of channel 2 is dropped: the one event is channel 3's.
    let events = next_events(&mut conn).await.unwrap();
    assert_eq!(events, vec![Event::Confirm { tag: 1, ack: true }]);
    let (_, id) = broker.done().await;
    assert_eq!(id, "m2");
}

#[tokio::test]
async fn a_closed_connection_is_reported_after_the_confirms_before_it() {
    let (mut conn, broker) = pair(Script::default(), |mut socket| async move {
        read_publish(&mut socket, 2, 4096).await;
        send(
            &mut socket,
            &[
                ack(2, 1, false),
                connection_close(320, "CONNECTION_FORCED - closed by an operator"),
            ],
        )
        .await;
        expect_method(&mut socket, 0).await
    })
    .await;
    conn.publish("orders", "a", properties("m1"), b"x").unwrap();
    let first = next_events(&mut conn).await.unwrap();
    assert_eq!(first, vec![Event::Confirm { tag: 1, ack: true }]);
    let second = next_events(&mut conn).await;
    assert_eq!(
        second,
        Err(ConnError::Closed {
            code: 320,
            text: "CONNECTION_FORCED - closed by an operator".into()
        })
    );
    assert!(!conn.is_alive());
    let (_, answer) = broker.done().await;
    assert!(
        matches!(
            answer,
            AMQPClass::Connection(connection::AMQPMethod::CloseOk(_))
        ),
        "the broker got {answer:?}, not close-ok"
    );
    // Reported once: afterwards the connection stays quiet.
    let again = events_within(&mut conn, Duration::from_millis(100)).await;
    assert!(again.is_none(), "{again:?}");
}

#[tokio::test]
async fn a_silent_broker_gets_heartbeats_and_is_given_up_after_two_intervals() {
    let script = Script {
        heartbeat: 1,
        ..Script::default()
    };
    let (mut conn, broker) = pair(script, |mut socket| async move {
        let mut heartbeats = 0;
        while let Some(frame) = read_frame_within(&mut socket, Duration::from_secs(3)).await {
            assert_eq!(frame, AMQPFrame::Heartbeat);
            heartbeats += 1;
            if heartbeats == 2 {
                break;
            }
        }
        // Silent, the socket open, until the client has given up (at 2 s).
        tokio::time::sleep(Duration::from_millis(1500)).await;
        heartbeats
    })
    .await;
    let started = Instant::now();
    let result = next_events(&mut conn).await;
    let waited = started.elapsed();
    assert!(
        matches!(&result, Err(ConnError::Io(text)) if text.contains("heartbeat")),
        "{result:?}"
    );
    assert!(
        waited >= Duration::from_millis(1900),
        "given up after {waited:?}, before two intervals"
    );
    let (login, heartbeats) = broker.done().await;
    assert_eq!(login.tune_ok.heartbeat, 1);
    assert_eq!(heartbeats, 2, "a heartbeat every half interval while quiet");
}

#[tokio::test]
async fn a_refused_login_is_an_authentication_error_without_the_password() {
    let broker = broker(None, |mut socket| async move {
        greet(&mut socket, start_with(Default::default())).await;
        let refusal = "ACCESS_REFUSED - Login was refused using authentication mechanism PLAIN";
        send(&mut socket, &[connection_close(403, refusal)]).await;
        read_frame_within(&mut socket, Duration::from_secs(2)).await
    });
    let error = tokio::time::timeout(EVENT_LIMIT, connect_to(broker.port))
        .await
        .expect("the login did not end in time")
        .err()
        .expect("a refused login connected");
    assert!(
        matches!(error, PublishError::AuthenticationRefused { .. }),
        "{error:?}"
    );
    assert!(!error.is_transient());
    assert!(!error.to_string().contains("s3cret"), "{error}");
    let answer = broker.done().await;
    assert!(
        matches!(
            answer,
            Some(AMQPFrame::Method(
                0,
                AMQPClass::Connection(connection::AMQPMethod::CloseOk(_))
            ))
        ),
        "the broker got {answer:?}, not close-ok"
    );
}

/// New with the one client: declarations go on the control channel (1), opened
/// when first needed and again after a refusal closed it; confirms of the
/// publishing channel read while a declaration waits are kept for `poll_io`.
#[tokio::test]
async fn declarations_go_on_the_control_channel_and_confirms_read_meanwhile_are_kept() {
    let declare_ok = method(
        1,
        AMQPClass::Exchange(exchange::AMQPMethod::DeclareOk(exchange::DeclareOk {})),
    );
    let (mut conn, broker) = pair(Script::default(), move |mut socket| async move {
        let mut declared = Vec::new();
        for round in 0..3 {
            if round != 1 {
                // The publish buffered before the declaration goes out first.
                read_publish(&mut socket, 2, 4096).await;
                assert!(matches!(
                    expect_method(&mut socket, 1).await,
                    AMQPClass::Channel(channel::AMQPMethod::Open(_))
                ));
                send(
                    &mut socket,
                    &[method(
                        1,
                        AMQPClass::Channel(channel::AMQPMethod::OpenOk(channel::OpenOk {})),
                    )],
                )
                .await;
            }
            let declare = match expect_method(&mut socket, 1).await {
                AMQPClass::Exchange(exchange::AMQPMethod::Declare(d)) => d,
                other => panic!("expected exchange.declare, got {other:?}"),
            };
            declared.push((declare.exchange.to_string(), declare.passive));
            if round == 1 {
                // A passive check of a missing exchange closes the channel.
                let close = channel::Close {
                    reply_code: 404,
                    reply_text: "NOT_FOUND - no exchange 'dlx'".into(),
                    class_id: 40,
                    method_id: 10,
                };
                let close = method(1, AMQPClass::Channel(channel::AMQPMethod::Close(close)));
                send(&mut socket, &[close]).await;
                assert!(matches!(
                    expect_method(&mut socket, 1).await,
                    AMQPClass::Channel(channel::AMQPMethod::CloseOk(_))
                ));
            } else {
                // The publish's ack comes before the declaration's answer.
                send(
                    &mut socket,
                    &[ack(2, round / 2 + 1, false), declare_ok.clone()],
                )
                .await;
            }
        }
        declared
    })
    .await;
    conn.publish("orders", "a", properties("m1"), b"x").unwrap();
    conn.declare_exchange("orders", "topic", Declare::Active)
        .await
        .unwrap();
    let refused = conn
        .declare_exchange("dlx", "topic", Declare::Passive)
        .await;
    assert!(
        matches!(&refused, Err(ConnError::ChannelClosed { code: 404, .. })),
        "{refused:?}"
    );
    assert!(conn.channel_open(), "the publishing channel stays open");
    conn.publish("orders", "a", properties("m2"), b"x").unwrap();
    conn.declare_exchange("orders", "topic", Declare::Passive)
        .await
        .unwrap();
    let events = next_events(&mut conn).await.unwrap();
    assert_eq!(
        events,
        vec![
            Event::Confirm { tag: 1, ack: true },
            Event::Confirm { tag: 2, ack: true }
        ]
    );
    let (_, declared) = broker.done().await;
    assert_eq!(
        declared,
        vec![
            ("orders".to_string(), false),
            ("dlx".to_string(), true),
            ("orders".to_string(), true)
        ]
    );
}
