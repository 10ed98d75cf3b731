//! The HTTP side of the relay, both ends of it.
//!
//! - `server.rs`: the listener `run` serves `/metrics`, `/healthz`, `/readyz`,
//!   `/poison` and `/control/` on (timeouts, connection cap, TLS), [`serve`];
//! - `guard.rs`: the checks every request passes (Host, control's origin and shape,
//!   credentials);
//! - `auth.rs`: the configured credentials, read from their files;
//! - `control.rs`: the `/control/` routes (pause, resume, drain, reload);
//! - `client.rs` (with `client/pinned.rs`): how `ctl` and `status` ask a running
//!   relay;
//! - `http_exchange.rs`: the one HTTP/1 exchange the relay's clients make (`client.rs`
//!   and `check --routes`' management API client).
//!
//! The router of the read-only routes is `crate::metrics`'s.

pub mod auth;
pub mod client;
pub mod control;
pub mod guard;
pub(crate) mod http_exchange;
pub mod server;

pub use server::{serve, EndpointConfig};
