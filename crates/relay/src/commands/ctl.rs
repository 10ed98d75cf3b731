//! `ctl [--endpoint URL] pause|resume|drain|status|reload`: commands to the running
//! relay through its endpoint (crate::endpoint::control), with this start's control
//! token or the credentials and TLS of `/metrics` (crate::endpoint::client).
//!
//! Everything printed that came from the endpoint is escaped
//! (`outbox_event::redact`): the process on the port may not be the relay.

use std::time::{Duration, Instant};

use outbox_event::redact::{printable, printable_json};

use crate::cli::{CtlArgs, CtlCommand};
use crate::config::CtlSettings;
use crate::control_token::TokenFile;
use crate::endpoint::client::{AskError, Target};
use crate::error::CliError;

pub async fn execute(settings: &CtlSettings, args: &CtlArgs) -> Result<(), CliError> {
    let target = target(settings, args.endpoint.as_deref())?;
    match &args.command {
        CtlCommand::Pause => {
            let state = send(&target, "POST", "/control/pause").await?;
            println!("{}", describe(&state));
        }
        CtlCommand::Resume => {
            let state = send(&target, "POST", "/control/resume").await?;
            println!("{}", describe(&state));
        }
        CtlCommand::Drain(drain) => {
            // The process to watch, named while it surely runs.
            let process = if drain.wait {
                let before = send(&target, "GET", "/control/status").await?;
                watchable(&target, &before).await
            } else {
                None
            };
            let state = send(&target, "POST", "/control/drain").await?;
            println!("{}", describe(&state));
            if drain.wait {
                wait_stopped(&target, process, drain.timeout).await?;
                println!("stopped");
            }
        }
        CtlCommand::Status(status) => {
            let state = send(&target, "GET", "/control/status").await?;
            if status.json {
                println!("{}", printable_json(&state.to_string()));
            } else {
                println!("{}", describe(&state));
            }
        }
        CtlCommand::Reload => {
            let report = send(&target, "POST", "/control/reload").await?;
            return reload_outcome(&report);
        }
    }
    Ok(())
}

/// Where to send: `--endpoint URL`, else `[relay] metrics_listen`.
fn target(settings: &CtlSettings, endpoint: Option<&str>) -> Result<Target, CliError> {
    let Some(url) = endpoint else {
        let Some(listen) = settings.listen else {
            return Err(CliError::Precondition(
                "ctl talks to the running relay through its endpoint, but [relay] metrics_listen is \"\": set it (e.g. \"127.0.0.1:9187\") and restart the relay, or pass ctl --endpoint URL".into(),
            ));
        };
        let token = TokenFile::new(&settings.control_token_file, listen.port());
        return Ok(Target::at(
            listen,
            settings.auth.clone(),
            settings.tls_cert.clone(),
            token.path,
        ));
    };
    let (tls, host, port) = parse_url(url).ok_or_else(|| {
        CliError::Usage(format!(
            "--endpoint {} is not a URL like http://127.0.0.1:9187 or https://relay.example:9187: give the scheme, the host and the port",
            printable(url)
        ))
    })?;
    let tls_cert = match (tls, &settings.tls_cert) {
        (false, _) => None,
        (true, Some(cert)) => Some(cert.clone()),
        (true, None) => {
            return Err(CliError::Usage(
                "--endpoint https://… needs the certificate the relay serves, which ctl trusts alone: set [relay] metrics_tls_cert_file (or OUTBOX_RELAY_RELAY_METRICS_TLS_CERT_FILE) to it".into(),
            ))
        }
    };
    Ok(Target {
        host,
        port,
        tls_cert,
        auth: settings.auth.clone(),
        token_file: TokenFile::new(&settings.control_token_file, port).path,
    })
}

/// `http(s)://host:port[/]`: whether TLS, the host (an IPv6 literal without its
/// brackets) and the port.
fn parse_url(url: &str) -> Option<(bool, String, u16)> {
    let url = url.trim();
    let (tls, rest) = match url.split_once("://")? {
        (s, rest) if s.eq_ignore_ascii_case("http") => (false, rest),
        (s, rest) if s.eq_ignore_ascii_case("https") => (true, rest),
        _ => return None,
    };
    let authority = rest.strip_suffix('/').unwrap_or(rest);
    let (host, port) = match authority.strip_prefix('[') {
        Some(v6) => {
            let (host, port) = v6.split_once("]:")?;
            (host, port)
        }
        None => authority.rsplit_once(':')?,
    };
    let valid = |c: char| c.is_ascii_alphanumeric() || ".-:".contains(c);
    if host.is_empty() || !host.chars().all(valid) || authority.contains('/') {
        return None;
    }
    Some((tls, host.to_string(), port.parse().ok()?))
}

