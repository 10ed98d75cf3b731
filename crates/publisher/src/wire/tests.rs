use super::*;

fn encoded(frame: &AMQPFrame) -> Vec<u8> {
    gen_frame(frame)(WriteContext::from(Vec::new()))
        .unwrap()
        .write
}

#[test]
fn the_hand_encoded_publish_is_the_codecs_publish() {
    let mut ours = Vec::new();
    encode_publish(&mut ours, 7, "orders", "order.created", true);
    let theirs = encoded(&AMQPFrame::Method(
        7,
        AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
            exchange: "orders".into(),
            routing_key: "order.created".into(),
            mandatory: true,
            immediate: false,
        })),
    ));
    assert_eq!(ours, theirs);
    let mut body = Vec::new();
    encode_body(&mut body, 7, b"{\"a\":1}");
    assert_eq!(body, encoded(&AMQPFrame::Body(7, b"{\"a\":1}".to_vec())));
}

#[test]
fn frames_are_split_whole_and_only_whole() {
    let ack = encoded(&AMQPFrame::Method(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
            delivery_tag: 42,
            multiple: true,
        })),
    ));
    let mut two = ack.clone();
    two.extend_from_slice(&ack);
    for cut in 0..ack.len() {
        assert!(
            split_frame(&two[..cut], 0).unwrap().is_none(),
            "cut at {cut}"
        );
    }
    let (frame, used) = split_frame(&two, 0).unwrap().unwrap();
    assert_eq!(used, ack.len());
    assert!(matches!(
        frame,
        AMQPFrame::Method(
            1,
            AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
                delivery_tag: 42,
                multiple: true
            }))
        )
    ));
}

#[test]
fn malformed_frames_are_errors() {
    let mut ack = encoded(&AMQPFrame::Method(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
            delivery_tag: 1,
            multiple: false,
        })),
    ));
    let last = ack.len() - 1;
    ack[last] = 0;
    assert!(split_frame(&ack, 0).is_err(), "no frame-end octet");
    let huge = [1u8, 0, 1, 0x7f, 0xff, 0xff, 0xff];
    assert!(
        split_frame(&huge, 0).is_err(),
        "a frame far above frame_max"
    );
    assert!(
        split_frame(b"AMQP\x00\x00\x09\x01", 0).is_err(),
        "a version refusal"
    );
    // A method frame whose payload is not a method.
    let junk = [1u8, 0, 1, 0, 0, 0, 3, 0xff, 0xff, 0xff, 0xCE];
    assert!(split_frame(&junk, 0).is_err());
}

// A scripted broker on a real socket: the handshake, then what each test scripts.

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

const BROKER_FRAME_MAX: u32 = 4096;

async fn read_frame(socket: &mut TcpStream) -> AMQPFrame {
    let mut head = [0u8; 7];
    socket.read_exact(&mut head).await.unwrap();
    let size = u32::from_be_bytes([head[3], head[4], head[5], head[6]]) as usize;
    let mut rest = vec![0u8; size + 1];
    socket.read_exact(&mut rest).await.unwrap();
    let mut whole = head.to_vec();
    whole.extend_from_slice(&rest);
    let (frame, used) = split_frame(&whole, BROKER_FRAME_MAX).unwrap().unwrap();
    assert_eq!(used, whole.len());
    frame
}

async fn send(socket: &mut TcpStream, frames: &[AMQPFrame]) {
    let mut out = Vec::new();
    for frame in frames {
        out.extend_from_slice(&encoded(frame));
    }
    socket.write_all(&out).await.unwrap();
}

fn method(ch: u16, class: AMQPClass) -> AMQPFrame {
    AMQPFrame::Method(ch, class)
}

fn conn(m: connection::AMQPMethod) -> AMQPClass {
    AMQPClass::Connection(m)
}

fn start() -> AMQPFrame {
    method(
        0,
        conn(connection::AMQPMethod::Start(connection::Start {
            version_major: 0,
            version_minor: 9,
            server_properties: FieldTable::default(),
            mechanisms: "PLAIN AMQPLAIN".into(),
            locales: "en_US".into(),
        })),
    )
}

/// Expects a method frame on `ch` and returns it.
async fn expect_method(socket: &mut TcpStream, ch: u16) -> AMQPClass {
    match read_frame(socket).await {
        AMQPFrame::Method(c, m) if c == ch => m,
        other => panic!("expected a method on channel {ch}, got {other:?}"),
    }
}

