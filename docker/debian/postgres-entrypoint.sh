#!/bin/bash
# The official postgres image's start-up, in short (docker/debian/postgres.Containerfile):
# on an empty $PGDATA, initdb with POSTGRES_USER/POSTGRES_PASSWORD, create POSTGRES_DB,
# run /docker-entrypoint-initdb.d/*.sql and *.sh against it on a server that listens
# on its Unix socket only; then run the command (`postgres ...`) as the postgres user.
# PGPORT sets the port (with --network host every service needs its own).
set -euo pipefail

as_postgres() { setpriv --reuid=postgres --regid=postgres --init-groups "$@"; }

if [ "${1:-}" = "postgres" ]; then
    shift
    mkdir -p "$PGDATA"
    chown postgres:postgres "$PGDATA"
    chmod 700 "$PGDATA"
    if [ ! -s "$PGDATA/PG_VERSION" ]; then
        user="${POSTGRES_USER:-postgres}"
        db="${POSTGRES_DB:-$user}"
        : "${POSTGRES_PASSWORD:?POSTGRES_PASSWORD is not set}"
        pwfile="$(mktemp)"
        printf '%s\n' "$POSTGRES_PASSWORD" > "$pwfile"
        chown postgres "$pwfile"
        as_postgres initdb -D "$PGDATA" -U "$user" --pwfile="$pwfile" \
            --auth-local=trust --auth-host=scram-sha-256 >/dev/null
        rm -f "$pwfile"
        echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
        as_postgres pg_ctl -D "$PGDATA" -w -o "-c listen_addresses='' -p ${PGPORT:-5432}" start >/dev/null
        export PGHOST=/var/run/postgresql PGUSER="$user"
        if [ "$db" != "postgres" ]; then
            as_postgres psql -X -q -v ON_ERROR_STOP=1 -d postgres -c "CREATE DATABASE \"$db\""
        fi
        for f in /docker-entrypoint-initdb.d/*; do
            case "$f" in
                *.sql) echo "initdb: running $f"; as_postgres psql -X -q -v ON_ERROR_STOP=1 -d "$db" -f "$f" ;;
                *.sh) echo "initdb: running $f"; . "$f" ;;
                *) ;;
            esac
        done
        unset PGHOST PGUSER
        as_postgres pg_ctl -D "$PGDATA" -w -m fast stop >/dev/null
        echo "initdb: done"
    fi
    exec setpriv --reuid=postgres --regid=postgres --init-groups postgres -D "$PGDATA" "$@"
fi
exec "$@"
