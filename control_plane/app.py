"""The control plane's application object: every domain part, assembled once from a Config.

The one place the parts are wired together (the composition root), apart from any
transport: `control_plane.serve` puts gRPC (and any HTTP front-end) in front of an App,
tests and the demo build one directly, and front-ends such as the dashboard take one as
a plug-in. Nothing here opens a port.
"""

from __future__ import annotations

import datetime as dt
import functools
import threading
import time
from dataclasses import dataclass, field, replace

from control_plane.api.fleet_service import FleetView, RolloutOps
from control_plane.api.throttle import Throttle, enroll_throttle
from control_plane.blobs import open_blob_store
from control_plane.crypto import ManifestSigner, open_kek
from control_plane.fleet.devices import Fleet
from control_plane.fleet.writer import DeviceWriter
from control_plane.registry.kek_rotation import REWRAP_BATCH, KekRotation, Opener, open_keyring
from control_plane.registry.mnn_sandbox import Sandbox
from control_plane.registry.registry import Registry
from control_plane.registry.signers import SigningKeys
from control_plane.rollouts.changes import ChangeFeed
from control_plane.rollouts.delivery import Delivery
from control_plane.rollouts.guard import Guard
from control_plane.rollouts.resolver import Resolver
from control_plane.rollouts.service import Rollouts
from control_plane.rollouts.watchers import Watchers
from control_plane.settings import Config, write_config_file
from control_plane.store.sql_store import SqlStore
from control_plane.telemetry import Telemetry
from control_plane.telemetry.catalog import Catalog
from control_plane.telemetry.classes import parse_device_class
from control_plane.telemetry.recommend import Recommendations
from control_plane.telemetry.robust import check_robustness
from control_plane.telemetry.roller import Retention, Roller


def kek_opener(config: Config) -> Opener:
    """Return how this server opens KEK URLs: KMS only through its own KMS settings."""
    return functools.partial(
        open_kek, kms_endpoint=config.kms_endpoint, kms_region=config.kms_region
    )


def build_signing_keys(config: Config, store: SqlStore) -> SigningKeys:
    """Return the shared signing-key chain; the home's key file is its root if it has none."""
    keys = SigningKeys(
        store,
        keys_dir=config.home / "keys",
        kms_endpoint=config.kms_endpoint,
        kms_region=config.kms_region,
        default_overlap_s=config.signing_overlap_s,
    )
    keys.register_root(ManifestSigner.load(config.signing_key), config.signing_key)
    return keys


def build_registry(config: Config) -> Registry:
    """Open the store, blob store and keys named by `config`."""
    store = SqlStore(config.db, pool_size=config.db_pool_size)
    return Registry(
        store=store,
        blobs=open_blob_store(config.blobs),
        kek=open_keyring(store, kek_opener(config), kek=config.kek, keyring=config.kek_keyring),
        signer=build_signing_keys(config, store),
        max_model_bytes=config.max_model_bytes,
        mnn_timeout_s=config.mnn_timeout_s,
        max_concurrent_pushes=config.max_concurrent_pushes,
        max_concurrent_uploads=config.max_concurrent_uploads,
        sandbox=Sandbox.create(
            memory_bytes=config.mnn_memory_limit_bytes,
            cpu_seconds=config.mnn_cpu_limit_s or 2 * config.mnn_timeout_s,
            user=config.mnn_user,
        ),
        gc_grace_s=config.gc_grace_s,
        chunk_min_bytes=config.chunk_min_bytes,
    )


def kek_rotation(
    config: Config, registry: Registry, *, batch_size: int = REWRAP_BATCH
) -> KekRotation:
    """Return the KEK rotation RotateKek runs, recording each step in skiff.json."""
    lock = threading.Lock()
    current = config

    def persist(active_url: str, keyring: tuple[str, ...]) -> None:
        nonlocal current
        with lock:
            current = replace(current, kek=active_url, kek_keyring=keyring)
            write_config_file(current)

    return KekRotation(
        registry.store,
        registry.kek,
        opener=kek_opener(config),
        persist=persist,
        batch_size=batch_size,
    )


@dataclass
class App:
    """Every part of a control plane, assembled once per process."""

    config: Config
    registry: Registry
    fleet: Fleet
    resolver: Resolver
    rollouts: Rollouts
    delivery: Delivery
    feed: ChangeFeed
    writer: DeviceWriter
    watchers: Watchers
    telemetry: Telemetry
    roller: Roller
    guard: Guard
    recommendations: Recommendations
    view: FleetView
    ops: RolloutOps
    # Bad enrollment tokens, per client address and overall (in memory, per replica).
    enroll_throttle: Throttle = field(default_factory=enroll_throttle)

    @property
    def store(self) -> SqlStore:
        """Return the one SQL store every part shares."""
        return self.registry.store


def build_app(config: Config, registry: Registry | None = None) -> App:
    """Assemble the domain (no network yet)."""
    device_class = parse_device_class(config.device_class)  # a bad setting fails first
    check_robustness(config.guard_outliers, config.recommend_min_devices)
    registry = registry or build_registry(config)
    store = registry.store
    resolver = Resolver(store, needs=registry.variant_needs)
    fleet = Fleet(store, default_enroll_ttl_s=config.enroll_ttl_s)
    feed = ChangeFeed(store)
    watchers = Watchers(resolver=resolver, store=store)
    # Order matters: the resolver must see a change before watchers recompute with it.
    for subscriber in (resolver.invalidate, fleet.on_change, watchers.on_change):
        feed.subscribe(subscriber)
    delivery = Delivery(
        store=store,
        blobs=registry.blobs,
        kek=lambda: registry.kek,
        signer=registry.signer,
        resolver=resolver,
        assignment_ttl_s=config.assignment_ttl_s,
        presign_ttl_s=config.presign_ttl_s,
        clock=lambda: dt.datetime.now(dt.UTC),
        monotonic=time.monotonic,
    )
    retention = Retention(
        minute=dt.timedelta(hours=config.rollup_minute_retention_h),
        hour=dt.timedelta(days=config.rollup_hour_retention_d),
        day=dt.timedelta(days=config.rollup_day_retention_d),
        raw=dt.timedelta(hours=config.telemetry_raw_retention_h),
    )
    roller = Roller(store, resolver, device_class, retention=retention)
    rollouts = Rollouts(store, resolver, device_class=device_class)
    writer = DeviceWriter(store, interval_s=config.device_flush_s)
    telemetry = Telemetry(store, on_stored=roller.offer, catalog=Catalog(store))
    guard = Guard(store, rollouts, device_class, outliers=config.guard_outliers)
    view = FleetView(fleet, resolver, watchers, writer, telemetry)
    return App(
        config=config,
        registry=registry,
        fleet=fleet,
        resolver=resolver,
        rollouts=rollouts,
        delivery=delivery,
        feed=feed,
        writer=writer,
        watchers=watchers,
        telemetry=telemetry,
        roller=roller,
        guard=guard,
        recommendations=Recommendations(
            store,
            device_class,
            min_devices=config.recommend_min_devices,
            outliers=config.guard_outliers,
        ),
        view=view,
        ops=RolloutOps(rollouts, view, guard),
    )
