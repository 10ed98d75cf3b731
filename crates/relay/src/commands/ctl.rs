//! `ctl pause|resume|drain|status|reload`: commands to the running relay through its
//! endpoint (crate::control_endpoint), with the credentials and TLS of `/metrics`
//! (crate::endpoint_client).

use std::time::{Duration, Instant};

use crate::cli::CtlCommand;
use crate::config::Config;
use crate::endpoint::EndpointConfig;
use crate::error::CliError;

pub async fn execute(cfg: &Config, cmd: &CtlCommand) -> Result<(), CliError> {
    let Some(ep) = cfg.metrics_endpoint() else {
        return Err(CliError::Precondition(
            "ctl talks to the running relay through its endpoint, but [relay] metrics_listen is \"\": set it (e.g. \"127.0.0.1:9187\") and restart the relay".into(),
        ));
    };
    match cmd {
        CtlCommand::Pause => {
            let state = send(&ep, "POST", "/control/pause").await?;
            println!("{}", describe(&state));
        }
        CtlCommand::Resume => {
            let state = send(&ep, "POST", "/control/resume").await?;
            println!("{}", describe(&state));
        }
        CtlCommand::Drain(args) => {
            let state = send(&ep, "POST", "/control/drain").await?;
            println!("{}", describe(&state));
            if args.wait {
                wait_stopped(&ep, args.timeout).await?;
                println!("stopped");
            }
        }
        CtlCommand::Status(args) => {
            let state = send(&ep, "GET", "/control/status").await?;
            if args.json {
                println!("{state}");
            } else {
                println!("{}", describe(&state));
            }
        }
        CtlCommand::Reload => {
            let report = send(&ep, "POST", "/control/reload").await?;
            return reload_outcome(&report);
        }
    }
    Ok(())
}

/// One request; the JSON answer of a 200, else an error naming the fix.
async fn send(
    ep: &EndpointConfig,
    method: &str,
    path: &str,
) -> Result<serde_json::Value, CliError> {
    let (status, body) = crate::endpoint_client::request(ep, method, path)
        .await
        .map_err(|why| {
            CliError::Runtime(format!(
                "cannot reach the relay's endpoint at {} ({why}): is `outbox-relay run` up with this configuration's [relay] metrics_listen?",
                ep.addr
            ))
        })?;
    let json = serde_json::from_str::<serde_json::Value>(body.trim()).ok();
    match status {
        200 => json.ok_or_else(|| {
            CliError::Runtime(format!("the endpoint at {} did not answer JSON: is it an outbox-relay?", ep.addr))
        }),
        409 => Err(CliError::Precondition(
            json.as_ref()
                .and_then(|j| j["error"].as_str())
                .map(outbox_event::redact::printable)
                .map(|s| s.into_owned())
                .unwrap_or_else(|| "the relay refused the command".into()),
        )),
        403 => Err(CliError::Precondition(
            "the relay refuses control on an endpoint beyond loopback without credentials: set [relay] metrics_bearer_token_file (or metrics_basic_auth_*) in the relay and here, or listen on 127.0.0.1".into(),
        )),
        404 => Err(CliError::Precondition(format!(
            "the endpoint at {} has no control routes: upgrade the running relay to one that has `ctl`",
            ep.addr
        ))),
        other => Err(CliError::Precondition(crate::endpoint_client::refusal(other))),
    }
}

/// `state: paused since … (N s)`, the positions and the in-flight count.
fn describe(s: &serde_json::Value) -> String {
    let text = |k: &str| s[k].as_str().unwrap_or("-").to_string();
    let state = match (s["state"].as_str(), s["paused_since"].as_str()) {
        (Some("paused"), Some(since)) => format!(
            "paused since {since} ({} s)",
            s["paused_seconds"].as_u64().unwrap_or(0)
        ),
        (Some(state), _) => state.to_string(),
        (None, _) => "unknown".to_string(),
    };
    let in_flight = s["in_flight"]
        .as_u64()
        .map_or("-".to_string(), |n| n.to_string());
    format!(
        "state: {state}\nacked: {}\nconfirmed: {}\nin flight: {in_flight}",
        text("acked_lsn"),
        text("confirmed_lsn")
    )
}

/// Prints the reload's report; an invalid file or an unreadable secret file is exit 2.
fn reload_outcome(report: &serde_json::Value) -> Result<(), CliError> {
    let list = |k: &str| -> Vec<String> {
        report[k]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|v| v.as_str())
                    .map(|s| outbox_event::redact::printable(s).into_owned())
                    .collect()
            })
            .unwrap_or_default()
    };
    for key in list("applied") {
        println!("applied: {key}");
    }
    for key in list("secret_files") {
        println!("reread: {key}");
    }
    for key in list("needs_restart") {
        println!("needs a restart (not applied): {key}");
    }
    let errors = list("errors");
    if errors.is_empty() {
        if list("applied").is_empty() && list("needs_restart").is_empty() {
            println!("no setting changed");
        }
        return Ok(());
    }
    Err(CliError::Precondition(format!(
        "the reload was refused or incomplete, the running configuration stays where it failed: {}",
        errors.join("; ")
    )))
}

/// Waits until the endpoint stops answering: the relay has exited.
async fn wait_stopped(ep: &EndpointConfig, timeout: Duration) -> Result<(), CliError> {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if crate::endpoint_client::request(ep, "GET", "/healthz")
            .await
            .is_err()
        {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Err(CliError::Runtime(format!(
        "the relay still answers {} after the drain: it waits for confirms or an open transaction; see its log, or wait longer with --timeout",
        humantime::format_duration(timeout)
    )))
}
