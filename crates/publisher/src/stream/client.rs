//! The stream client in the two versions the relay speaks (docs/streams.md, "Client and
//! broker versions"): rabbitmq-stream-client 0.11 for RabbitMQ 3.11 and later, and 0.4
//! (`rabbitmq_stream_client_legacy`) for 3.9 and 3.10. Every client after 0.4 sends
//! `exchange_command_versions` while connecting, a command 3.10 does not know and
//! answers by closing the connection, so the version is chosen from the broker's
//! `version` peer property, read by `tune.rs` before the client connects.
//!
//! [`StreamClient`] has the few requests the publisher makes, with one error type
//! ([`ClientFailure`], whose code is the current crate's) and one message type (the
//! current crate's [`Message`]; the legacy client gets a copy, [`legacy_message`]).

use std::collections::HashMap;
use std::fmt;

use rabbitmq_stream_client as current;
use rabbitmq_stream_client::types::{Message, ResponseCode};
use rabbitmq_stream_client_legacy as legacy;
use rabbitmq_stream_protocol::codec::Encoder;
use rabbitmq_stream_protocol_legacy::codec::Decoder;
use tokio::sync::mpsc;

pub(super) use super::events::{BrokerEvent, ClientFailure};

/// Which client a broker needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ClientVersion {
    /// rabbitmq-stream-client 0.11: RabbitMQ 3.11 and later (and a broker that does
    /// not say its version).
    Current,
    /// rabbitmq-stream-client 0.4: RabbitMQ before 3.11.
    Legacy,
    /// The relay's own connection on `rabbitmq-stream-protocol` 0.11 (`raw.rs`): with
    /// `[rabbitmq] stream_filter_value`, which only publish v2 of RabbitMQ 3.13 and
    /// later carries.
    Filtering,
}

impl ClientVersion {
    /// The client for a broker reporting `version` (its `version` peer property,
    /// `"3.10.8"`, `"4.0.5"`).
    pub fn for_broker(version: Option<&str>) -> Self {
        match version.and_then(major_minor) {
            Some((major, minor)) if (major, minor) < (3, 11) => ClientVersion::Legacy,
            _ => ClientVersion::Current,
        }
    }
}

/// The first RabbitMQ that stores a filter value with a message (publish v2).
pub(super) const FILTER_MIN_VERSION: (u32, u32) = (3, 13);

/// Why a broker reporting `version` cannot take `[rabbitmq] stream_filter_value`, in
/// one sentence naming the version and the fix; `None` when it can (3.13 or later,
/// or a broker that does not say its version: its answer to publish v2 tells).
pub(super) fn filter_refusal(version: Option<&str>) -> Option<String> {
    let v = version?;
    match major_minor(v) {
        Some(mm) if mm < FILTER_MIN_VERSION => Some(format!(
            "the stream broker runs RabbitMQ {v}, which cannot store filter values (RabbitMQ 3.13 or later can): upgrade the broker to RabbitMQ 3.13 or later, or remove stream_filter_value"
        )),
        _ => None,
    }
}

/// `(major, minor)` of a version such as `3.10.8` or `4.0.5+rc.1`.
pub(super) fn major_minor(version: &str) -> Option<(u32, u32)> {
    let mut parts = version.split(['.', '-', '+']);
    let major = parts.next()?.trim().parse().ok()?;
    let minor = parts.next()?.trim().parse().ok()?;
    Some((major, minor))
}

impl From<current::error::ClientError> for ClientFailure {
    fn from(e: current::error::ClientError) -> Self {
        let code = match &e {
            current::error::ClientError::RequestError(code) => Some(code.clone()),
            _ => None,
        };
        ClientFailure {
            code,
            text: e.to_string(),
        }
    }
}

impl From<legacy::error::ClientError> for ClientFailure {
    fn from(e: legacy::error::ClientError) -> Self {
        let code = match &e {
            legacy::error::ClientError::RequestError(code) => Some(legacy_code(code)),
            _ => None,
        };
        ClientFailure {
            code,
            text: e.to_string(),
        }
    }
}

/// The current crate's code for a legacy one (same wire number).
fn legacy_code(code: &legacy::types::ResponseCode) -> ResponseCode {
    ResponseCode::try_from(u16::from(code)).unwrap_or(ResponseCode::InternalError)
}

