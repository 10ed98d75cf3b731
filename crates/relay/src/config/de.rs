//! Deserializers of values TOML has no type for: secrets, lists, socket addresses;
//! durations are the publisher's ([`publisher::settings`], for `rabbitmq.max_age`),
//! used here too.

use std::fmt;
use std::net::SocketAddr;

use secrecy::SecretString;
use serde::{Deserialize, Deserializer};

pub(super) use publisher::settings::de_duration;

pub(super) fn de_secret<'de, D: Deserializer<'de>>(d: D) -> Result<SecretString, D::Error> {
    String::deserialize(d).map(SecretString::from)
}

/// A list of strings: a TOML array, or one string of comma-separated items (the
/// form the environment variable takes too).
pub(super) fn de_string_list<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    struct V;
    impl<'de> serde::de::Visitor<'de> for V {
        type Value = Vec<String>;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a string or a list of strings")
        }
        fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
            Ok(v.split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(str::to_string)
                .collect())
        }
        fn visit_seq<A: serde::de::SeqAccess<'de>>(
            self,
            mut seq: A,
        ) -> Result<Self::Value, A::Error> {
            let mut out = Vec::new();
            while let Some(s) = seq.next_element::<String>()? {
                out.push(s);
            }
            Ok(out)
        }
    }
    d.deserialize_any(V)
}

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
