//! The connection's edges of issue 49, each against the scripted broker: heartbeats
//! negotiated as AMQP says, a deadline on every request and on confirms, the answer
//! to `channel.flow`, a reply not overwritten by a method read after it, an IPv6
//! literal host, and TCP keepalive on the socket.

use std::time::Duration;

use amq_protocol::protocol::{channel, exchange, AMQPClass};
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

use super::super::socket::set_keepalive;
use super::super::{connect, ConnError, Declare, Event};
use super::broker::*;
use crate::amqp::config::PublisherConfig;
use crate::tls::Tls;

/// The tune-ok the relay sends for a URL asking `url_heartbeat` (`None`: nothing)
/// and a broker proposing `broker`.
async fn negotiated(url_heartbeat: Option<u16>, broker_heartbeat: u16) -> u16 {
    let broker = broker(None, move |mut socket| async move {
        greet(&mut socket, start_with(Default::default())).await;
        tune_and_open(&mut socket, 4096, broker_heartbeat).await
    });
    let mut url = url(broker.port);
    if let Some(h) = url_heartbeat {
        url.push_str(&format!("?heartbeat={h}"));
    }
    let config = PublisherConfig::new(url, "orders");
    let _conn = connect(
        &crate::amqp::session::params(&config, &Tls::SystemRoots).unwrap(),
        0,
    )
    .await
    .expect("the handshake");
    broker.done().await.heartbeat
}

/// The lower of the two, or the non-zero one when either side asks for none: a
/// URL's `heartbeat=0` used to switch off the heartbeats the broker asked for.
#[tokio::test]
async fn heartbeats_are_negotiated_as_amqp_says() {
    assert_eq!(
        negotiated(Some(0), 60).await,
        60,
        "0 in the URL keeps the broker's 60"
    );
    assert_eq!(negotiated(Some(10), 60).await, 10, "the lower of 10 and 60");
    assert_eq!(negotiated(Some(90), 60).await, 60, "the lower of 90 and 60");
    assert_eq!(
        negotiated(Some(30), 0).await,
        30,
        "the broker asking for none"
    );
    assert_eq!(negotiated(None, 20).await, 20, "no URL value: the broker's");
}

/// A connection whose requests time out after `timeout`.
async fn with_timeout<T, F, Fut>(
    timeout: Duration,
    then: F,
) -> (super::super::Connection, Broker<(Login, T)>)
where
    T: Send + 'static,
    F: FnOnce(TcpStream) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = T>,
{
    let (mut conn, broker) = pair(Script::default(), then).await;
    conn.request_timeout = timeout;
    (conn, broker)
}