/// The broker's half of opening channel `ch` in confirm mode.
async fn accept_channel(socket: &mut TcpStream, ch: u16) {
    assert!(matches!(
        expect_method(socket, ch).await,
        AMQPClass::Channel(channel::AMQPMethod::Open(_))
    ));
    send(
        socket,
        &[method(
            ch,
            AMQPClass::Channel(channel::AMQPMethod::OpenOk(channel::OpenOk {})),
        )],
    )
    .await;
    assert!(matches!(
        expect_method(socket, ch).await,
        AMQPClass::Confirm(confirm::AMQPMethod::Select(_))
    ));
    send(
        socket,
        &[method(
            ch,
            AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(confirm::SelectOk {})),
        )],
    )
    .await;
}

/// The broker's half of the handshake and the first channel; returns the login
/// response the client sent.
async fn accept(socket: &mut TcpStream, heartbeat: u16) -> String {
    let mut header = [0u8; 8];
    socket.read_exact(&mut header).await.unwrap();
    assert_eq!(&header, b"AMQP\x00\x00\x09\x01");
    send(socket, &[start()]).await;
    let response = match expect_method(socket, 0).await {
        AMQPClass::Connection(connection::AMQPMethod::StartOk(ok)) => {
            assert_eq!(ok.mechanism.as_str(), "PLAIN");
            let name = ok.client_properties.inner().get("connection_name").cloned();
            assert_eq!(
                name,
                Some(AMQPValue::LongString("relay test".into())),
                "the connection is named"
            );
            String::from_utf8_lossy(ok.response.as_bytes()).into_owned()
        }
        other => panic!("expected start-ok, got {other:?}"),
    };
    send(
        socket,
        &[method(
            0,
            conn(connection::AMQPMethod::Tune(connection::Tune {
                channel_max: 2047,
                frame_max: BROKER_FRAME_MAX,
                heartbeat,
            })),
        )],
    )
    .await;
    match expect_method(socket, 0).await {
        AMQPClass::Connection(connection::AMQPMethod::TuneOk(ok)) => {
            assert_eq!(ok.frame_max, BROKER_FRAME_MAX, "the broker's smaller limit");
            assert_eq!(ok.heartbeat, heartbeat);
        }
        other => panic!("expected tune-ok, got {other:?}"),
    }
    match expect_method(socket, 0).await {
        AMQPClass::Connection(connection::AMQPMethod::Open(open)) => {
            assert_eq!(open.virtual_host.as_str(), "/")
        }
        other => panic!("expected open, got {other:?}"),
    }
    send(
        socket,
        &[method(
            0,
            conn(connection::AMQPMethod::OpenOk(connection::OpenOk {})),
        )],
    )
    .await;
    accept_channel(socket, 1).await;
    response
}

/// A connected client and the broker's socket.
async fn pair(heartbeat: u16) -> (Wire, TcpStream) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let broker = tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await.unwrap();
        let response = accept(&mut socket, heartbeat).await;
        assert_eq!(response, "\0relay\0s3cret");
        socket
    });
    let uri: AMQPUri = format!("amqp://relay:s3cret@127.0.0.1:{port}/%2f")
        .parse()
        .unwrap();
    let tcp = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let mut wire = Wire::new(Box::new(tcp));
    wire.handshake(&uri, "relay test").await.unwrap();
    wire.open_channel().await.unwrap();
    (wire, broker.await.unwrap())
}

/// Polls until the wire reports something (bounded).
async fn next_events(wire: &mut Wire) -> Result<Vec<WireEvent>, WireError> {
    tokio::time::timeout(Duration::from_secs(10), poll_fn(|cx| wire.poll_io(cx)))
        .await
        .expect("the wire reported nothing within 10 s")
}

fn properties(id: &str) -> BasicProperties {
    BasicProperties::default()
        .with_message_id(id.into())
        .with_delivery_mode(2)
}

