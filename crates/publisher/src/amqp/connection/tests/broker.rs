//! A scripted broker: a TCP listener on loopback, on a thread with a runtime of
//! its own, that plays its half of the protocol frame by frame as a test says.

use std::future::{poll_fn, Future};
use std::time::Duration;

use amq_protocol::frame::{gen_frame, parse_frame, AMQPFrame, WriteContext};
use amq_protocol::protocol::{basic, channel, confirm, connection, AMQPClass, BasicProperties};
use amq_protocol::types::{AMQPValue, FieldTable};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio::sync::oneshot;

use super::super::frame::FRAME_OVERHEAD;
use super::super::{ConnError, Connection, Event};
use crate::amqp::config::PublisherConfig;
use crate::error::PublishError;
use crate::tls::Tls;

/// How long a whole broker script may take, and a test may wait for one.
const SCRIPT_LIMIT: Duration = Duration::from_secs(10);
/// The most a test waits for an event it expects.
pub(super) const EVENT_LIMIT: Duration = Duration::from_secs(3);

/// A broker thread and what its script returns.
pub(super) struct Broker<T> {
    pub(super) port: u16,
    done: oneshot::Receiver<T>,
}

impl<T> Broker<T> {
    /// What the script returned (bounded: a script that fails or hangs fails the test).
    pub(super) async fn done(self) -> T {
        match tokio::time::timeout(SCRIPT_LIMIT, self.done).await {
            Ok(Ok(value)) => value,
            Ok(Err(_)) => panic!("the broker's script failed (its panic is printed above)"),
            Err(_) => panic!("the broker's script did not end within {SCRIPT_LIMIT:?}"),
        }
    }
}

/// Starts a broker that accepts one connection and runs `script` on it. With
/// `rcvbuf`, the accepted socket's receive buffer is that small.
pub(super) fn broker<T, F, Fut>(rcvbuf: Option<u32>, script: F) -> Broker<T>
where
    T: Send + 'static,
    F: FnOnce(TcpStream) -> Fut + Send + 'static,
    Fut: Future<Output = T>,
{
    let (port_tx, port_rx) = std::sync::mpsc::channel();
    let (done_tx, done) = oneshot::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async move {
            let socket = TcpSocket::new_v4().unwrap();
            if let Some(size) = rcvbuf {
                socket.set_recv_buffer_size(size).unwrap();
            }
            socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
            let listener = socket.listen(1).unwrap();
            port_tx.send(listener.local_addr().unwrap().port()).unwrap();
            let run = async {
                let (stream, _) = listener.accept().await.unwrap();
                script(stream).await
            };
            let value = tokio::time::timeout(SCRIPT_LIMIT, run)
                .await
                .expect("the broker's script did not end in time");
            let _ = done_tx.send(value);
        });
    });
    let port = port_rx
        .recv_timeout(Duration::from_secs(5))
        .expect("the broker did not start");
    Broker { port, done }
}

pub(super) fn url(port: u16) -> String {
    format!("amqp://relay:s3cret@127.0.0.1:{port}/%2f")
}

/// Connects and logs in as the relay does (`handshake::connect`).
pub(super) async fn connect_to(port: u16) -> Result<Connection, PublishError> {
    let mut config = PublisherConfig::new(url(port), "orders");
    config.connection_name = "relay test".into();
    crate::amqp::session::connect_to(
        &crate::amqp::session::params(&config, &Tls::SystemRoots).unwrap(),
        0,
    )
    .await
}

pub(super) fn encoded(frame: &AMQPFrame) -> Vec<u8> {
    gen_frame(frame)(WriteContext::from(Vec::new()))
        .unwrap()
        .write
}

/// The next frame the client sent (parsed by the codec: the client sends methods
/// the connection's own reader refuses from a broker).
pub(super) async fn read_frame(socket: &mut TcpStream) -> AMQPFrame {
    let mut head = [0u8; 7];
    socket.read_exact(&mut head).await.unwrap();
    let size = u32::from_be_bytes([head[3], head[4], head[5], head[6]]) as usize;
    let mut whole = head.to_vec();
    whole.resize(7 + size + 1, 0);
    socket.read_exact(&mut whole[7..]).await.unwrap();
    match parse_frame(whole.as_slice()) {
        Ok((&[], frame)) => frame,
        other => panic!("the client sent a frame that does not parse: {other:?}"),
    }
}

