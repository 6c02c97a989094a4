#!/usr/bin/env bash
# Start a throwaway PostgreSQL server for the results-store tests and print its URL on stdout:
#   export PAGEDLAB_TEST_POSTGRES_URL=$(.ci/start-postgres.sh)
# Installs Debian's postgresql if needed, then creates (once) and starts a cluster "pagedlab" on
# 127.0.0.1:${PAGEDLAB_PG_PORT:-54329} with a role and database "pagedlab". Safe to run as root and
# to run again (it reuses the running cluster). Everything but the URL goes to stderr.
set -euo pipefail
port="${PAGEDLAB_PG_PORT:-54329}"
cluster=pagedlab
user=pagedlab
password=pagedlab
db=pagedlab_test
log() { echo "start-postgres: $*" >&2; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

if ! ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1; then
  log "installing Debian's postgresql"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >&2
fi
version=$(ls /usr/lib/postgresql | sort -V | tail -n 1)

if ! pg_lsclusters -h | awk '{print $1" "$2}' | grep -qx "$version $cluster"; then
  log "creating cluster $version/$cluster on port $port"
  as_root pg_createcluster "$version" "$cluster" -p "$port" -- --auth-local=peer --auth-host=scram-sha-256 >&2
  conf="/etc/postgresql/$version/$cluster/postgresql.conf"
  as_root sed -i "s/^#\?listen_addresses.*/listen_addresses = '127.0.0.1'/" "$conf"
  # throwaway test server: durability is not needed, speed is
  printf "fsync = off\nsynchronous_commit = off\nfull_page_writes = off\n" | as_root tee -a "$conf" >/dev/null
fi
port=$(pg_lsclusters -h | awk -v v="$version" -v c="$cluster" '$1==v && $2==c {print $3}')
if ! pg_lsclusters -h | awk -v v="$version" -v c="$cluster" '$1==v && $2==c {print $4}' | grep -q online; then
  log "starting cluster $version/$cluster"
  as_root pg_ctlcluster "$version" "$cluster" start >&2
fi
for _ in $(seq 1 30); do
  as_root su postgres -c "pg_isready -q -h 127.0.0.1 -p $port" && break
  sleep 1
done

psql_admin() { as_root su postgres -c "psql -v ON_ERROR_STOP=1 -qtA -p $port -c \"$1\""; }
if [ "$(psql_admin "SELECT 1 FROM pg_roles WHERE rolname='$user'")" != 1 ]; then
  psql_admin "CREATE ROLE $user LOGIN PASSWORD '$password'" >&2
fi
if [ "$(psql_admin "SELECT 1 FROM pg_database WHERE datname='$db'")" != 1 ]; then
  psql_admin "CREATE DATABASE $db OWNER $user" >&2
fi
log "ready on 127.0.0.1:$port (database $db)"
echo "postgresql+psycopg2://$user:$password@127.0.0.1:$port/$db"
