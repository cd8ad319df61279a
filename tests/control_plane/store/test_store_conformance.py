"""One conformance suite for the registry store, run on SQLite and PostgreSQL."""

from __future__ import annotations

import datetime as dt
import threading
from dataclasses import replace

import pytest

from contract import errors
from control_plane.store import migrate
from control_plane.store.base import KekState, NewVersion, StaleKek, VariantRecord, WrappedKey
from control_plane.store.migrate import alembic_config
from control_plane.store.sql_store import SqlStore


@pytest.fixture
def store(db_url):
    s = SqlStore(db_url)
    yield s
    s.close()


def _variant(name="fp32", seed=0) -> VariantRecord:
    return VariantRecord(
        name=name,
        plaintext_size=100 + seed,
        plaintext_sha256=f"{seed:064x}",
        ciphertext_size=150 + seed,
        ciphertext_sha256=f"{seed + 1000:064x}",
        segment_size=1 << 20,
        signature={"inputs": [{"name": "x", "shape": [1, 4], "dtype": "float32"}]},
    )


def _builder(tag: str, variants=("fp32",)):
    def build(number: int) -> NewVersion:
        return NewVersion(
            uid=f"{tag}n{number:04d}".ljust(32, "0"),  # "n": "t1"+10 != "t10"+1
            created_at=dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
            created_by="admin",
            notes=f"note {number}",
            source_format="onnx",
            signature={"mnn_version": "3.6.1"},
            variants=tuple(_variant(v, seed=number * 10 + i) for i, v in enumerate(variants)),
            data_key=WrappedKey(kek_id="local:1", ciphertext=b"wrapped-" + tag.encode()),
            manifest=b'{"version": %d}' % number,
            manifest_signature=b"sig",
            signing_key_id="k1",
        )

    return build


def test_empty_store_has_nothing(store):
    assert store.list_models() == []
    with pytest.raises(errors.NotFound, match="'nope' not found"):
        store.get_model("nope")
    with pytest.raises(errors.NotFound):
        store.get_version("nope")
    with pytest.raises(errors.NotFound):
        store.list_versions("nope")


def test_versions_are_numbered_from_one_and_read_back(store):
    first = store.create_version("det", _builder("a", ("fp32", "int8")))
    second = store.create_version("det", _builder("b"))
    store.create_version("other", _builder("c"))
    assert (first.number, second.number) == (1, 2)
    assert [v.name for v in first.variants] == ["fp32", "int8"]
    assert first.variant("int8").plaintext_size == 111
    assert first.variant("fp16") is None
    latest = store.get_version("det")
    assert latest.number == 2 and latest.notes == "note 2"
    assert latest.created_at.tzinfo is not None
    assert store.get_version("det", 1) == first
    assert [v.number for v in store.list_versions("det")] == [1, 2]
    models = {m.name: m for m in store.list_models()}
    assert (models["det"].latest_version, models["det"].version_count) == (2, 2)
    assert list(models) == ["det", "other"]
    with pytest.raises(errors.NotFound, match="det:3"):
        store.get_version("det", 3)


def test_failed_build_leaves_no_row_and_no_gap(store):
    def explode(number: int) -> NewVersion:
        raise errors.Unavailable("kms down")

    with pytest.raises(errors.Unavailable):
        store.create_version("det", explode)
    assert store.list_models() == []
    assert store.create_version("det", _builder("a")).number == 1