#[tokio::test]
async fn publishes_go_out_framed_and_confirms_and_returns_come_back_in_order() {
    let (mut wire, mut broker) = pair(0).await;
    // A body larger than the broker's frame maximum goes out in several frames.
    let big: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
    assert_eq!(
        wire.publish("orders", "a", true, properties("m1"), b"one"),
        1
    );
    assert_eq!(wire.publish("orders", "b", true, properties("m2"), &big), 2);
    assert_eq!(
        wire.publish("orders", "c", true, properties("m3"), b"three"),
        3
    );
    // Nothing is written before the wire is polled; then everything is.
    let writer = tokio::spawn(async move {
        let mut seen = Vec::new();
        for _ in 0..3 {
            let publish = match read_frame(&mut broker).await {
                AMQPFrame::Method(1, AMQPClass::Basic(basic::AMQPMethod::Publish(p))) => p,
                other => panic!("expected a publish, got {other:?}"),
            };
            assert!(publish.mandatory);
            let AMQPFrame::Header(1, header) = read_frame(&mut broker).await else {
                panic!("expected a content header");
            };
            let mut body = Vec::new();
            while (body.len() as u64) < header.body_size {
                match read_frame(&mut broker).await {
                    AMQPFrame::Body(1, piece) => {
                        assert!(piece.len() + FRAME_OVERHEAD <= BROKER_FRAME_MAX as usize);
                        body.extend_from_slice(&piece);
                    }
                    other => panic!("expected a body frame, got {other:?}"),
                }
            }
            seen.push((
                publish.routing_key.to_string(),
                header.properties.message_id().clone().unwrap().to_string(),
                body,
            ));
        }
        // Publish 2 comes back unroutable: its return (method, header, body in
        // pieces and separate writes) before the multiple ack of all three.
        send(
            &mut broker,
            &[method(
                1,
                AMQPClass::Basic(basic::AMQPMethod::Return(basic::Return {
                    reply_code: 312,
                    reply_text: "NO_ROUTE".into(),
                    exchange: "orders".into(),
                    routing_key: "b".into(),
                })),
            )],
        )
        .await;
        tokio::time::sleep(Duration::from_millis(20)).await;
        send(
            &mut broker,
            &[
                AMQPFrame::Header(
                    1,
                    AMQPContentHeader {
                        class_id: 60,
                        body_size: 6,
                        properties: properties("m2"),
                    },
                ),
                AMQPFrame::Body(1, b"abc".to_vec()),
            ],
        )
        .await;
        tokio::time::sleep(Duration::from_millis(20)).await;
        send(
            &mut broker,
            &[
                AMQPFrame::Body(1, b"def".to_vec()),
                method(
                    1,
                    AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
                        delivery_tag: 3,
                        multiple: true,
                    })),
                ),
            ],
        )
        .await;
        (seen, broker)
    });
    let mut events = Vec::new();
    while events.len() < 2 {
        events.extend(next_events(&mut wire).await.unwrap());
    }
    let (seen, _broker) = writer.await.unwrap();
    assert_eq!(seen[0], ("a".into(), "m1".into(), b"one".to_vec()));
    assert_eq!(seen[1].1, "m2");
    assert_eq!(seen[1].2, big, "the large body arrives whole");
    assert_eq!(seen[2], ("c".into(), "m3".into(), b"three".to_vec()));
    match &events[0] {
        WireEvent::Return {
            reply_code: 312,
            exchange,
            routing_key,
            properties,
            ..
        } => {
            assert_eq!((exchange.as_str(), routing_key.as_str()), ("orders", "b"));
            assert_eq!(properties.message_id().as_ref().unwrap().as_str(), "m2");
        }
        other => panic!("expected the return first, got {other:?}"),
    }
    assert_eq!(
        events[1],
        WireEvent::Ack {
            tag: 3,
            multiple: true
        }
    );
    assert_eq!(events.len(), 2);
}

#[tokio::test]
async fn a_channel_the_broker_closes_is_answered_and_the_next_one_numbers_from_one() {
    let (mut wire, mut broker) = pair(0).await;
    wire.publish("orders", "a", true, properties("m1"), b"x");
    let script = tokio::spawn(async move {
        for _ in 0..3 {
            read_frame(&mut broker).await;
        }
        send(
            &mut broker,
            &[method(
                1,
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
            expect_method(&mut broker, 1).await,
            AMQPClass::Channel(channel::AMQPMethod::CloseOk(_))
        ));
        accept_channel(&mut broker, 2).await;
        // A late ack of the closed channel is not the new channel's.
        send(
            &mut broker,
            &[method(
                1,
                AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
                    delivery_tag: 1,
                    multiple: false,
                })),
            )],
        )
        .await;
        broker
    });
    let events = next_events(&mut wire).await.unwrap();
    assert_eq!(
        events,
        vec![WireEvent::ChannelClosed {
            code: 406,
            text: "PRECONDITION_FAILED - message size too large".into()
        }]
    );
    assert!(!wire.channel_open());
    wire.open_channel().await.unwrap();
    assert!(wire.channel_open());
    assert_eq!(wire.publish("orders", "a", true, properties("m1"), b"x"), 1);
    let mut broker = script.await.unwrap();
    let published = tokio::spawn(async move {
        let frame = read_frame(&mut broker).await;
        (frame, broker)
    });
    // The stray ack of channel 1 is dropped; the publish goes out on channel 2.
    let quiet =
        tokio::time::timeout(Duration::from_millis(300), poll_fn(|cx| wire.poll_io(cx))).await;
    assert!(
        quiet.is_err(),
        "an event from the closed channel: {quiet:?}"
    );
    let (frame, _broker) = published.await.unwrap();
    assert!(matches!(
        frame,
        AMQPFrame::Method(2, AMQPClass::Basic(basic::AMQPMethod::Publish(_)))
    ));
}

