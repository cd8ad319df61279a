"""Review probe: a blob store that yields an empty piece (b"") before the end."""

from __future__ import annotations

import asyncio

import pytest

from control_plane.api.device_service import DeviceServicer
from protos import device_pb2


class _Fleet:
    def authenticate(self, authorization, *, cached_only=False):
        return object()


class _Context:
    def invocation_metadata(self):
        return (("authorization", "Bearer skd_x"),)

    async def abort(self, code, details=""):
        raise RuntimeError(f"aborted {code} {details}")


@pytest.mark.parametrize("pieces", [[b"", b"a" * 10], [b"a" * 5, b"", b"b" * 5]])
def test_an_empty_piece_does_not_end_a_download_early(pieces):
    servicer = DeviceServicer.__new__(DeviceServicer)
    servicer._fleet = _Fleet()
    gen = iter(pieces)
    servicer._open = lambda authorization, request: (10, next(gen), gen)

    async def main():
        stream = servicer.Download(device_pb2.DownloadRequest(artifact="x"), _Context())
        return b"".join([c.data async for c in stream])

    assert asyncio.run(main()) == b"".join(pieces)