/// What the broker read of one publish: routing key, message id, body.
pub(super) type Seen = (String, String, Vec<u8>);

/// Reads one publish (method, header, body frames) on `ch`.
pub(super) async fn read_publish(socket: &mut TcpStream, ch: u16, frame_max: usize) -> Seen {
    let publish = match read_frame(socket).await {
        AMQPFrame::Method(c, AMQPClass::Basic(basic::AMQPMethod::Publish(p))) if c == ch => p,
        other => panic!("expected a publish on channel {ch}, got {other:?}"),
    };
    assert!(publish.mandatory);
    let header = match read_frame(socket).await {
        AMQPFrame::Header(c, header) if c == ch => header,
        other => panic!("expected a content header on channel {ch}, got {other:?}"),
    };
    let mut body = Vec::new();
    while (body.len() as u64) < header.body_size {
        match read_frame(socket).await {
            AMQPFrame::Body(c, piece) if c == ch => {
                assert!(piece.len() + FRAME_OVERHEAD <= frame_max);
                body.extend_from_slice(&piece);
            }
            other => panic!("expected a body frame, got {other:?}"),
        }
    }
    let id = header.properties.message_id().clone().unwrap().to_string();
    (publish.routing_key.to_string(), id, body)
}

/// The next frame within `limit`, or `None`.
pub(super) async fn read_frame_within(
    socket: &mut TcpStream,
    limit: Duration,
) -> Option<AMQPFrame> {
    tokio::time::timeout(limit, read_frame(socket)).await.ok()
}

/// Writes `frames` in one write.
pub(super) async fn send(socket: &mut TcpStream, frames: &[AMQPFrame]) {
    let mut out = Vec::new();
    for frame in frames {
        out.extend_from_slice(&encoded(frame));
    }
    socket.write_all(&out).await.unwrap();
}

pub(super) fn method(ch: u16, class: AMQPClass) -> AMQPFrame {
    AMQPFrame::Method(ch, class)
}

pub(super) fn conn_frame(m: connection::AMQPMethod) -> AMQPFrame {
    method(0, AMQPClass::Connection(m))
}

pub(super) fn ack(ch: u16, tag: u64, multiple: bool) -> AMQPFrame {
    method(
        ch,
        AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
            delivery_tag: tag,
            multiple,
        })),
    )
}

pub(super) fn connection_close(code: u16, text: &str) -> AMQPFrame {
    conn_frame(connection::AMQPMethod::Close(connection::Close {
        reply_code: code,
        reply_text: text.into(),
        class_id: 0,
        method_id: 0,
    }))
}

pub(super) fn start_with(server_properties: FieldTable) -> AMQPFrame {
    conn_frame(connection::AMQPMethod::Start(connection::Start {
        version_major: 0,
        version_minor: 9,
        server_properties,
        mechanisms: "PLAIN AMQPLAIN".into(),
        locales: "en_US".into(),
    }))
}

pub(super) fn properties(id: &str) -> BasicProperties {
    BasicProperties::default()
        .with_message_id(id.into())
        .with_delivery_mode(2)
}

/// Expects a method frame on `ch` and returns it.
pub(super) async fn expect_method(socket: &mut TcpStream, ch: u16) -> AMQPClass {
    match read_frame(socket).await {
        AMQPFrame::Method(c, m) if c == ch => m,
        other => panic!("expected a method on channel {ch}, got {other:?}"),
    }
}

/// The reply code of the `connection.close` the client sends next (`None`: it
/// sent another frame, or nothing within `limit`, or closed the socket).
pub(super) async fn close_code_within(socket: &mut TcpStream, limit: Duration) -> Option<u16> {
    let read = async {
        loop {
            let mut head = [0u8; 7];
            socket.read_exact(&mut head).await.ok()?;
            let size = u32::from_be_bytes([head[3], head[4], head[5], head[6]]) as usize;
            let mut whole = head.to_vec();
            whole.resize(7 + size + 1, 0);
            socket.read_exact(&mut whole[7..]).await.ok()?;
            match parse_frame(whole.as_slice()) {
                Ok((
                    _,
                    AMQPFrame::Method(0, AMQPClass::Connection(connection::AMQPMethod::Close(c))),
                )) => return Some(c.reply_code),
                // Publishes and heartbeats the client sent before its close.
                Ok(_) => continue,
                Err(_) => return None,
            }
        }
    };
    tokio::time::timeout(limit, read).await.ok().flatten()
}

