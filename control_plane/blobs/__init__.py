"""Content-addressed blob stores for encrypted model artifacts.

``open_blob_store(url)`` picks the backend from the URL scheme: ``file://`` or a plain
path for a local directory, ``s3://`` for S3 and S3-compatible services. The S3 store
(boto3) loads on first use: the CLI and the device agent rarely need its memory.
"""

from __future__ import annotations

import importlib
from typing import Any
from urllib.parse import urlsplit

from contract.errors import InvalidArgument
from control_plane.blobs.base import CHUNK_SIZE, BlobInfo, BlobStore, StoredBlob
from control_plane.blobs.local_blob_store import LocalBlobStore

__all__ = [
    "CHUNK_SIZE",
    "BlobInfo",
    "BlobStore",
    "LocalBlobStore",
    "S3BlobStore",
    "StoredBlob",
    "open_blob_store",
]


def open_blob_store(url: str) -> BlobStore:
    """Return the blob store named by ``url``; raise InvalidArgument for unknown schemes."""
    if not url:
        raise InvalidArgument("blob store URL is empty")
    scheme = urlsplit(url).scheme
    if scheme in ("", "file"):
        return LocalBlobStore.from_url(url)
    if scheme == "s3":
        from control_plane.blobs.s3_blob_store import S3BlobStore

        return S3BlobStore.from_url(url)
    raise InvalidArgument(f"unsupported blob store URL scheme {scheme!r}")


def __getattr__(name: str) -> Any:
    if name == "S3BlobStore":
        return importlib.import_module("control_plane.blobs.s3_blob_store").S3BlobStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
