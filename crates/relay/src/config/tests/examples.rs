//! The example files load, equal the defaults, and show every key.

use super::*;

fn example_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../outbox-relay.example.toml")
}

#[test]
fn example_file_loads_and_equals_the_defaults() {
    // The example shows the recommended least-privileged `[postgres] url` (the
    // role of sql/role.sql over verify-full), not the built-in default.
    let example = Config::load_with_env(Some(&example_path()), NO_ENV).unwrap();
    assert!(
        example
            .postgres_url_exposed()
            .starts_with("postgresql://outbox_relay@"),
        "the example must connect as the role of sql/role.sql"
    );
    assert!(example
        .postgres_url_exposed()
        .contains("sslmode=verify-full"));
    let mut c = Config::load_with_env(
        Some(&example_path()),
        [("OUTBOX_RELAY_POSTGRES_URL", DEFAULT_POSTGRES_URL)],
    )
    .unwrap();
    c.given = Default::default();
    assert_eq!(
        format!("{c:?}").replace(&format!("{:?}", c.source), ""),
        format!("{:?}", Config::default()).replace(&format!("{:?}", ConfigSource::Defaults), "")
    );
}

/// The local example works as it is: it names both servers (no refusal of built-in
/// defaults), and no file that exists on a server only (no TLS or secret files).
#[test]
fn local_example_needs_no_server_files() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../outbox-relay.local.toml");
    let c = Config::load_with_env(Some(&path), NO_ENV).unwrap();
    assert!(c.given.postgres_url && c.given.rabbitmq_url);
    assert!(c.require_connection_settings("run", true, true).is_ok());
    assert!(c.warnings().is_empty());
    let pg = c.pg_options().unwrap();
    assert_eq!(
        (pg.user.as_str(), pg.dbname.as_str()),
        ("outbox_relay", "app")
    );
    assert!(pg.sslrootcert.is_none() || !pg.sslrootcert_explicit);
    assert!(c.ca_file().is_none() && c.rabbitmq.cert_file.is_empty());
}

#[test]
fn example_file_shows_every_key() {
    let figment = Figment::from(Toml::file_exact(example_path()));
    for (section, key, _) in KEYS {
        let dotted = format!("{section}.{key}");
        assert!(
            figment.find_value(&dotted).is_ok(),
            "{dotted} missing from the example"
        );
    }
}
