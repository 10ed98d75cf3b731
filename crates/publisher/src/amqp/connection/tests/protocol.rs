//! The protocol's defects of issue 40: 6 confirms of tags never published or
//! confirmed twice, 7 content interleaved with a method, 8 the limits a broker
//! cannot raise, 9 login errors and `connection.secure`; and messages AMQP cannot
//! frame, refused before any of them is written.

use std::time::Duration;

use amq_protocol::frame::AMQPFrame;
use amq_protocol::protocol::{basic, connection, AMQPClass};
use amq_protocol::types::{AMQPValue, FieldTable};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use super::super::{ConnError, Connection, Event};
use super::broker::*;
use crate::error::PublishError;

const QUICK: Duration = Duration::from_secs(2);

/// Every event up to the error that ends the connection, and that error.
async fn until_error(conn: &mut Connection) -> (Vec<Event>, ConnError) {
    let mut events = Vec::new();
    loop {
        match next_events(conn).await {
            Ok(more) => events.extend(more),
            Err(e) => return (events, e),
        }
    }
}

fn protocol_code(error: &ConnError) -> Option<u16> {
    match error {
        ConnError::Protocol { code, .. } => Some(*code),
        _ => None,
    }
}

/// Defect 6, and issue 49. The broker acks tag 2 when only tag 1 was published: no
/// confirm is credited, and the relay closes the channel (406), not the connection:
/// the disagreement is about the channel (a new one opens once its close-ok is in).
#[tokio::test]
async fn a_confirm_of_a_tag_never_published_closes_the_channel_with_406() {
    let (mut conn, broker) = pair(Script::default(), |mut socket| async move {
        read_publish(&mut socket, 2, 4096).await;
        send(&mut socket, &[ack(2, 2, false)]).await;
        channel_close_within(&mut socket, QUICK).await
    })
    .await;
    assert_eq!(conn.publish("orders", "a", properties("m1"), b"x"), Ok(1));
    let events = next_events(&mut conn).await.expect("the connection lives");
    assert!(
        matches!(events.as_slice(), [Event::ChannelError(text)] if text.contains("never published")),
        "{events:?}"
    );
    assert!(conn.is_alive() && !conn.channel_open());
    let (_, closed) = broker.done().await;
    assert_eq!(
        closed,
        Some((2, 406)),
        "the broker got no channel.close 406 on channel 2"
    );
}

/// Defect 6, and issue 49. Tag 1 acked twice: confirmed once, then the channel is
/// closed (406); the connection lives.
#[tokio::test]
async fn a_tag_confirmed_twice_closes_the_channel_with_406() {
    let (mut conn, broker) = pair(Script::default(), |mut socket| async move {
        read_publish(&mut socket, 2, 4096).await;
        read_publish(&mut socket, 2, 4096).await;
        send(&mut socket, &[ack(2, 1, false), ack(2, 1, false)]).await;
        channel_close_within(&mut socket, QUICK).await
    })
    .await;
    conn.publish("orders", "a", properties("m1"), b"x").unwrap();
    conn.publish("orders", "a", properties("m2"), b"x").unwrap();
    let events = next_events(&mut conn).await.expect("the connection lives");
    assert_eq!(events.first(), Some(&Event::Confirm { tag: 1, ack: true }));
    assert!(
        matches!(&events[1..], [Event::ChannelError(text)] if text.contains("twice")),
        "{events:?}"
    );
    assert!(conn.is_alive());
    let (_, closed) = broker.done().await;
    assert_eq!(
        closed,
        Some((2, 406)),
        "the broker got no channel.close 406 on channel 2"
    );
}

fn returned() -> AMQPFrame {
    method(
        2,
        AMQPClass::Basic(basic::AMQPMethod::Return(basic::Return {
            reply_code: 312,
            reply_text: "NO_ROUTE".into(),
            exchange: "orders".into(),
            routing_key: "a".into(),
        })),
    )
}

/// Defect 7. A method (an ack) between a `basic.return` and its content header:
/// the connection closes with 505 UNEXPECTED_FRAME and credits nothing.
#[tokio::test]
async fn a_method_between_a_return_and_its_content_closes_with_505() {
    let (mut conn, broker) = pair(Script::default(), |mut socket| async move {
        read_publish(&mut socket, 2, 4096).await;
        let header = AMQPFrame::Header(
            2,
            amq_protocol::frame::AMQPContentHeader {
                class_id: 60,
                body_size: 1,
                properties: properties("m1"),
            },
        );
        let frames = [
            returned(),
            ack(2, 1, false),
            header,
            AMQPFrame::Body(2, b"x".to_vec()),
        ];
        send(&mut socket, &frames).await;
        close_code_within(&mut socket, QUICK).await
    })
    .await;
    conn.publish("orders", "a", properties("m1"), b"x").unwrap();
    let (events, error) = until_error(&mut conn).await;
    assert_eq!(events, vec![], "content out of place was taken");
    assert_eq!(protocol_code(&error), Some(505), "{error:?}");
    let (_, code) = broker.done().await;
    assert_eq!(code, Some(505), "the broker got no connection.close 505");
}