/// One stream-protocol connection.
#[derive(Clone)]
pub(crate) enum StreamClient {
    Current(current::Client),
    Legacy(legacy::Client),
    Filtering(super::raw::RawClient),
}

impl StreamClient {
    pub async fn close(&self) {
        let _ = match self {
            StreamClient::Current(c) => c.close().await.map_err(ClientFailure::from),
            StreamClient::Legacy(c) => c.close().await.map_err(ClientFailure::from),
            StreamClient::Filtering(c) => {
                c.close().await;
                Ok(())
            }
        };
    }

    /// The stream's code in a metadata answer, and its leader's host and port.
    pub async fn metadata(
        &self,
        stream: &str,
    ) -> Result<Option<(ResponseCode, String, u32)>, ClientFailure> {
        let streams = vec![stream.to_string()];
        Ok(match self {
            StreamClient::Current(c) => c
                .metadata(streams)
                .await?
                .remove(stream)
                .map(|m| (m.response_code, m.leader.host, m.leader.port)),
            StreamClient::Legacy(c) => c
                .metadata(streams)
                .await?
                .remove(stream)
                .map(|m| (legacy_code(&m.response_code), m.leader.host, m.leader.port)),
            StreamClient::Filtering(c) => c.metadata(stream).await?,
        })
    }

    pub async fn create_stream(
        &self,
        stream: &str,
        arguments: HashMap<String, String>,
    ) -> Result<ResponseCode, ClientFailure> {
        Ok(match self {
            StreamClient::Current(c) => c.create_stream(stream, arguments).await?.code().clone(),
            StreamClient::Legacy(c) => {
                legacy_code(c.create_stream(stream, arguments).await?.code())
            }
            StreamClient::Filtering(c) => c.create_stream(stream, arguments).await?,
        })
    }

    pub async fn declare_publisher(
        &self,
        publisher_id: u8,
        reference: Option<String>,
        stream: &str,
    ) -> Result<ResponseCode, ClientFailure> {
        Ok(match self {
            StreamClient::Current(c) => c
                .declare_publisher(publisher_id, reference, stream)
                .await?
                .code()
                .clone(),
            StreamClient::Legacy(c) => legacy_code(
                c.declare_publisher(publisher_id, reference, stream)
                    .await?
                    .code(),
            ),
            StreamClient::Filtering(c) => {
                c.declare_publisher(publisher_id, reference, stream).await?
            }
        })
    }

    pub async fn query_publisher_sequence(
        &self,
        reference: &str,
        stream: &str,
    ) -> Result<u64, ClientFailure> {
        Ok(match self {
            StreamClient::Current(c) => c.query_publisher_sequence(reference, stream).await?,
            StreamClient::Legacy(c) => c.query_publisher_sequence(reference, stream).await?,
            StreamClient::Filtering(c) => c.query_publisher_sequence(reference, stream).await?,
        })
    }

    /// Publishes `messages` (each with its publishing id set) in one frame: publish v1,
    /// or v2 with each message's filter value on a [`StreamClient::Filtering`]
    /// connection (the other clients ignore the values, which are `None` without
    /// `stream_filter_value`).
    pub async fn publish(
        &self,
        publisher_id: u8,
        messages: Vec<(Message, Option<String>)>,
    ) -> Result<(), ClientFailure> {
        match self {
            StreamClient::Current(c) => {
                let messages: Vec<Message> = messages.into_iter().map(|(m, _)| m).collect();
                c.publish(publisher_id, messages, 1).await.map(drop)?
            }
            StreamClient::Filtering(c) => c.publish(publisher_id, messages).await?,
            StreamClient::Legacy(c) => {
                let copies: Vec<legacy::types::Message> = messages
                    .iter()
                    .map(|(m, _)| legacy_message(m))
                    .collect::<Result<_, _>>()?;
                c.publish(publisher_id, copies).await.map(drop)?
            }
        }
        Ok(())
    }

