//! The binary against hostile input and with secrets (docs/security.md), one module
//! per topic: hostile passwords (`secrets`), secrets from files (`secret_files`),
//! hostile servers (`hostile_peers`), the broker over TLS (`broker_tls`), the
//! metrics endpoint against hostile clients (`metrics_endpoint`), control against
//! web pages, other local users and port squatters (`control`), functions
//! planted in the database (`search_path`), outbox text on the operator's
//! terminal (`operator_output`), who may emit logical messages (`emit`),
//! reloading a running relay's password file, log filter and settings (`reload`),
//! and credentials sent to the management API and the OTLP collector
//! (`credentials_in_clear`).
//!
//! The modules run in parallel in one process. None changes anything shared: the
//! RabbitMQ users they add, change the password of and close the connections of
//! are their own (`testkit::hostile::BrokerUser`, a unique name), as are the Postgres
//! roles (members of the `outbox_auth_scram` group that scripts/test-services.sh
//! makes), the fake servers and the listeners (free ports).
#![allow(clippy::unwrap_used)]

mod broker_tls;
mod control;
mod credentials_in_clear;
mod emit;
mod hostile_peers;
mod metrics_endpoint;
mod operator_output;
mod reload;
mod search_path;
mod secret_files;
mod secrets;

use std::os::unix::fs::PermissionsExt;

/// Writes a secret file of `env` (mode 0600, as the relay requires) and gives its path.
fn secret_file(env: &support::Env, name: &str, content: &str) -> String {
    let p = env.dir.join(name);
    std::fs::write(&p, content).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
    p.display().to_string()
}
