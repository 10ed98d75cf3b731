//! Whose credentials `check --routes` gives the management API, and whether it may
//! give them at all (docs/security.md, "Credentials in clear").
//!
//! ```text
//!   management_url with user:password      ─► those
//!   [rabbitmq] management_user (+ its management_password_file) ─► those
//!   else [rabbitmq] url's user             ─► with the AMQP password (password_file,
//!                                              else the URL's); a management_url
//!                                              naming another user is refused
//! ```
//!
//! The AMQP password is never sent for another user than the AMQP URL's. Plain
//! `http://` beyond loopback is refused before any secret is read, unless
//! `[rabbitmq] allow_insecure_http = true`.

use crate::config::{beyond_loopback, Config};

/// What the URLs and the section give, split up.
pub(super) struct Given<'a> {
    /// The management URL's own user and password.
    pub url_user: Option<String>,
    pub url_password: Option<String>,
    /// The first AMQP URL's user and password.
    pub amqp_user: Option<String>,
    pub amqp_password: Option<String>,
    pub cfg: &'a Config,
}

/// Refuses plain `http://` beyond loopback unless `allow_insecure_http`; the
/// warnings `check --routes` prints otherwise (credentials in clear).
pub(super) fn in_clear(cfg: &Config, url: &str, shown: &str) -> Result<Vec<String>, String> {
    let r = &cfg.rabbitmq;
    let mut warnings = Vec::new();
    if let Some(host) = beyond_loopback(url) {
        if !r.allow_insecure_http {
            return Err(format!(
                "[rabbitmq] management_url ({shown}) is plain http:// to {host}, beyond loopback, so the management API's credentials would cross the network in clear: use https://, or set [rabbitmq] allow_insecure_http = true to send them anyway"
            ));
        }
        warnings.push(format!(
            "the credentials go to {host} in clear (plain http://, [rabbitmq] allow_insecure_http = true)"
        ));
    }
    let plain = url
        .trim()
        .get(..7)
        .is_some_and(|s| s.eq_ignore_ascii_case("http://"));
    let amqps = cfg.rabbitmq.expose_urls().first().is_some_and(|u| {
        u.trim()
            .get(..8)
            .is_some_and(|s| s.eq_ignore_ascii_case("amqps://"))
    });
    if plain && amqps {
        warnings.push(
            "[rabbitmq] url is amqps:// but management_url is plain http://: the management API's credentials are not encrypted where the AMQP ones are; use https://".to_string(),
        );
    }
    Ok(warnings)
}

/// The user and password to send.
pub(super) fn pick(given: Given<'_>) -> Result<(String, String), String> {
    let r = &given.cfg.rabbitmq;
    if let (Some(user), Some(password)) = (&given.url_user, &given.url_password) {
        return Ok((user.clone(), password.clone()));
    }
    if !r.management_user.is_empty() {
        if let Some(other) = given.url_user.filter(|u| u != &r.management_user) {
            return Err(format!(
                "[rabbitmq] management_url names the user {other:?} and management_user names {:?}: name one user (drop the URL's)",
                r.management_user
            ));
        }
        let password = read_password(&r.management_password_file)?;
        return Ok((r.management_user.clone(), password));
    }
    let amqp_user = given.amqp_user.unwrap_or_else(|| "guest".into());
    if let Some(other) = given.url_user.filter(|u| u != &amqp_user) {
        return Err(format!(
            "[rabbitmq] management_url names the user {other:?} without a password, and the AMQP password is never sent for another user than [rabbitmq] url's: set management_user = {other:?} and management_password_file (its own password), or put the password in management_url"
        ));
    }
    let password = if r.password_file.is_empty() {
        given.amqp_password.unwrap_or_else(|| "guest".into())
    } else {
        publisher::read_password_file(std::path::Path::new(&r.password_file))
            .map_err(|e| e.to_string())?
    };
    Ok((amqp_user, password))
}

/// `management_password_file`'s password (its mode is checked at load).
fn read_password(path: &str) -> Result<String, String> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        format!("cannot read [rabbitmq] management_password_file {path} ({e}): point it at a readable file holding the password")
    })?;
    let password = text.trim_end_matches(['\n', '\r']);
    if password.is_empty() {
        return Err(format!(
            "[rabbitmq] management_password_file {path} is empty: write the management user's password in it"
        ));
    }
    Ok(password.to_string())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::os::unix::fs::PermissionsExt;

    use super::*;

    fn cfg(amqp: &str, management_user: &str, file: &str) -> Config {
        let mut c = Config::default();
        c.rabbitmq.url = vec![amqp.into()];
        c.rabbitmq.management_user = management_user.into();
        c.rabbitmq.management_password_file = file.into();
        c
    }

    fn given<'a>(c: &'a Config, user: Option<&str>, password: Option<&str>) -> Given<'a> {
        Given {
            url_user: user.map(str::to_string),
            url_password: password.map(str::to_string),
            amqp_user: Some("relay".into()),
            amqp_password: Some("amqp-secret".into()),
            cfg: c,
        }
    }

    /// The AMQP password goes with the AMQP user only; another user needs its own
    /// password, from the URL or from management_user's file.
    #[test]
    fn the_amqp_password_never_goes_with_another_user() {
        let c = cfg("amqp://relay:amqp-secret@mq/%2f", "", "");
        assert_eq!(
            pick(given(&c, None, None)).unwrap(),
            ("relay".into(), "amqp-secret".into())
        );
        assert_eq!(
            pick(given(&c, Some("relay"), None)).unwrap(),
            ("relay".into(), "amqp-secret".into())
        );
        let e = pick(given(&c, Some("monitor"), None)).unwrap_err();
        assert!(
            e.contains("management_user") && !e.contains("amqp-secret"),
            "{e}"
        );
        assert_eq!(
            pick(given(&c, Some("monitor"), Some("m"))).unwrap(),
            ("monitor".into(), "m".into())
        );

        let file = std::env::temp_dir().join(format!("mgmt-pw-{}", std::process::id()));
        std::fs::write(&file, "monitor-secret\n").unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
        let c = cfg(
            "amqp://relay:amqp-secret@mq/%2f",
            "monitor",
            file.to_str().unwrap(),
        );
        assert_eq!(
            pick(given(&c, None, None)).unwrap(),
            ("monitor".into(), "monitor-secret".into())
        );
        assert!(pick(given(&c, Some("other"), None)).is_err());
        let _ = std::fs::remove_file(&file);
    }

    #[test]
    fn plain_http_beyond_loopback_needs_allow_insecure_http() {
        let mut c = cfg("amqps://relay:s@mq/%2f", "", "");
        let e = in_clear(
            &c,
            "http://u:pw@10.1.2.3:15672",
            "http://u:***@10.1.2.3:15672",
        )
        .unwrap_err();
        assert!(
            e.contains("allow_insecure_http = true") && !e.contains("pw@"),
            "{e}"
        );
        let w = in_clear(&c, "http://127.0.0.1:15672", "").unwrap();
        assert!(w[0].contains("amqps://"), "{w:?}");
        assert!(in_clear(&c, "https://10.1.2.3:15671", "")
            .unwrap()
            .is_empty());
        c.rabbitmq.allow_insecure_http = true;
        let w = in_clear(&c, "http://10.1.2.3:15672", "").unwrap();
        assert_eq!(w.len(), 2, "{w:?}");
    }
}