/// One request; the JSON answer of a 200, else an error naming the fix.
async fn send(target: &Target, method: &str, path: &str) -> Result<serde_json::Value, CliError> {
    let answer = crate::endpoint::client::request(target, method, path)
        .await
        .map_err(|e| match e {
            AskError::Unreachable(why) => CliError::Runtime(format!(
                "cannot reach the relay's endpoint at {} ({why}): is `outbox-relay run` up with this configuration's [relay] metrics_listen?",
                target.authority()
            )),
            AskError::Unproven(why) => CliError::Precondition(why),
        })?;
    let json = serde_json::from_str::<serde_json::Value>(answer.body.trim()).ok();
    match answer.status {
        200 => json.filter(|j| j.is_object()).ok_or_else(|| {
            CliError::Runtime(format!(
                "the endpoint at {} did not answer JSON: is it an outbox-relay?",
                target.authority()
            ))
        }),
        409 => Err(CliError::Precondition(
            json.as_ref()
                .and_then(|j| j["error"].as_str())
                .map(|s| printable(s).into_owned())
                .unwrap_or_else(|| "the relay refused the command".into()),
        )),
        404 => Err(CliError::Precondition(format!(
            "the endpoint at {} has no control routes: upgrade the running relay to one that has `ctl`",
            target.authority()
        ))),
        _ => Err(CliError::Precondition(crate::endpoint::client::refusal(
            target, &answer,
        ))),
    }
}

/// `state: paused since … (N s)`, whether it streams, the positions and the
/// in-flight count; every value escaped.
fn describe(s: &serde_json::Value) -> String {
    let text = |k: &str| printable(s[k].as_str().unwrap_or("-")).into_owned();
    let state = match (s["state"].as_str(), s["paused_since"].as_str()) {
        (Some("paused"), Some(since)) => format!(
            "paused since {} ({} s)",
            printable(since),
            s["paused_seconds"].as_u64().unwrap_or(0)
        ),
        (Some(state), _) => printable(state).into_owned(),
        (None, _) => "unknown".to_string(),
    };
    let connected = s["connected"]
        .as_bool()
        .map_or("-".to_string(), |c| c.to_string());
    let in_flight = s["in_flight"]
        .as_u64()
        .map_or("-".to_string(), |n| n.to_string());
    format!(
        "state: {state}\nconnected: {connected}\nacked: {}\nconfirmed: {}\nin flight: {in_flight}",
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
                    .map(|s| printable(s).into_owned())
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

/// The relay's process (pid and start time) when `ctl` can watch it: on this host,
/// in this pid namespace, visible in `/proc`.
async fn watchable(target: &Target, state: &serde_json::Value) -> Option<(u32, u64)> {
    let pid = u32::try_from(state["pid"].as_u64()?).ok()?;
    let start = state["process_start"].as_u64()?;
    (target.is_local().await && crate::endpoint::control::process_start(pid) == Some(start))
        .then_some((pid, start))
}

/// Waits until the relay has exited. On this host it watches the relay's `process`
/// (named by the status before the drain): nothing more goes to the port, which
/// another process may take once the relay has freed it. Elsewhere it asks
/// `/healthz`, with no credential, until no answer comes.
async fn wait_stopped(
    target: &Target,
    process: Option<(u32, u64)>,
    timeout: Duration,
) -> Result<(), CliError> {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        let gone = match process {
            Some((pid, start)) => crate::endpoint::control::process_start(pid) != Some(start),
            None => matches!(
                crate::endpoint::client::request(target, "GET", "/healthz").await,
                Err(AskError::Unreachable(_))
            ),
        };
        if gone {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Err(CliError::Runtime(format!(
        "the relay still runs {} after the drain: it waits for confirms or an open transaction; see its log, or wait longer with --timeout",
        humantime::format_duration(timeout)
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_endpoint_url_is_a_scheme_a_host_and_a_port() {
        let p = |u: &str| parse_url(u);
        assert_eq!(
            p("http://127.0.0.1:9187"),
            Some((false, "127.0.0.1".into(), 9187))
        );
        assert_eq!(
            p("HTTPS://relay.example:443/"),
            Some((true, "relay.example".into(), 443))
        );
        assert_eq!(p("http://[::1]:9187"), Some((false, "::1".into(), 9187)));
        for bad in [
            "127.0.0.1:9187",
            "http://h",
            "ftp://h:1",
            "http://h:1/metrics",
            "http://h\u{1b}:1",
        ] {
            assert_eq!(p(bad), None, "{bad}");
        }
    }

    /// Text the endpoint sends is printed escaped, in every field.
    #[test]
    fn hostile_status_text_is_escaped() {
        let s = serde_json::json!({
            "state": "paused\u{1b}[2J",
            "paused_since": "now\nstate: running",
            "connected": true,
            "acked_lsn": "0/1\u{202e}",
            "confirmed_lsn": "\r",
            "in_flight": 3,
        });
        let out = describe(&s);
        assert_eq!(out.lines().count(), 5, "{out}");
        let unsafe_char = |c: char| c != '\n' && outbox_event::redact::is_unsafe_char(c);
        assert!(!out.chars().any(unsafe_char), "{out}");
        assert!(out.contains("connected: true"), "{out}");
        assert!(
            out.contains("\\u{1b}") && out.contains("\\u{202e}"),
            "{out}"
        );
    }
}