    /// Forwards the broker's confirms, refusals and closes to `tx`.
    pub async fn forward_events(&self, tx: mpsc::UnboundedSender<BrokerEvent>) {
        match self {
            StreamClient::Filtering(c) => c.forward_events(tx).await,
            StreamClient::Current(c) => {
                let forward = move |item: current::types::MessageResult| {
                    let tx = tx.clone();
                    async move {
                        let event = match item {
                            Some(Ok(response)) => {
                                use current::types::ResponseKind as K;
                                match response.kind() {
                                    K::PublishConfirm(c) => Some(BrokerEvent::Confirmed(
                                        c.publisher_id,
                                        c.publishing_ids,
                                    )),
                                    K::PublishError(e) => Some(BrokerEvent::Refused(
                                        e.publisher_id,
                                        e.publishing_errors
                                            .into_iter()
                                            .map(|p| (p.publishing_id, p.error_code))
                                            .collect(),
                                    )),
                                    K::MetadataUpdate(m) => Some(changed(&m)),
                                    K::Close(c) => Some(closed(&c)),
                                    _ => None,
                                }
                            }
                            Some(Err(e)) => Some(BrokerEvent::Closed(e.to_string())),
                            None => Some(BrokerEvent::Closed("connection closed".into())),
                        };
                        if let Some(event) = event {
                            let _ = tx.send(event);
                        }
                        Ok(())
                    }
                };
                c.set_handler(forward).await;
            }
            StreamClient::Legacy(c) => {
                let forward = move |item: legacy::types::MessageResult| {
                    let tx = tx.clone();
                    async move {
                        let event = match item {
                            Some(Ok(response)) => {
                                use legacy::types::ResponseKind as K;
                                match response.kind() {
                                    K::PublishConfirm(c) => Some(BrokerEvent::Confirmed(
                                        c.publisher_id,
                                        c.publishing_ids,
                                    )),
                                    K::PublishError(e) => Some(BrokerEvent::Refused(
                                        e.publisher_id,
                                        e.publishing_errors
                                            .into_iter()
                                            .map(|p| (p.publishing_id, legacy_code(&p.error_code)))
                                            .collect(),
                                    )),
                                    K::MetadataUpdate(m) => Some(changed(&m)),
                                    K::Close(c) => Some(closed(&c)),
                                    _ => None,
                                }
                            }
                            Some(Err(e)) => Some(BrokerEvent::Closed(e.to_string())),
                            None => Some(BrokerEvent::Closed("connection closed".into())),
                        };
                        if let Some(event) = event {
                            let _ = tx.send(event);
                        }
                        Ok(())
                    }
                };
                c.set_handler(forward).await;
            }
        }
    }
}

fn changed(m: &impl fmt::Debug) -> BrokerEvent {
    BrokerEvent::Closed(format!("the broker reports a change of the stream ({m:?})"))
}

fn closed(c: &impl fmt::Debug) -> BrokerEvent {
    BrokerEvent::Closed(format!("the broker closed the connection ({c:?})"))
}

