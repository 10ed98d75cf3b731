//! Deserializers of the relay's own values TOML has no type for: socket addresses;
//! durations are the publisher's ([`publisher::settings`], for `rabbitmq.max_age`),
//! used here too.

use std::net::SocketAddr;

use serde::{Deserialize, Deserializer};

pub(super) use publisher::settings::de_duration;

pub(super) fn de_socket_addr<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<SocketAddr>, D::Error> {
    let s = String::deserialize(d)?;
    if s.trim().is_empty() {
        return Ok(None);
    }
    s.trim()
        .parse()
        .map(Some)
        .map_err(|_| serde::de::Error::invalid_value(serde::de::Unexpected::Str(&s), &"IP:PORT"))
}
