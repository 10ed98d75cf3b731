//! Opening a connection: the socket, the protocol header, the login (PLAIN,
//! AMQPLAIN, EXTERNAL or ANONYMOUS, as the URL's `auth_mechanism` says; a
//! `connection.secure` challenge is answered), tune and the virtual host; and the
//! what can go wrong, told apart for the publisher to sort into the errors an
//! operator reads ([`ConnectError`]; `crate::amqp::session`).

use std::time::Duration;

use amq_protocol::frame::{AMQPFrame, ProtocolVersion};
use amq_protocol::protocol::{connection, AMQPClass};
use amq_protocol::types::{AMQPValue, FieldTable, LongString, ShortString};
use amq_protocol::uri::{AMQPUri, SASLMechanism};
use tokio::time::Instant;

use super::frame::negotiate_frame_max;
use super::socket::{self, OpenError};
use super::{frame, ConnError, Connection, Params};

/// Bound on one connection attempt (TCP, TLS, AMQP handshake).
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(15);

/// A handshake failure, with how far the handshake got.
enum Failed {
    /// Before the broker had the credentials.
    BeforeLogin(ConnError),
    /// After it had them.
    AfterLogin(ConnError),
}

/// Why a connection could not be opened, as the connection knows it; the publisher
/// sorts it into the errors operators read (`crate::amqp::session`).
#[derive(Debug)]
pub(crate) enum ConnectError {
    /// The URL cannot be parsed (the parser's text, which may quote the URL).
    BadUrl(String),
    /// The socket or the handshake failed, before the broker had the credentials
    /// or after.
    Handshake { error: ConnError, after_login: bool },
    /// No answer within [`CONNECT_TIMEOUT`].
    Timeout,
}

/// Opens a connection to `params.urls[index]` and logs in.
pub(crate) async fn connect(params: &Params, index: usize) -> Result<Connection, ConnectError> {
    let url = params.url(index);
    let uri: AMQPUri = url.parse().map_err(ConnectError::BadUrl)?;
    let setup = async {
        let socket = socket::open(url, &uri, params)
            .await
            .map_err(|OpenError::Io(text)| Failed::BeforeLogin(ConnError::Io(text)))?;
        let mut connection = Connection::new(socket, index);
        connection.request_timeout = params.request_timeout;
        connection.handshake(&uri, &params.name).await?;
        Ok::<_, Failed>(connection)
    };
    match tokio::time::timeout(CONNECT_TIMEOUT, setup).await {
        Ok(Ok(connection)) => Ok(connection),
        Ok(Err(Failed::BeforeLogin(error))) => Err(ConnectError::Handshake {
            error,
            after_login: false,
        }),
        Ok(Err(Failed::AfterLogin(error))) => Err(ConnectError::Handshake {
            error,
            after_login: true,
        }),
        Err(_) => Err(ConnectError::Timeout),
    }
}

