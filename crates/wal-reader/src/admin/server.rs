//! Server-wide preconditions: `wal_level`, the role's REPLICATION attribute, the
//! server version, and the capacity (`max_replication_slots`, `max_wal_senders`)
//! that creating and streaming from a slot needs.

use tokio_postgres::Client;

use super::AdminError;

/// The server's `wal_level` setting (`minimal`, `replica` or `logical`).
pub async fn wal_level(c: &Client) -> Result<String, AdminError> {
    let row = c
        .query_one("SELECT pg_catalog.current_setting('wal_level'::text)", &[])
        .await?;
    Ok(row.try_get(0)?)
}

/// Logical decoding needs `wal_level = logical`; the setting only changes with a
/// restart, so the message says so.
pub async fn check_wal_level(c: &Client) -> Result<(), AdminError> {
    let actual = wal_level(c).await?;
    if actual == "logical" {
        Ok(())
    } else {
        Err(AdminError::WalLevel { actual })
    }
}

/// The session role must have the REPLICATION attribute (or be superuser) both to
/// open a replication connection and to create or drop slots.
pub async fn check_replication_role(c: &Client) -> Result<(), AdminError> {
    let row = c
        .query_one(
            "SELECT current_user::text, rolreplication, rolsuper \
               FROM pg_catalog.pg_roles WHERE rolname = current_user",
            &[],
        )
        .await?;
    let role: String = row.try_get(0)?;
    let replication: bool = row.try_get(1)?;
    let superuser: bool = row.try_get(2)?;
    if replication || superuser {
        Ok(())
    } else {
        Err(AdminError::NotReplicationRole { role })
    }
}

/// `server_version_num`, e.g. `150020` for 15.20.
pub async fn server_version_num(c: &Client) -> Result<i32, AdminError> {
    let row = c
        .query_one(
            "SELECT pg_catalog.current_setting('server_version_num'::text)::int4",
            &[],
        )
        .await?;
    Ok(row.try_get(0)?)
}

/// `server_version`, e.g. `15.20 (Debian 15.20-0+deb12u1)`, for messages.
pub async fn server_version(c: &Client) -> Result<String, AdminError> {
    let row = c
        .query_one(
            "SELECT pg_catalog.current_setting('server_version'::text)",
            &[],
        )
        .await?;
    Ok(row.try_get(0)?)
}

/// The oldest Postgres the relay supports (`server_version_num` of 14.0): the
/// versions it is tested against are 14 to 18 (docs/compatibility.md).
pub const MIN_SERVER_VERSION_NUM: i32 = 140000;

/// The version rule: `num` is `server_version_num`, `version` the `server_version`
/// text named in the error.
pub fn check_version(num: i32, version: &str) -> Result<(), AdminError> {
    if num >= MIN_SERVER_VERSION_NUM {
        Ok(())
    } else {
        Err(AdminError::ServerTooOld {
            version: version.to_string(),
        })
    }
}

/// The server's version if the relay supports it (Postgres 14 or newer), for
/// `check`'s and `run`'s preflight; an unmet precondition otherwise.
pub async fn check_server_version(c: &Client) -> Result<String, AdminError> {
    let version = server_version(c).await?;
    check_version(server_version_num(c).await?, &version)?;
    Ok(version)
}

/// How many slots and WAL senders the server allows and how many are taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capacity {
    pub max_replication_slots: i64,
    pub slots_in_use: i64,
    pub max_wal_senders: i64,
    pub wal_senders_in_use: i64,
}

impl Capacity {
    /// Reads the limits and the current use. WAL senders are counted in
    /// `pg_stat_activity`, whose `backend_type` every role can see.
    pub async fn read(c: &Client) -> Result<Capacity, AdminError> {
        let row = c
            .query_one(
                "SELECT pg_catalog.current_setting('max_replication_slots'::text)::int8, \
                        (SELECT pg_catalog.count(*) FROM pg_catalog.pg_replication_slots), \
                        pg_catalog.current_setting('max_wal_senders'::text)::int8, \
                        (SELECT pg_catalog.count(*) FROM pg_catalog.pg_stat_activity WHERE backend_type = 'walsender')",
                &[],
            )
            .await?;
        Ok(Capacity {
            max_replication_slots: row.try_get(0)?,
            slots_in_use: row.try_get(1)?,
            max_wal_senders: row.try_get(2)?,
            wal_senders_in_use: row.try_get(3)?,
        })
    }

    /// Whether one more slot can be created and then streamed from.
    pub fn check_room_for_slot(&self) -> Result<(), AdminError> {
        if self.slots_in_use >= self.max_replication_slots {
            return Err(AdminError::SlotsExhausted {
                max: self.max_replication_slots,
            });
        }
        if self.wal_senders_in_use >= self.max_wal_senders {
            return Err(AdminError::WalSendersExhausted {
                max: self.max_wal_senders,
                in_use: self.wal_senders_in_use,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn capacity(slots: (i64, i64), senders: (i64, i64)) -> Capacity {
        Capacity {
            max_replication_slots: slots.0,
            slots_in_use: slots.1,
            max_wal_senders: senders.0,
            wal_senders_in_use: senders.1,
        }
    }

    #[test]
    fn postgres_13_and_older_are_refused_naming_the_minimum() {
        for (num, text) in [(130016, "13.16"), (120000, "12.0"), (90624, "9.6.24")] {
            let e = check_version(num, text).expect_err("too old");
            assert!(e.is_precondition(), "exit code 2");
            let msg = e.to_string();
            assert!(msg.contains(&format!("Postgres {text}")), "{msg}");
            assert!(msg.contains("needs Postgres 14 or newer"), "{msg}");
            assert!(
                !msg.trim_end_matches('.').contains(". "),
                "one sentence: {msg}"
            );
        }
        for num in [140000, 140023, 150018, 160014, 170010, 180004, 190000] {
            assert!(check_version(num, "x").is_ok(), "{num}");
        }
    }

    #[test]
    fn room_for_a_slot() {
        assert!(capacity((10, 9), (10, 9)).check_room_for_slot().is_ok());
    }

    #[test]
    fn slots_exhausted_names_the_setting() {
        let e = capacity((10, 10), (10, 0))
            .check_room_for_slot()
            .expect_err("full");
        assert!(matches!(e, AdminError::SlotsExhausted { max: 10 }));
        assert!(e.to_string().contains("raise max_replication_slots"));
        // max_replication_slots = 0 is the same condition.
        assert!(capacity((0, 0), (10, 0)).check_room_for_slot().is_err());
    }

    #[test]
    fn wal_senders_exhausted_names_the_setting() {
        for senders in [(0, 0), (5, 5)] {
            let e = capacity((10, 0), senders)
                .check_room_for_slot()
                .expect_err("no sender");
            assert!(matches!(e, AdminError::WalSendersExhausted { .. }));
            assert!(e.to_string().contains("raise max_wal_senders"));
        }
    }
}
