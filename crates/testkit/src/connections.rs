//! The test broker's AMQP connections as `rabbitmqctl list_connections` shows them:
//! who holds them (user, `connection_name` client property, TLS or not), and closing
//! one (`rabbitmqctl close_connection`), as an operator or the broker would.

/// One AMQP connection of the test broker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BrokerConnection {
    /// The connection's process, as `close_connection` takes it back
    /// (`<rabbit@host.1.2.3>`).
    pub pid: String,
    pub user: String,
    /// Over TLS.
    pub ssl: bool,
    /// The `connection_name` client property ("" when the client set none).
    pub name: String,
}

/// Every AMQP connection of the test broker.
pub fn list() -> Vec<BrokerConnection> {
    let out = crate::rabbitmqctl_command()
        .args([
            "-q",
            "list_connections",
            "pid",
            "user",
            "ssl",
            "client_properties",
        ])
        .output()
        .expect("run rabbitmqctl list_connections");
    assert!(
        out.status.success(),
        "rabbitmqctl list_connections: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    parse(&String::from_utf8_lossy(&out.stdout))
}

/// The connections whose `connection_name` starts with `prefix`.
pub fn named(prefix: &str) -> Vec<BrokerConnection> {
    list()
        .into_iter()
        .filter(|c| c.name.starts_with(prefix))
        .collect()
}

/// The connections of `user`.
pub fn of_user(user: &str) -> Vec<BrokerConnection> {
    list().into_iter().filter(|c| c.user == user).collect()
}

/// Closes `conn` from the broker's side (the client sees `connection.close` 320
/// CONNECTION_FORCED with `reason`). A connection already gone is not an error.
pub fn close(conn: &BrokerConnection, reason: &str) {
    let _ = crate::rabbitmqctl_command()
        .args(["-q", "close_connection", &conn.pid, reason])
        .output();
}

/// The tab-separated lines of `list_connections pid user ssl client_properties`.
fn parse(text: &str) -> Vec<BrokerConnection> {
    text.lines()
        .filter_map(|line| {
            let mut cols = line.splitn(4, '\t');
            let pid = cols.next()?.trim();
            let user = cols.next()?;
            let ssl = cols.next()?;
            let props = cols.next().unwrap_or("");
            pid.starts_with('<').then(|| BrokerConnection {
                pid: pid.to_string(),
                user: user.to_string(),
                ssl: ssl == "true",
                name: connection_name(props).unwrap_or_default(),
            })
        })
        .collect()
}

/// The `connection_name` entry of a client-properties column
/// (`[…,{"connection_name","…"},…]`).
fn connection_name(props: &str) -> Option<String> {
    const KEY: &str = "{\"connection_name\",\"";
    let start = props.find(KEY)? + KEY.len();
    let rest = &props[start..];
    let end = rest.find("\"}")?;
    Some(rest[..end].to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_list_connections() {
        let text = "pid\tuser\tssl\tclient_properties\n\
                    <rabbit@vm.1.2.0>\tguest\tfalse\t[{\"capabilities\",[{\"publisher_confirms\",true}]},{\"connection_name\",\"outbox-relay s channel 1/4\"},{\"product\",\"lapin\"}]\n\
                    <rabbit@vm.1.3.0>\tx\ttrue\t[]\n";
        let c = parse(text);
        assert_eq!(c.len(), 2);
        assert_eq!(c[0].pid, "<rabbit@vm.1.2.0>");
        assert_eq!(c[0].name, "outbox-relay s channel 1/4");
        assert!(!c[0].ssl);
        assert_eq!(c[1].user, "x");
        assert!(c[1].ssl);
        assert_eq!(c[1].name, "");
    }
}