/// The first `channel.close` the client sends within `limit`: its channel and code
/// (what else it sends before is skipped).
pub(super) async fn channel_close_within(
    socket: &mut TcpStream,
    limit: Duration,
) -> Option<(u16, u16)> {
    let read = async {
        loop {
            let mut head = [0u8; 7];
            socket.read_exact(&mut head).await.ok()?;
            let size = u32::from_be_bytes([head[3], head[4], head[5], head[6]]) as usize;
            let mut whole = head.to_vec();
            whole.resize(7 + size + 1, 0);
            socket.read_exact(&mut whole[7..]).await.ok()?;
            match parse_frame(whole.as_slice()) {
                Ok((
                    _,
                    AMQPFrame::Method(ch, AMQPClass::Channel(channel::AMQPMethod::Close(c))),
                )) => return Some((ch, c.reply_code)),
                Ok((
                    _,
                    AMQPFrame::Method(0, AMQPClass::Connection(connection::AMQPMethod::Close(_))),
                )) => return None,
                Ok(_) => continue,
                Err(_) => return None,
            }
        }
    };
    tokio::time::timeout(limit, read).await.ok().flatten()
}

/// The broker's half of the protocol header and `connection.start`; returns the
/// client's start-ok.
pub(super) async fn greet(socket: &mut TcpStream, start: AMQPFrame) -> connection::StartOk {
    let mut header = [0u8; 8];
    socket.read_exact(&mut header).await.unwrap();
    assert_eq!(&header, b"AMQP\x00\x00\x09\x01");
    send(socket, &[start]).await;
    match expect_method(socket, 0).await {
        AMQPClass::Connection(connection::AMQPMethod::StartOk(ok)) => ok,
        other => panic!("expected start-ok, got {other:?}"),
    }
}

/// The broker's half of tune and `connection.open`; returns the client's tune-ok.
pub(super) async fn tune_and_open(
    socket: &mut TcpStream,
    frame_max: u32,
    heartbeat: u16,
) -> connection::TuneOk {
    send(
        socket,
        &[conn_frame(connection::AMQPMethod::Tune(connection::Tune {
            channel_max: 2047,
            frame_max,
            heartbeat,
        }))],
    )
    .await;
    let tune_ok = match expect_method(socket, 0).await {
        AMQPClass::Connection(connection::AMQPMethod::TuneOk(ok)) => ok,
        other => panic!("expected tune-ok, got {other:?}"),
    };
    match expect_method(socket, 0).await {
        AMQPClass::Connection(connection::AMQPMethod::Open(open)) => {
            assert_eq!(open.virtual_host.as_str(), "/")
        }
        other => panic!("expected open, got {other:?}"),
    }
    send(
        socket,
        &[conn_frame(connection::AMQPMethod::OpenOk(
            connection::OpenOk {},
        ))],
    )
    .await;
    tune_ok
}

/// What the broker saw of the login.
#[derive(Debug)]
pub(super) struct Login {
    /// The SASL response (PLAIN: `\0user\0password`).
    pub(super) response: String,
    pub(super) tune_ok: connection::TuneOk,
}

/// The broker's half of the whole handshake.
pub(super) async fn accept(socket: &mut TcpStream, frame_max: u32, heartbeat: u16) -> Login {
    let ok = greet(socket, start_with(FieldTable::default())).await;
    assert_eq!(ok.mechanism.as_str(), "PLAIN");
    assert_eq!(
        ok.client_properties.inner().get("connection_name").cloned(),
        Some(AMQPValue::LongString("relay test".into())),
        "the connection is named"
    );
    let response = String::from_utf8_lossy(ok.response.as_bytes()).into_owned();
    let tune_ok = tune_and_open(socket, frame_max, heartbeat).await;
    Login { response, tune_ok }
}

