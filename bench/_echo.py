"""The bare-gRPC baseline for bench/sync.py: a unary echo on the same kind of server.

A grpc.aio server with the control plane's own SERVER_OPTIONS, in a process of its own,
with one `async def` unary method that takes raw bytes (no protobuf on either side) and
answers with the request padded to `--response-bytes` (the size of a real Sync answer).
It prints `echo listening on 127.0.0.1:PORT` and serves until SIGTERM.

    python bench/_echo.py --response-bytes 4000
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from control_plane.serve import SERVER_OPTIONS  # noqa: E402

SERVICE, METHOD = "skiff.bench.Echo", "Echo"
PATH = f"/{SERVICE}/{METHOD}"


async def serve(response_bytes: int) -> None:
    pad = b"\0" * response_bytes

    async def echo(request: bytes, context) -> bytes:
        return request + pad[: max(0, response_bytes - len(request))]

    server = grpc.aio.server(options=SERVER_OPTIONS)
    handler = grpc.unary_unary_rpc_method_handler(echo)  # no (de)serializers: raw bytes
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE, {METHOD: handler}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"echo listening on 127.0.0.1:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--response-bytes", type=int, required=True)
    asyncio.run(serve(parser.parse_args().response_bytes))


if __name__ == "__main__":
    main()