/// The legacy client's copy of `message`: the same AMQP 1.0 bytes decoded by the
/// legacy codec, built again with the publishing id (the only way into its builder).
pub(super) fn legacy_message(message: &Message) -> Result<legacy::types::Message, ClientFailure> {
    let failure = |what: String| ClientFailure {
        code: None,
        text: format!("cannot copy a message for the RabbitMQ 3.10 client: {what}"),
    };
    let mut bytes = Vec::with_capacity(message.encoded_size() as usize);
    message
        .encode(&mut bytes)
        .map_err(|e| failure(format!("{e:?}")))?;
    let (_, decoded) =
        legacy::types::Message::decode(&bytes).map_err(|e| failure(format!("{e:?}")))?;
    let mut builder = legacy::types::Message::builder();
    if let Some(data) = decoded.data() {
        builder = builder.body(data.to_vec());
    }
    if let Some(p) = decoded.properties() {
        let mut props = builder.properties();
        if let Some(id) = &p.message_id {
            props = props.message_id(id.clone());
        }
        if let Some(ct) = &p.content_type {
            props = props.content_type(ct.clone());
        }
        if let Some(t) = &p.creation_time {
            props = props.creation_time(t.clone());
        }
        builder = props.message_builder();
    }
    if let Some(app) = decoded.application_properties() {
        let mut a = builder.application_properties();
        for (k, v) in app.iter() {
            a = a.insert(k.clone(), v.clone());
        }
        builder = a.message_builder();
    }
    if let Some(id) = message.publishing_id() {
        builder = builder.publising_id(*id);
    }
    Ok(builder.build())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use rabbitmq_stream_client::types::SimpleValue;
    use rabbitmq_stream_protocol_legacy::codec::Encoder as LegacyEncoder;

    #[test]
    fn the_broker_version_picks_the_client() {
        assert_eq!(
            ClientVersion::for_broker(Some("3.10.8")),
            ClientVersion::Legacy
        );
        assert_eq!(
            ClientVersion::for_broker(Some("3.9.29")),
            ClientVersion::Legacy
        );
        assert_eq!(
            ClientVersion::for_broker(Some("3.11.0")),
            ClientVersion::Current
        );
        assert_eq!(
            ClientVersion::for_broker(Some("3.13.7")),
            ClientVersion::Current
        );
        assert_eq!(
            ClientVersion::for_broker(Some("4.0.5")),
            ClientVersion::Current
        );
        assert_eq!(
            ClientVersion::for_broker(Some("4.1.0-rc.1")),
            ClientVersion::Current
        );
        assert_eq!(ClientVersion::for_broker(None), ClientVersion::Current);
        assert_eq!(
            ClientVersion::for_broker(Some("junk")),
            ClientVersion::Current
        );
        assert_eq!(major_minor("3.10.8"), Some((3, 10)));
    }

    /// `stream_filter_value` needs RabbitMQ 3.13: older brokers are refused in one
    /// sentence naming their version and the fix.
    #[test]
    fn filter_values_need_rabbitmq_3_13() {
        for old in ["3.10.8", "3.11.28", "3.12.14", "3.9.0"] {
            let why = filter_refusal(Some(old)).unwrap();
            assert!(why.contains(&format!("RabbitMQ {old}")), "{why}");
            assert!(
                why.contains("upgrade the broker to RabbitMQ 3.13 or later"),
                "{why}"
            );
            assert!(why.contains("remove stream_filter_value"), "{why}");
        }
        for new in ["3.13.0", "3.13.7", "4.0.5", "4.1.0-rc.1"] {
            assert_eq!(filter_refusal(Some(new)), None, "{new}");
        }
        assert_eq!(filter_refusal(None), None);
    }

    /// Every property the publisher sets survives the copy: the same size (the frame
    /// arithmetic holds) and the same message decoded (application properties are a
    /// map: their order on the wire may differ).
    #[test]
    fn the_legacy_copy_encodes_the_same_bytes() {
        let time = chrono::DateTime::from_timestamp_micros(1_700_000_000_123_000).unwrap();
        let message = Message::builder()
            .body(b"{\"a\":1}".to_vec())
            .properties()
            .message_id("id-1".to_string())
            .content_type("application/json")
            .creation_time(time)
            .message_builder()
            .application_properties()
            .insert("aggregate_type", "order")
            .insert("aggregate_id", SimpleValue::Null)
            .insert("tx_index", SimpleValue::from(7u64))
            .insert("x-outbox-publishing-id", SimpleValue::from(u64::MAX))
            .message_builder()
            .publishing_id(42)
            .build();
        let copy = legacy_message(&message).unwrap();
        assert_eq!(copy.publishing_id(), Some(&42));
        same(&message, &copy);
        // Without properties or application properties too.
        let bare = Message::builder()
            .body(b"x".to_vec())
            .publishing_id(1)
            .build();
        same(&bare, &legacy_message(&bare).unwrap());
    }

    fn same(message: &Message, copy: &legacy::types::Message) {
        use rabbitmq_stream_protocol::codec::Decoder as _;
        let mut a = Vec::new();
        message.encode(&mut a).unwrap();
        let mut b = Vec::new();
        LegacyEncoder::encode(copy, &mut b).unwrap();
        assert_eq!(a.len(), b.len());
        assert_eq!(LegacyEncoder::encoded_size(copy), message.encoded_size());
        assert_eq!(
            Message::decode(&a).unwrap().1,
            Message::decode(&b).unwrap().1
        );
    }
}
