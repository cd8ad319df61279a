"""Assembles the control plane from a Config and serves it over gRPC."""

from __future__ import annotations

import logging
import signal
import threading
from concurrent import futures
from dataclasses import replace

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from control_plane import errors
from control_plane.api.admin_service import AdminServicer
from control_plane.api.auth import Authenticator
from control_plane.blobs import open_blob_store
from control_plane.crypto import KeyEncryptionKey, LocalKek, ManifestSigner, open_kek
from control_plane.registry.registry import Registry
from control_plane.settings import Config, write_config_file
from control_plane.store.sql_store import SqlStore
from protos import admin_pb2, admin_pb2_grpc

log = logging.getLogger(__name__)

# Uploads arrive in 1 MiB chunks; leave headroom for the envelope.
MAX_MESSAGE_BYTES = 8 << 20
WORKERS = 16


def build_registry(config: Config) -> Registry:
    """Open the store, blob store and keys named by `config`."""
    return Registry(
        store=SqlStore(config.db),
        blobs=open_blob_store(config.blobs),
        kek=open_kek(config.kek),
        signer=ManifestSigner.load(config.signing_key),
        max_model_bytes=config.max_model_bytes,
        mnn_timeout_s=config.mnn_timeout_s,
        max_concurrent_pushes=config.max_concurrent_pushes,
    )


def kek_factory(config: Config, registry: Registry):
    """Return the function RotateKek uses to make the next KEK, persisting the choice."""
    lock = threading.Lock()

    def next_kek(url: str) -> KeyEncryptionKey:
        with lock:
            if not url:
                if not isinstance(registry.kek, LocalKek):
                    raise errors.InvalidArgument(
                        "the active KEK is not a local key file: name the new KEK"
                    )
                # Rotate what is on disk, not the in-memory copy: an earlier attempt that
                # failed after adding its key must not block this one.
                return LocalKek.load(registry.kek.path).rotate()
            new = open_kek(url)
            write_config_file(replace(config, kek=url))
            return new

    return next_kek


def create_server(config: Config, registry: Registry, address: str) -> tuple[grpc.Server, int]:
    """Build (not start) a gRPC server on `address`; returns it with the bound port."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="skiff-rpc"),
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ],
    )
    servicer = AdminServicer(
        registry, Authenticator(registry.store), kek_factory=kek_factory(config, registry)
    )
    admin_pb2_grpc.add_AdminServiceServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    service_names = (
        admin_pb2.DESCRIPTOR.services_by_name["AdminService"].full_name,
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        reflection.SERVICE_NAME,
    )
    reflection.enable_server_reflection(service_names, server)
    for name in ("", service_names[0]):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    port = server.add_insecure_port(address)
    if port == 0:
        raise errors.Unavailable(f"cannot listen on {address}")
    return server, port


def start_server(*, config: Config, address: str | None = None) -> tuple[grpc.Server, int]:
    """Build the registry and a started server; the caller stops it."""
    registry = build_registry(config)
    server, port = create_server(config, registry, address or config.grpc)
    server.start()
    log.info("skiff control plane listening on port %d", port)
    return server, port


def serve(*, config: Config) -> None:
    """Run the server until SIGINT/SIGTERM, then drain in-flight calls."""
    server, port = start_server(config=config)
    host = config.grpc.rsplit(":", 1)[0]
    print(f"skiff server listening on {host}:{port} (home {config.home})", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.stop(grace=10).wait()