impl Connection {
    async fn handshake(&mut self, uri: &AMQPUri, name: &str) -> Result<(), Failed> {
        self.push_frame(&AMQPFrame::ProtocolHeader(ProtocolVersion::amqp_0_9_1()));
        self.flush().await.map_err(Failed::BeforeLogin)?;
        let start = match self
            .expect(0, |m| {
                matches!(m, AMQPClass::Connection(connection::AMQPMethod::Start(_)))
            })
            .await
        {
            Ok(AMQPClass::Connection(connection::AMQPMethod::Start(s))) => s,
            Ok(_) => unreachable_reply(),
            Err(ConnError::Io(e)) => {
                return Err(Failed::BeforeLogin(ConnError::Io(format!(
                    "the broker did not start an AMQP 0-9-1 connection: {e}"
                ))))
            }
            Err(e) => return Err(Failed::BeforeLogin(e)),
        };
        let mechanism = uri.query.auth_mechanism.unwrap_or(SASLMechanism::Plain);
        let offered = start.mechanisms.to_string();
        if !offered.split_whitespace().any(|m| m == mechanism.name()) {
            return Err(Failed::AfterLogin(ConnError::Closed {
                code: 403,
                text: format!(
                    "ACCESS_REFUSED - the broker does not offer {} (it offers {offered})",
                    mechanism.name()
                ),
            }));
        }
        let credentials = amq_protocol::auth::Credentials::new(
            uri.authority.userinfo.username.clone().into(),
            uri.authority.userinfo.password.clone().into(),
        );
        let response = credentials.sasl_auth_string(mechanism);
        self.push_frame(&AMQPFrame::Method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
                client_properties: client_properties(name),
                mechanism: ShortString::from(mechanism.name()),
                response: response.clone(),
                locale: ShortString::from("en_US"),
            })),
        ));
        let tune = loop {
            self.flush().await.map_err(Failed::AfterLogin)?;
            let reply = self
                .expect(0, |m| {
                    matches!(
                        m,
                        AMQPClass::Connection(
                            connection::AMQPMethod::Tune(_) | connection::AMQPMethod::Secure(_)
                        )
                    )
                })
                .await
                .map_err(Failed::AfterLogin)?;
            match reply {
                AMQPClass::Connection(connection::AMQPMethod::Tune(t)) => break t,
                AMQPClass::Connection(connection::AMQPMethod::Secure(_)) => {
                    let answer = match mechanism {
                        SASLMechanism::RabbitCrDemo => LongString::from(format!(
                            "My password is {}",
                            uri.authority.userinfo.password
                        )),
                        _ => response.clone(),
                    };
                    self.push_frame(&AMQPFrame::Method(
                        0,
                        AMQPClass::Connection(connection::AMQPMethod::SecureOk(
                            connection::SecureOk { response: answer },
                        )),
                    ));
                }
                _ => unreachable_reply(),
            }
        };
        self.tune(uri, &tune);
        self.call(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Open(connection::Open {
                virtual_host: ShortString::from(uri.vhost.as_str()),
            })),
            |m| matches!(m, AMQPClass::Connection(connection::AMQPMethod::OpenOk(_))),
        )
        .await
        .map_err(Failed::AfterLogin)?;
        let now = Instant::now();
        self.last_read = now;
        self.last_write = now;
        Ok(())
    }

    /// Settles the frame size, channels and heartbeat, and answers with tune-ok.
    fn tune(&mut self, uri: &AMQPUri, tune: &connection::Tune) {
        self.frame_max = negotiate_frame_max(uri.query.frame_max, tune.frame_max);
        // The lower of the two, or the non-zero one when either side asks for none
        // (AMQP 0-9-1 `connection.tune-ok`; the Java and Go clients do the same): a
        // URL's `heartbeat=0` does not switch off the heartbeats a broker asks for.
        let heartbeat = frame::negotiate(
            u32::from(uri.query.heartbeat.unwrap_or(0)),
            u32::from(tune.heartbeat),
        );
        let heartbeat = u16::try_from(heartbeat).unwrap_or(u16::MAX);
        self.heartbeat = (heartbeat > 0).then(|| Duration::from_secs(u64::from(heartbeat)));
        let channel_max = frame::negotiate(
            u32::from(uri.query.channel_max.unwrap_or(0)),
            u32::from(tune.channel_max),
        );
        let channel_max = u16::try_from(channel_max).unwrap_or(u16::MAX);
        self.channel_max = if channel_max == 0 {
            u16::MAX
        } else {
            channel_max
        };
        self.push_frame(&AMQPFrame::Method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::TuneOk(connection::TuneOk {
                channel_max,
                frame_max: self.frame_max,
                heartbeat,
            })),
        ));
    }
}

#[cfg(test)]
impl Connection {
    /// The handshake alone, on a socket a test made (the simulation's): what went
    /// wrong as the connection's error.
    pub(super) async fn handshake_on(&mut self, uri: &AMQPUri) -> Result<(), ConnError> {
        self.handshake(uri, "sim").await.map_err(|e| match e {
            Failed::BeforeLogin(e) | Failed::AfterLogin(e) => e,
        })
    }
}

/// `expect` returned a method its filter does not accept: it cannot.
fn unreachable_reply() -> ! {
    unreachable!("expect returns only the methods its filter accepts")
}

fn client_properties(name: &str) -> FieldTable {
    let mut capabilities = FieldTable::default();
    for capability in [
        "publisher_confirms",
        "basic.nack",
        "connection.blocked",
        "authentication_failure_close",
    ] {
        capabilities.insert(capability.into(), AMQPValue::Boolean(true));
    }
    let mut properties = FieldTable::default();
    let text = |s: &str| AMQPValue::LongString(LongString::from(s));
    properties.insert("product".into(), text("outbox-relay"));
    properties.insert("version".into(), text(env!("CARGO_PKG_VERSION")));
    properties.insert("platform".into(), text("rust"));
    properties.insert("connection_name".into(), text(name));
    properties.insert("capabilities".into(), AMQPValue::FieldTable(capabilities));
    properties
}
