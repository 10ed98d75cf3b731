//! Deserializers of values TOML has no type for: secrets, durations, socket addresses.

use std::fmt;
use std::net::SocketAddr;
use std::time::Duration;

use secrecy::SecretString;
use serde::{Deserialize, Deserializer};

pub(super) fn de_secret<'de, D: Deserializer<'de>>(d: D) -> Result<SecretString, D::Error> {
    String::deserialize(d).map(SecretString::from)
}

/// A string or a list of strings, each a secret.
pub(super) fn de_secret_list<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Vec<SecretString>, D::Error> {
    struct V;
    impl<'de> serde::de::Visitor<'de> for V {
        type Value = Vec<SecretString>;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a URL or a list of URLs")
        }
        fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
            Ok(vec![SecretString::from(v)])
        }
        fn visit_seq<A: serde::de::SeqAccess<'de>>(
            self,
            mut seq: A,
        ) -> Result<Self::Value, A::Error> {
            let mut out = Vec::new();
            while let Some(s) = seq.next_element::<String>()? {
                out.push(SecretString::from(s));
            }
            Ok(out)
        }
    }
    d.deserialize_any(V)
}

pub(super) fn de_duration<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    let s = String::deserialize(d)?;
    if s.trim().is_empty() {
        return Ok(None);
    }
    match humantime::parse_duration(s.trim()) {
        Ok(d) if d.is_zero() => Err(serde::de::Error::custom(
            "a zero duration is not allowed: use \"\" to turn it off",
        )),
        Ok(d) => Ok(Some(d)),
        Err(e) => Err(serde::de::Error::custom(format!(
            "{s:?} is not a duration ({e}): use a value like \"30min\", \"1h\" or \"7d\", or \"\" for none"
        ))),
    }
}

pub(super) fn de_socket_addr<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<SocketAddr>, D::Error> {
    let s = String::deserialize(d)?;
    if s.trim().is_empty() {
        return Ok(None);
    }
    s.trim().parse().map(Some).map_err(|_| {
        serde::de::Error::custom(format!(
            "{s:?} is not a socket address: use IP:PORT like \"127.0.0.1:9187\" or \"[::]:9187\", or \"\" to disable"
        ))
    })
}