#[tokio::test]
async fn a_closed_connection_is_reported_after_the_confirms_before_it() {
    let (mut wire, mut broker) = pair(0).await;
    wire.publish("orders", "a", true, properties("m1"), b"x");
    let script = tokio::spawn(async move {
        for _ in 0..3 {
            read_frame(&mut broker).await;
        }
        send(
            &mut broker,
            &[
                method(
                    1,
                    AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
                        delivery_tag: 1,
                        multiple: false,
                    })),
                ),
                method(
                    0,
                    conn(connection::AMQPMethod::Close(connection::Close {
                        reply_code: 320,
                        reply_text: "CONNECTION_FORCED - closed by an operator".into(),
                        class_id: 0,
                        method_id: 0,
                    })),
                ),
            ],
        )
        .await;
        let answer = expect_method(&mut broker, 0).await;
        assert!(matches!(
            answer,
            AMQPClass::Connection(connection::AMQPMethod::CloseOk(_))
        ));
    });
    let first = next_events(&mut wire).await.unwrap();
    assert_eq!(
        first,
        vec![WireEvent::Ack {
            tag: 1,
            multiple: false
        }]
    );
    let second = next_events(&mut wire).await;
    assert_eq!(
        second,
        Err(WireError::Closed {
            code: 320,
            text: "CONNECTION_FORCED - closed by an operator".into()
        })
    );
    assert!(!wire.is_alive());
    tokio::time::timeout(Duration::from_secs(10), script)
        .await
        .expect("the broker got no close-ok")
        .unwrap();
    // Reported once: afterwards the wire stays quiet.
    let again =
        tokio::time::timeout(Duration::from_millis(100), poll_fn(|cx| wire.poll_io(cx))).await;
    assert!(again.is_err());
}

#[tokio::test]
async fn a_silent_broker_gets_heartbeats_and_is_given_up_after_two_intervals() {
    let (mut wire, mut broker) = pair(1).await;
    let listener = tokio::spawn(async move {
        let mut heartbeats = 0;
        while let Ok(Ok(frame)) = tokio::time::timeout(Duration::from_secs(5), async {
            Ok::<_, ()>(read_frame(&mut broker).await)
        })
        .await
        {
            assert_eq!(frame, AMQPFrame::Heartbeat);
            heartbeats += 1;
            if heartbeats == 2 {
                break;
            }
        }
        (heartbeats, broker)
    });
    let started = Instant::now();
    let result = next_events(&mut wire).await;
    let waited = started.elapsed();
    assert!(
        matches!(&result, Err(WireError::Io(text)) if text.contains("heartbeat")),
        "{result:?}"
    );
    assert!(
        waited >= Duration::from_millis(1900),
        "given up after {waited:?}, before two intervals"
    );
    let (heartbeats, _broker) = listener.await.unwrap();
    assert_eq!(heartbeats, 2, "a heartbeat every half interval while quiet");
}

#[tokio::test]
async fn a_refused_login_is_an_authentication_error_without_the_password() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await.unwrap();
        let mut header = [0u8; 8];
        socket.read_exact(&mut header).await.unwrap();
        send(&mut socket, &[start()]).await;
        let _start_ok = expect_method(&mut socket, 0).await;
        send(
            &mut socket,
            &[method(
                0,
                conn(connection::AMQPMethod::Close(connection::Close {
                    reply_code: 403,
                    reply_text:
                        "ACCESS_REFUSED - Login was refused using authentication mechanism PLAIN"
                            .into(),
                    class_id: 0,
                    method_id: 0,
                })),
            )],
        )
        .await;
        let _ = expect_method(&mut socket, 0).await;
    });
    let url = format!("amqp://relay:s3cret@127.0.0.1:{port}/%2f");
    let uri: AMQPUri = url.parse().unwrap();
    let tcp = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let mut wire = Wire::new(Box::new(tcp));
    let error = wire.handshake(&uri, "relay test").await.unwrap_err();
    let error = classify(&redact_url(&url), &url, &error);
    assert!(
        matches!(error, PublishError::AuthenticationRefused { .. }),
        "{error:?}"
    );
    assert!(!error.to_string().contains("s3cret"), "{error}");
}
