//! What opening a connection takes from the configuration, built once from it
//! ([`crate::amqp::session::params`]): the connection reads nothing else of it.

use std::time::Duration;

use crate::error::PublishError;
use crate::tls::{self, ClientAuth, Keys};

/// The brokers and how to log in to them.
#[derive(Debug, Clone)]
pub(crate) struct Params {
    /// The brokers' URLs, in the order they are tried (credentials included).
    pub(crate) urls: Vec<String>,
    /// The CA bundle for `amqps` URLs (the system's roots without one), and the
    /// client identity and password file.
    pub(crate) ca_file: Option<std::path::PathBuf>,
    pub(crate) auth: ClientAuth,
    /// The deadline of every request, and of the confirms of waiting publishes.
    pub(crate) request_timeout: Duration,
    /// The `connection_name` client property the broker's UI shows.
    pub(crate) name: String,
}

impl Params {
    /// `urls[index]` with the password file's password when one is configured: the
    /// file is read at every connect (rotation needs no restart).
    pub(crate) fn url(&self, index: usize) -> Result<String, PublishError> {
        Ok(match &self.auth.password_file {
            Some(path) => {
                tls::with_password(&self.urls[index], &tls::read_password(path, Keys::Amqp)?)
            }
            None => self.urls[index].clone(),
        })
    }
}