/// The broker's half of opening channel `ch` in confirm mode; `with_open_ok` and
/// `with_select_ok` go out in the same write as `channel.open-ok` and
/// `confirm.select-ok`.
pub(super) async fn accept_channel(
    socket: &mut TcpStream,
    ch: u16,
    with_open_ok: &[AMQPFrame],
    with_select_ok: &[AMQPFrame],
) {
    assert!(matches!(
        expect_method(socket, ch).await,
        AMQPClass::Channel(channel::AMQPMethod::Open(_))
    ));
    let mut frames = vec![method(
        ch,
        AMQPClass::Channel(channel::AMQPMethod::OpenOk(channel::OpenOk {})),
    )];
    frames.extend_from_slice(with_open_ok);
    send(socket, &frames).await;
    assert!(matches!(
        expect_method(socket, ch).await,
        AMQPClass::Confirm(confirm::AMQPMethod::Select(_))
    ));
    let mut frames = vec![method(
        ch,
        AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(confirm::SelectOk {})),
    )];
    frames.extend_from_slice(with_select_ok);
    send(socket, &frames).await;
}

/// How a [`pair`]'s broker behaves.
pub(super) struct Script {
    /// The broker's `frame_max` in `connection.tune`.
    pub(super) frame_max: u32,
    pub(super) heartbeat: u16,
    /// Frames sent in the same write as the publishing channel's open-ok.
    pub(super) with_open_ok: Vec<AMQPFrame>,
    /// Frames sent in the same write as the publishing channel's select-ok.
    pub(super) with_select_ok: Vec<AMQPFrame>,
    /// The broker socket's receive buffer.
    pub(super) rcvbuf: Option<u32>,
}

impl Default for Script {
    fn default() -> Self {
        Script {
            frame_max: 4096,
            heartbeat: 0,
            with_open_ok: Vec::new(),
            with_select_ok: Vec::new(),
            rcvbuf: None,
        }
    }
}

/// A connection logged in, its publishing channel (2) open, and the broker running
/// `then` afterwards; the broker's result is the login and what `then` returned.
pub(super) async fn pair<T, F, Fut>(script: Script, then: F) -> (Connection, Broker<(Login, T)>)
where
    T: Send + 'static,
    F: FnOnce(TcpStream) -> Fut + Send + 'static,
    Fut: Future<Output = T>,
{
    let Script {
        frame_max,
        heartbeat,
        with_open_ok,
        with_select_ok,
        rcvbuf,
    } = script;
    let broker = broker(rcvbuf, move |mut socket| async move {
        let login = accept(&mut socket, frame_max, heartbeat).await;
        accept_channel(&mut socket, 2, &with_open_ok, &with_select_ok).await;
        (login, then(socket).await)
    });
    let mut connection = tokio::time::timeout(EVENT_LIMIT, connect_to(broker.port))
        .await
        .expect("the handshake did not end in time")
        .expect("the handshake failed");
    tokio::time::timeout(EVENT_LIMIT, connection.open_channel())
        .await
        .expect("the channel did not open in time")
        .expect("the channel did not open");
    (connection, broker)
}

/// What the next `poll_io` that is ready gives, within `limit` (`None`: nothing).
pub(super) async fn events_within(
    connection: &mut Connection,
    limit: Duration,
) -> Option<Result<Vec<Event>, ConnError>> {
    tokio::time::timeout(limit, poll_fn(|cx| connection.poll_io(cx)))
        .await
        .ok()
}

/// The next events (bounded: nothing within [`EVENT_LIMIT`] fails the test).
pub(super) async fn next_events(connection: &mut Connection) -> Result<Vec<Event>, ConnError> {
    events_within(connection, EVENT_LIMIT)
        .await
        .expect("the connection reported nothing in time")
}

/// The broker's half of opening the control channel.
pub(super) async fn accept_control(socket: &mut TcpStream) {
    assert!(
        matches!(
            expect_method(socket, 1).await,
            AMQPClass::Channel(channel::AMQPMethod::Open(_))
        ),
        "the control channel is opened first"
    );
    send(
        socket,
        &[method(
            1,
            AMQPClass::Channel(channel::AMQPMethod::OpenOk(channel::OpenOk {})),
        )],
    )
    .await;
}