/// A broker alive (its socket open) that never answers a declaration: the request
/// fails after `request_timeout`, and the connection with it (it is then given up
/// and the next node tried). It used to wait for as long as the broker was silent.
#[tokio::test]
async fn a_request_the_broker_never_answers_fails_the_connection_in_time() {
    let (mut conn, broker) = with_timeout(Duration::from_millis(300), |mut socket| async move {
        // The control channel opens; the declaration is read and never answered.
        accept_control(&mut socket).await;
        let _declare = expect_method(&mut socket, 1).await;
        tokio::time::sleep(Duration::from_secs(2)).await;
    })
    .await;
    let started = std::time::Instant::now();
    let declared = tokio::time::timeout(
        Duration::from_secs(5),
        conn.declare_exchange("orders", "topic", Declare::Active),
    )
    .await
    .expect("the declaration waited past its deadline");
    match declared {
        Err(ConnError::Io(text)) => assert!(text.contains("request_timeout"), "{text}"),
        other => panic!("{other:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(2));
    assert!(!conn.is_alive(), "a missed deadline fails the connection");
    broker.done().await;
}

/// Publishes the broker reads and never confirms (heartbeats off, nothing else
/// said): `poll_io` ends the connection after `request_timeout`.
#[tokio::test]
async fn publishes_never_confirmed_fail_the_connection_in_time() {
    let (mut conn, broker) = with_timeout(Duration::from_millis(300), |mut socket| async move {
        read_publish(&mut socket, 2, 4096).await;
        tokio::time::sleep(Duration::from_secs(2)).await;
    })
    .await;
    conn.publish("orders", "a", properties("m1"), b"x").unwrap();
    match events_within(&mut conn, Duration::from_secs(5)).await {
        Some(Err(ConnError::Io(text))) => assert!(text.contains("no confirm"), "{text}"),
        other => panic!("{other:?}"),
    }
    broker.done().await;
}

/// `channel.flow(false)` on the publishing channel: answered with flow-ok at once,
/// and publishing stops (a notice, and `blocked()`) until `channel.flow(true)`. It
/// used to be accepted and never answered.
#[tokio::test]
async fn channel_flow_is_answered_and_obeyed() {
    let flow = |active| {
        method(
            2,
            AMQPClass::Channel(channel::AMQPMethod::Flow(channel::Flow { active })),
        )
    };
    let (mut conn, broker) = pair(Script::default(), move |mut socket| async move {
        send(&mut socket, &[flow(false)]).await;
        let off = expect_method(&mut socket, 2).await;
        send(&mut socket, &[flow(true)]).await;
        let on = expect_method(&mut socket, 2).await;
        (off, on)
    })
    .await;
    assert_eq!(
        next_events(&mut conn).await.unwrap(),
        vec![Event::Blocked("channel.flow".into())]
    );
    assert!(conn.blocked());
    assert_eq!(
        next_events(&mut conn).await.unwrap(),
        vec![Event::Unblocked]
    );
    assert!(!conn.blocked());
    let (_, (off, on)) = broker.done().await;
    let ok = |active| AMQPClass::Channel(channel::AMQPMethod::FlowOk(channel::FlowOk { active }));
    assert_eq!((off, on), (ok(false), ok(true)));
}

/// The reply a request waits for, followed in the same read by another method on
/// its channel: the request still gets its reply. The second method used to
/// overwrite it, and the request waited for good.
#[tokio::test]
async fn a_reply_is_not_overwritten_by_a_method_read_after_it() {
    let (mut conn, broker) = pair(Script::default(), |mut socket| async move {
        accept_control(&mut socket).await;
        let _declare = expect_method(&mut socket, 1).await;
        send(
            &mut socket,
            &[
                method(
                    1,
                    AMQPClass::Exchange(exchange::AMQPMethod::DeclareOk(exchange::DeclareOk {})),
                ),
                // A late answer of nothing the relay asked for.
                method(
                    1,
                    AMQPClass::Exchange(exchange::AMQPMethod::DeleteOk(exchange::DeleteOk {})),
                ),
            ],
        )
        .await;
        read_frame_within(&mut socket, Duration::from_millis(500)).await
    })
    .await;
    conn.request_timeout = Duration::from_secs(2);
    let declared = tokio::time::timeout(
        Duration::from_secs(5),
        conn.declare_exchange("orders", "topic", Declare::Active),
    )
    .await
    .expect("no answer");
    assert_eq!(declared, Ok(()));
    broker.done().await;
}

/// `amqp://[::1]:PORT/` connects to that address. The URL parser reads an IPv6
/// literal as no host at all, and the relay connected to localhost (or, later,
/// refused the URL).
#[tokio::test]
async fn an_ipv6_literal_host_is_the_address_connected_to() {
    let Ok(listener) = tokio::net::TcpListener::bind("[::1]:0").await else {
        eprintln!("no IPv6 loopback here: skipped");
        return;
    };
    let port = listener.local_addr().unwrap().port();
    let server = tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await.unwrap();
        let mut header = [0u8; 8];
        socket.read_exact(&mut header).await.unwrap();
        header
    });
    let url = format!("amqp://relay:s3cret@[::1]:{port}/%2f");
    let mut config = PublisherConfig::new(url, "orders");
    config.validate().expect("an IPv6 literal is a valid host");
    config.request_timeout = Duration::from_millis(200);
    // The handshake goes no further (the listener answers nothing): what matters is
    // that the protocol header reached the IPv6 address.
    let _ = tokio::time::timeout(
        Duration::from_secs(3),
        connect(
            &crate::amqp::session::params(&config, &Tls::SystemRoots).unwrap(),
            0,
        ),
    )
    .await;
    let header = tokio::time::timeout(Duration::from_secs(3), server)
        .await
        .expect("nothing connected to [::1]")
        .unwrap();
    assert_eq!(&header, b"AMQP\x00\x00\x09\x01");
}

/// The socket the relay opens has TCP keepalive on: a peer that vanished is noticed
/// without heartbeats.
#[tokio::test]
async fn the_socket_keeps_alive() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let tcp = TcpStream::connect(listener.local_addr().unwrap())
        .await
        .unwrap();
    let sock = socket2::SockRef::from(&tcp);
    assert!(!sock.keepalive().unwrap(), "off by default");
    set_keepalive(&tcp);
    assert!(sock.keepalive().unwrap());
    // The idle time before the first probe.
    assert_eq!(sock.tcp_keepalive_time().unwrap(), Duration::from_secs(60));
}

/// Node A refuses at `connection.open` with 530 (the user's connection limit), node B
/// does not answer: the error reported is A's connection limit, which names what to
/// do. A later unreachable node used to replace it, and mid-run it was logged at
/// DEBUG only (`run/recover.rs` now logs it at ERROR).
#[tokio::test]
async fn a_connection_limit_is_the_error_reported_over_a_later_unreachable_node() {
    let limited = broker(None, |mut socket| async move {
        greet(&mut socket, start_with(Default::default())).await;
        send(
            &mut socket,
            &[conn_frame(
                amq_protocol::protocol::connection::AMQPMethod::Tune(
                    amq_protocol::protocol::connection::Tune {
                        channel_max: 2047,
                        frame_max: 4096,
                        heartbeat: 0,
                    },
                ),
            )],
        )
        .await;
        let _tune_ok = expect_method(&mut socket, 0).await;
        let _open = expect_method(&mut socket, 0).await;
        send(
            &mut socket,
            &[connection_close(
                530,
                "NOT_ALLOWED - access to vhost '/' refused for user 'relay': connection limit (1) is reached",
            )],
        )
        .await;
        read_frame_within(&mut socket, Duration::from_millis(500)).await
    });
    // A port nothing listens on.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead = closed.local_addr().unwrap().port();
    drop(closed);
    let mut config = PublisherConfig::new(url(limited.port), "orders");
    config.urls.push(url(dead));
    let e = crate::amqp::session::connect_any(&config, &Tls::SystemRoots, 0)
        .await
        .err()
        .expect("no node connects");
    assert!(
        matches!(e, crate::PublishError::ConnectionLimit { .. }),
        "{e}"
    );
    assert!(e.to_string().contains("connection limit"), "{e}");
    limited.done().await;
}