/// Defect 8. A broker proposing a 4 GiB frame size gets 128 KiB in tune-ok, and
/// a frame announcing 1 GiB is refused from its header (501), not buffered.
#[tokio::test]
async fn a_broker_proposing_4_gib_frames_gets_128_kib_and_a_larger_frame_is_refused() {
    let script = Script {
        frame_max: u32::MAX,
        ..Script::default()
    };
    let (mut conn, broker) = pair(script, |mut socket| async move {
        let mut huge = vec![3u8, 0, 2];
        huge.extend_from_slice(&(1u32 << 30).to_be_bytes());
        huge.resize(64 * 1024, 0);
        socket.write_all(&huge).await.unwrap();
        close_code_within(&mut socket, QUICK).await
    })
    .await;
    assert_eq!(conn.frame_max(), 131_072);
    let (_, error) = until_error(&mut conn).await;
    assert_eq!(protocol_code(&error), Some(501), "{error:?}");
    let (login, code) = broker.done().await;
    assert_eq!(login.tune_ok.frame_max, 131_072, "tune-ok");
    assert_eq!(code, Some(501), "the broker got no connection.close 501");
}

/// Runs a broker whose `connection.start` is `start` (raw bytes); returns the
/// client's connect result and the first frame the broker got after it.
async fn login_with_start(start: Vec<u8>) -> (Result<(), PublishError>, Option<AMQPFrame>) {
    let broker = broker(None, move |mut socket: TcpStream| async move {
        let mut header = [0u8; 8];
        tokio::io::AsyncReadExt::read_exact(&mut socket, &mut header)
            .await
            .unwrap();
        socket.write_all(&start).await.unwrap();
        read_frame_within(&mut socket, QUICK).await
    });
    let result = tokio::time::timeout(Duration::from_secs(3), connect_to(broker.port))
        .await
        .expect("the connection neither logged in nor failed within 3 s")
        .map(|_| ());
    (result, broker.done().await)
}

fn close_code(frame: &Option<AMQPFrame>) -> Option<u16> {
    match frame {
        Some(AMQPFrame::Method(0, AMQPClass::Connection(connection::AMQPMethod::Close(c)))) => {
            Some(c.reply_code)
        }
        _ => None,
    }
}

/// Defect 8. Before tune, a frame over 4 KiB (a `connection.start` with 6 KB of
/// server properties) is refused: 501, and no start-ok.
#[tokio::test]
async fn a_frame_over_4_kib_before_tune_is_refused() {
    let mut properties = FieldTable::default();
    properties.insert(
        "padding".into(),
        AMQPValue::LongString("p".repeat(6000).into()),
    );
    let (result, answer) = login_with_start(encoded(&start_with(properties))).await;
    assert_eq!(close_code(&answer), Some(501), "the broker got {answer:?}");
    assert!(result.is_err());
}

/// A field table `depth` levels deep, written by hand (the codec would recurse to
/// encode it).
fn deep_table(depth: usize) -> Vec<u8> {
    let mut table = Vec::new();
    for _ in 0..depth {
        table.extend_from_slice(&0u32.to_be_bytes()); // the length, patched below
        table.extend_from_slice(&[1, b't', b'F']);
    }
    table.extend_from_slice(&0u32.to_be_bytes());
    for level in (0..depth).rev() {
        let at = level * 7;
        let len = (table.len() - at - 4) as u32;
        table[at..at + 4].copy_from_slice(&len.to_be_bytes());
    }
    table
}

fn raw_frame(kind: u8, ch: u16, payload: &[u8]) -> Vec<u8> {
    let mut frame = vec![kind];
    frame.extend_from_slice(&ch.to_be_bytes());
    frame.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    frame.extend_from_slice(payload);
    frame.push(0xCE);
    frame
}

/// Defect 8. A `connection.start` whose server properties nest 500 tables deep
/// (3.5 KB, within the 4 KiB before tune): a syntax error (502), no start-ok.
#[tokio::test]
async fn a_deeply_nested_table_in_connection_start_is_a_protocol_error() {
    let mut payload = vec![0, 10, 0, 10, 0, 9];
    payload.extend_from_slice(&deep_table(500));
    for text in ["PLAIN", "en_US"] {
        payload.extend_from_slice(&(text.len() as u32).to_be_bytes());
        payload.extend_from_slice(text.as_bytes());
    }
    let start = raw_frame(1, 0, &payload);
    assert!(start.len() <= 4096);
    let (result, answer) = login_with_start(start).await;
    assert_eq!(close_code(&answer), Some(502), "the broker got {answer:?}");
    assert!(result.is_err());
}

