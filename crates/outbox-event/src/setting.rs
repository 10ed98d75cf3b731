//! A refused configuration value, as each component's settings report it: the key
//! (`section.key`, docs/design.md §6) and what to do about it. The relay turns each
//! into its configuration error, which adds where the value came from.

/// A refused configuration value: its key (`rabbitmq.url`) and the reason, which says
/// what to do. The reason never quotes a URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SettingError {
    pub key: &'static str,
    pub reason: String,
}

impl SettingError {
    /// An error about `key`.
    pub fn new(key: &'static str, reason: impl Into<String>) -> SettingError {
        SettingError {
            key,
            reason: reason.into(),
        }
    }
}
