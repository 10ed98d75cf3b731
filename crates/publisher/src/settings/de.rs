//! Deserializers of `[rabbitmq]` values TOML has no type for: secret URL lists and
//! durations (the relay's other sections use the duration form too).

use std::fmt;
use std::time::Duration;

use secrecy::SecretString;
use serde::{Deserialize, Deserializer};

/// A string or a list of strings, each a secret.
pub fn de_secret_list<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<SecretString>, D::Error> {
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

/// A duration ([`parse_duration`]); `""` is none, zero is refused.
pub fn de_duration<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    let s = String::deserialize(d)?;
    if s.trim().is_empty() {
        return Ok(None);
    }
    match parse_duration(s.trim()) {
        Some(d) if d.is_zero() => Err(serde::de::Error::custom(
            "a zero duration is not allowed: use \"\" to turn it off",
        )),
        Some(d) => Ok(Some(d)),
        None => Err(serde::de::Error::invalid_value(
            serde::de::Unexpected::Str(&s),
            &"a duration",
        )),
    }
}

/// A duration in RabbitMQ's form (a whole number and one of `Y`, `M`, `D`, `h`, `m`,
/// `s`: the units of a stream's `max-age`, a year 365 days and a month 30), or in
/// humantime's (`1h 30min`, `7days`, `500ms`).
pub fn parse_duration(s: &str) -> Option<Duration> {
    const DAY: u64 = 86_400;
    let digits = s.len() - s.trim_start_matches(|c: char| c.is_ascii_digit()).len();
    if digits > 0 && s.len() == digits + 1 {
        let n: u64 = s[..digits].parse().ok()?;
        let unit = match &s[digits..] {
            "Y" => Some(365 * DAY),
            "M" => Some(30 * DAY),
            "D" => Some(DAY),
            "h" => Some(3_600),
            "m" => Some(60),
            "s" => Some(1),
            _ => None,
        };
        if let Some(unit) = unit {
            return n.checked_mul(unit).map(Duration::from_secs);
        }
    }
    humantime::parse_duration(s).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_in_rabbitmq_and_humantime_forms() {
        const DAY: u64 = 86_400;
        for (text, secs) in [
            ("7D", 7 * DAY),
            ("1Y", 365 * DAY),
            ("2M", 60 * DAY),
            ("1h", 3_600),
            ("10m", 600),
            ("30s", 30),
            ("7d", 7 * DAY),
            ("30min", 1_800),
            ("1h 30min", 5_400),
        ] {
            assert_eq!(
                parse_duration(text),
                Some(Duration::from_secs(secs)),
                "{text}"
            );
        }
        for bad in ["", "D", "7W", "forever", "7 D"] {
            assert_eq!(parse_duration(bad), None, "{bad}");
        }
    }
}