/// Defect 8. A returned message whose headers nest 18,000 tables deep (126 KB,
/// within a 128 KiB frame): a syntax error (502), not a stack overflow.
#[tokio::test]
async fn a_deeply_nested_header_table_of_a_return_is_a_protocol_error_not_a_stack_overflow() {
    let script = Script {
        frame_max: 131_072,
        ..Script::default()
    };
    let (mut conn, broker) = pair(script, |mut socket| async move {
        read_publish(&mut socket, 2, 131_072).await;
        // class 60, weight 0, body size 0, the headers flag, the table.
        let mut payload = vec![0, 60, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x20, 0];
        payload.extend_from_slice(&deep_table(18_000));
        let mut bytes = encoded(&returned());
        bytes.extend_from_slice(&raw_frame(2, 2, &payload));
        socket.write_all(&bytes).await.unwrap();
        close_code_within(&mut socket, QUICK).await
    })
    .await;
    conn.publish("orders", "a", properties("m1"), b"x").unwrap();
    let (events, error) = until_error(&mut conn).await;
    assert_eq!(events, vec![]);
    assert_eq!(protocol_code(&error), Some(502), "{error:?}");
    let (_, code) = broker.done().await;
    assert_eq!(code, Some(502), "the broker got no connection.close 502");
}

/// Defect 9. The socket ends after start-ok (a broker restarting, a proxy
/// dropping): an outage, retried, not a refused login that stops the relay.
#[tokio::test]
async fn an_io_error_after_start_ok_is_an_outage_not_a_refused_login() {
    let broker = broker(None, |mut socket| async move {
        greet(&mut socket, start_with(FieldTable::default())).await;
        // The socket is dropped here.
    });
    let error = tokio::time::timeout(Duration::from_secs(3), connect_to(broker.port))
        .await
        .expect("the login did not end within 3 s")
        .err()
        .expect("connected to a broker that hung up");
    broker.done().await;
    assert!(
        matches!(error, PublishError::Unreachable { .. }),
        "{error:?}"
    );
    assert!(error.is_transient());
}

/// Defect 9. `connection.secure` after start-ok is answered with secure-ok (the
/// mechanism's response again for PLAIN), and the login goes on.
#[tokio::test]
async fn connection_secure_is_answered_with_secure_ok() {
    let broker = broker(None, |mut socket| async move {
        greet(&mut socket, start_with(FieldTable::default())).await;
        let secure = connection::Secure {
            challenge: "again".into(),
        };
        send(
            &mut socket,
            &[conn_frame(connection::AMQPMethod::Secure(secure))],
        )
        .await;
        match read_frame_within(&mut socket, QUICK).await {
            Some(AMQPFrame::Method(
                0,
                AMQPClass::Connection(connection::AMQPMethod::SecureOk(ok)),
            )) => {
                tune_and_open(&mut socket, 4096, 0).await;
                Ok(String::from_utf8_lossy(ok.response.as_bytes()).into_owned())
            }
            other => Err(format!("{other:?}")),
        }
    });
    let connected = tokio::time::timeout(Duration::from_secs(3), connect_to(broker.port)).await;
    let answer = broker.done().await;
    assert_eq!(
        answer,
        Ok("\0relay\0s3cret".to_string()),
        "the broker's challenge got no secure-ok (Err: what it got instead)"
    );
    let connected = connected.expect("no login within 3 s");
    assert!(connected.is_ok(), "{:?}", connected.err());
}

/// A message whose content header takes more than the frame size, or whose
/// exchange or routing key AMQP cannot carry, is refused by `publish`: nothing of
/// it is written and it takes no delivery tag.
#[tokio::test]
async fn a_message_that_cannot_be_framed_is_refused_and_nothing_of_it_written() {
    let (mut conn, broker) = pair(Script::default(), |mut socket| async move {
        let (_, id, _) = read_publish(&mut socket, 2, 4096).await;
        send(&mut socket, &[ack(2, 1, false)]).await;
        id
    })
    .await;
    let mut headers = FieldTable::default();
    headers.insert("big".into(), AMQPValue::LongString("h".repeat(5000).into()));
    let unfit = properties("unfit").with_headers(headers);
    let refused = conn.publish("orders", "a", unfit, b"x");
    assert!(
        matches!(&refused, Err(e) if e.0.contains("frame size of 4096")),
        "{refused:?}"
    );
    assert_eq!(
        conn.unwritten(),
        0,
        "part of the refused message was buffered"
    );
    let long = "k".repeat(256);
    assert!(conn
        .publish("orders", &long, properties("rk"), b"x")
        .is_err());
    assert!(conn.publish(&long, "a", properties("ex"), b"x").is_err());
    assert_eq!(conn.unwritten(), 0);
    assert_eq!(conn.publish("orders", "a", properties("fit"), b"x"), Ok(1));
    let events = next_events(&mut conn).await.unwrap();
    assert_eq!(events, vec![Event::Confirm { tag: 1, ack: true }]);
    let (_, first) = broker.done().await;
    assert_eq!(first, "fit", "the first publish the broker got");
}