def test_concurrent_pushes_get_distinct_gapless_numbers(store):
    numbers, failures = [], []

    def push(i: int) -> None:
        try:
            numbers.append(store.create_version("det", _builder(f"t{i}")).number)
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            failures.append(exc)

    threads = [threading.Thread(target=push, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    assert sorted(numbers) == list(range(1, 17))


def _builder_under(kek_id: str, tag: str):
    build = _builder(tag)
    return lambda number: replace(build(number), data_key=WrappedKey(kek_id, b"w-" + tag.encode()))


def test_kek_state_is_recorded_once(store):
    assert store.kek_state() is None
    first = store.init_kek_state(KekState("local:1", "/keys/kek.json", ()))
    assert first == KekState("local:1", "/keys/kek.json", ())
    # A second replica starting with another config does not overwrite it.
    assert store.init_kek_state(KekState("aws-kms:k", "aws-kms://k", ())) == first
    assert store.add_to_keyring("aws-kms://k").keyring == ("aws-kms://k",)
    assert store.add_to_keyring("aws-kms://k").keyring == ("aws-kms://k",)
    assert store.add_to_keyring("/keys/kek.json").keyring == ("aws-kms://k",)


def test_a_push_under_a_kek_that_is_not_active_is_refused(store):
    store.create_version("det", _builder("a"))  # no KEK state yet: nothing to check
    store.init_kek_state(KekState("local:1", "/keys/kek.json", ()))
    store.create_version("det", _builder("b"))
    with pytest.raises(StaleKek, match="local:2"):
        store.create_version("det", _builder_under("local:2", "c"))
    assert [v.number for v in store.list_versions("det")] == [1, 2]


def test_rotation_batches_and_activation(store):
    store.init_kek_state(KekState("local:1", "/keys/kek.json", ()))
    for tag in "abc":
        store.create_version("det", _builder(tag))
    store.add_to_keyring("aws-kms://k")
    first = store.data_keys_not_under("aws-kms:k", after=0, limit=2)
    assert [s.data_key.kek_id for s in first] == ["local:1", "local:1"]
    assert all(s.chunk_secret is None for s in first)  # made without one
    moves = [(s, WrappedKey("aws-kms:k", s.data_key.ciphertext + b"!"), None) for s in first]
    assert store.replace_data_keys(moves) == 2
    assert store.replace_data_keys(moves) == 0  # only rows still holding what was read
    # One data key is still under local:1, so the switch is refused and it is counted.
    assert store.activate_kek("aws-kms:k", "aws-kms://k") == 1
    assert store.kek_state().active_kek_id == "local:1"
    rest = store.data_keys_not_under("aws-kms:k", after=first[-1].row_id, limit=2)
    assert [s.uid for s in rest] == [store.get_version("det", 3).uid]
    with pytest.raises(errors.FailedPrecondition, match="chunk secret must move"):
        secret = WrappedKey("aws-kms:k", b"a secret it never had")
        store.replace_data_keys([(rest[0], WrappedKey("aws-kms:k", b"moved"), secret)])
    store.replace_data_keys([(rest[0], WrappedKey("aws-kms:k", b"moved"), None)])
    assert store.data_keys_not_under("aws-kms:k", after=0, limit=10) == []
    assert store.activate_kek("aws-kms:k", "aws-kms://k") == 0
    assert store.kek_state() == KekState("aws-kms:k", "aws-kms://k", ("/keys/kek.json",))
    assert store.get_version("det", 1).data_key == WrappedKey("aws-kms:k", b"wrapped-a!")
    with pytest.raises(StaleKek):
        store.create_version("det", _builder("d"))


def test_one_kek_rotation_at_a_time(store, db_url):
    other = SqlStore(db_url, migrate=False)  # another replica's store
    try:
        with store.kek_rotation_lock():
            with pytest.raises(errors.FailedPrecondition, match="another KEK rotation"):
                with other.kek_rotation_lock():
                    pass
        with other.kek_rotation_lock():
            pass
    finally:
        other.close()


def test_referenced_blobs(store):
    a = store.create_version("det", _builder("a", ("fp32", "int8")))
    assert store.referenced_blobs() == {v.ciphertext_sha256 for v in a.variants}


def test_tokens(store):
    now = dt.datetime.now(dt.UTC)
    made = store.add_token(name="admin", role="admin", token_sha256="ab" * 32, created_by="t")
    assert made.id.startswith("tok_") and made.expires_at is None
    assert store.find_token("ab" * 32) == made
    assert store.find_token("cd" * 32) is None
    with pytest.raises(errors.AlreadyExists):
        store.add_token(name="admin", role="admin", token_sha256="ef" * 32, created_by="t")
    soon = now + dt.timedelta(seconds=60)
    viewer = store.add_token(
        name="ci", role="viewer", token_sha256="12" * 32, created_by="admin", expires_at=soon
    )
    assert store.find_token("12" * 32).expires_at == soon
    assert [t.id for t in store.list_tokens(include_inactive=False, now=now)] == [
        made.id,
        viewer.id,
    ]
    later = now + dt.timedelta(seconds=61)
    assert store.find_token("12" * 32).state(later) == "expired"
    assert [t.id for t in store.list_tokens(include_inactive=False, now=later)] == [made.id]
    assert len(store.list_tokens(include_inactive=True, now=later)) == 2


def test_the_last_admin_token_cannot_be_revoked(store):
    now = dt.datetime.now(dt.UTC)
    first = store.add_token(name="a", role="admin", token_sha256="ab" * 32, created_by="t")
    second = store.add_token(name="b", role="admin", token_sha256="cd" * 32, created_by="t")
    assert store.revoke_token(first.id, now=now).state(now) == "revoked"
    with pytest.raises(errors.FailedPrecondition, match="is the last admin token"):
        store.revoke_token(second.id, now=now)
    assert store.has_admin_token(now=now)
    with pytest.raises(errors.NotFound):
        store.revoke_token("tok_nope", now=now)


def test_migrations_are_idempotent_and_reversible(db_url):
    from alembic import command

    store = SqlStore(db_url)
    store.create_version("det", _builder("a"))
    SqlStore(db_url).close()  # upgrading an up-to-date schema is a no-op
    assert store.get_version("det").number == 1
    config = alembic_config(store._engine)
    command.downgrade(config, "base")
    command.upgrade(config, "head")
    assert store.list_models() == []
    store.close()


def test_a_schema_at_head_is_not_migrated_again_and_an_older_one_is(db_url, monkeypatch):
    """The start-up check reads the version table; only a schema behind runs Alembic."""
    from alembic import command

    store = SqlStore(db_url)
    engine = store._engine
    assert migrate.current_revisions(engine) == migrate.head_revisions() != frozenset()
    runs = []
    real = command.upgrade
    monkeypatch.setattr(command, "upgrade", lambda *a, **k: (runs.append(a[1]), real(*a, **k)))
    SqlStore(db_url).close()
    assert runs == []
    command.downgrade(alembic_config(engine), "0010")
    assert migrate.current_revisions(engine) == {"0010"}
    SqlStore(db_url).close()
    assert runs == ["head"] and migrate.current_revisions(engine) == migrate.head_revisions()
    store.close()


def test_the_migrations_build_the_schema_the_orm_declares(db_url):
    """Migrated from nothing (the template is), the schema is the ORM's: no drift."""
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    from control_plane.store.orm import Base

    store = SqlStore(db_url)
    with store._engine.connect() as connection:
        context = MigrationContext.configure(connection, opts={"compare_type": True})
        assert compare_metadata(context, Base.metadata) == []
    store.close()


@pytest.mark.postgres
def test_unreachable_database_is_unavailable():
    with pytest.raises(errors.Unavailable, match="database unavailable"):
        SqlStore("postgresql+psycopg://postgres@127.0.0.1:1/nothing")


def test_rollup_rows_from_before_language_models_read_beside_theirs(db_url):
    """Rows that existed when 0011 added time to first token read with rows that have it."""
    from alembic import command

    from control_plane.store.rollup_aggregate import Aggregate
    from control_plane.store.rollup_records import EPOCH, FLEET, DeviceDelta, DeviceKey
    from runtime.histogram import SCHEME, bucket_of

    store = SqlStore(db_url)
    config = alembic_config(store._engine)
    command.downgrade(config, "0010")
    now = dt.datetime.now(dt.UTC).replace(microsecond=0)
    with store._engine.begin() as conn:
        _insert_devices(conn, (1, 2), now)
        conn.exec_driver_sql(  # a row as 0010's roller left it: no language-model columns
            "INSERT INTO device_rollups (key, scope, window_start, cohort, model, version,"
            " variant, config, device_id, device_class, last_seen, reports, inferences,"
            " errors, crashes, fallbacks, pipeline_firings, installs_activated,"
            " installs_failed, installs_rolled_back, crash_signals, latency_count,"
            " latency_sum_ns, latency_buckets) VALUES ('k1', '', '1970-01-01 00:00:00.000000',"
            " '', 'det', 1, 'fp32', 'CPU', 'dev_1', '{}', '2026-11-27 00:00:00', 1, 5, 0, 0,"
            " 0, 0, 0, 0, 0, '{}', 0, 0, x'')"
            if db_url.startswith("sqlite")
            else "INSERT INTO device_rollups (key, scope, window_start, cohort, model, version,"
            " variant, config, device_id, device_class, last_seen, reports, inferences,"
            " errors, crashes, fallbacks, pipeline_firings, installs_activated,"
            " installs_failed, installs_rolled_back, crash_signals, latency_count,"
            " latency_sum_ns, latency_buckets) VALUES ('k1', '', '1970-01-01 00:00:00+00',"
            " '', 'det', 1, 'fp32', 'CPU', 'dev_1', '{}', now(), 1, 5, 0, 0, 0, 0, 0, 0, 0,"
            " '{}', 0, 0, ''::bytea)"
        )
    command.upgrade(config, "head")
    llm = Aggregate(inferences=3)
    llm.ttft = Aggregate()
    llm.ttft.add_histogram(
        {
            "scheme": SCHEME,
            "count": 1,
            "sum_ns": 5_000_000,
            "min_ns": 5_000_000,
            "max_ns": 5_000_000,
            "buckets": [[bucket_of(5_000_000), 1]],
        }
    )
    key = DeviceKey(FLEET, EPOCH, "", "chat", 1, "q4", "CPU", "dev_2")
    store.apply_rollups([], {}, {key: DeviceDelta("{}", now, aggregate=llm)})
    table = store.device_table(FLEET)
    assert sorted(table.device_id) == ["dev_1", "dev_2"]
    assert table.ttft is not None and table.ttft.latency_count.tolist().count(1.0) == 1
    store.close()


def _insert_devices(conn, numbers, enrolled_at: dt.datetime) -> None:
    """Insert devices dev_<n> for each n, straight into the table (no enrollment)."""
    from control_plane.store import orm

    conn.execute(
        orm.DeviceRow.__table__.insert(),
        [
            {
                "id": f"dev_{i}",
                "credential_sha256": f"{i:064x}",
                "public_keyset": b"k",
                "attributes": {},
                "stamped_attributes": {},
                "enrollment_token_id": "t",
                "enrolled_at": enrolled_at,
            }
            for i in numbers
        ],
    )
