"""Load client for bench/sync.py: the same grpc.aio client drives Sync and the echo.

One process per client; bench/sync.py starts them with a pickle of this client's devices
(authorization header, worst-case and steady-state SyncRequest bytes) and drives rounds
over stdin/stdout, one JSON line each way:

    {"op": "run", "target": "sync"|"echo", "mode": "worst"|"steady"|"warm", "start": T0,
     "end": T1}
    -> {"ok": N, "failed": {"CODE": n}, "latency_ms": [p50, p99], "calls": N}

Calls start at once (warm-up) and stop at T1; `ok` counts calls that completed OK
between T0 and T1 (wall clock, shared with the parent). Requests and answers are raw
bytes, so the client does the same work for Sync and for the echo. Devices are taken
round-robin from one counter that carries on across rounds, so no device repeats until
the whole list has been used.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pickle
import sys
import time

import grpc

SYNC_PATH = "/skiff.v1.DeviceService/Sync"
ECHO_PATH = "/skiff.bench.Echo/Echo"
DEADLINE_S = 30.0
CHANNEL_OPTIONS = [
    # Channels to one address would otherwise share one connection (the global subchannel
    # pool); each channel here is meant to be its own HTTP/2 connection.
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.max_receive_message_length", 8 << 20),
]


class Client:
    def __init__(self, devices: dict, concurrency: int, channels: dict[str, list]) -> None:
        auth = [(("authorization", a),) for a in devices["auth"]]
        # "warm": the steady requests of the first few devices only, over and over, so
        # the server has their credentials cached (a device that Synced this hour).
        warm = devices.get("warm", 0)
        self._modes = {
            "worst": (auth, devices["worst"]),
            "steady": (auth, devices["steady"]),
            "warm": (auth[:warm], devices["steady"][:warm]),
        }
        self._concurrency = concurrency
        self._calls = {
            target: [ch.unary_unary(path) for ch in chans]
            for (target, chans), path in zip(channels.items(), (SYNC_PATH, ECHO_PATH), strict=True)
        }
        self._next = 0

    async def run(self, target: str, mode: str, start: float, end: float) -> dict:
        auth, requests = self._modes[mode]
        calls = self._calls[target]
        ok, latencies, failed, total = 0, [], {}, 0

        async def worker(call) -> None:
            nonlocal ok, total
            n = len(requests)
            while time.time() < end:
                i = self._next % n
                self._next += 1
                began = time.time()
                try:
                    await call(requests[i], metadata=auth[i], timeout=DEADLINE_S)
                except grpc.aio.AioRpcError as exc:
                    name = exc.code().name
                    failed[name] = failed.get(name, 0) + 1
                    continue
                finally:
                    total += 1
                done = time.time()
                if start <= done < end:
                    ok += 1
                    latencies.append(done - began)

        await asyncio.gather(*(worker(calls[j % len(calls)]) for j in range(self._concurrency)))
        latencies.sort()
        pct = [
            latencies[int(q * (len(latencies) - 1))] * 1e3 if latencies else 0.0
            for q in (0.5, 0.99)
        ]
        return {"ok": ok, "failed": failed, "latency_ms": pct, "calls": total}


async def main_async(args: argparse.Namespace) -> None:
    with open(args.devices, "rb") as f:
        devices = pickle.load(f)
    # This process's share: every M-th device from the K-th, the warm ones among the first.
    part, parts = args.part
    warm = len(range(part, devices.get("warm", 0), parts))
    devices = {k: devices[k][part::parts] for k in ("auth", "worst", "steady")} | {"warm": warm}
    channels = {
        "sync": [
            grpc.aio.insecure_channel(args.sync, options=CHANNEL_OPTIONS)
            for _ in range(args.channels)
        ],
        "echo": [
            grpc.aio.insecure_channel(args.echo, options=CHANNEL_OPTIONS)
            for _ in range(args.channels)
        ],
    }
    for chans in channels.values():
        for ch in chans:
            await asyncio.wait_for(ch.channel_ready(), 10)
    client = Client(devices, args.concurrency, channels)
    loop = asyncio.get_running_loop()
    print(json.dumps({"ready": len(devices["auth"])}), flush=True)
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        result = await client.run(cmd["target"], cmd["mode"], cmd["start"], cmd["end"])
        print(json.dumps(result), flush=True)
    for chans in channels.values():
        for ch in chans:
            await ch.close()


def part_of(value: str) -> tuple[int, int]:
    """Parse K/M (0 <= K < M) for --part."""
    k, _, m = value.partition("/")
    try:
        part, parts = int(k), int(m)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected K/M, got {value!r}") from None
    if not 0 <= part < parts:
        raise argparse.ArgumentTypeError(f"expected 0 <= K < M, got {value!r}")
    return part, parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", required=True, help="pickle written by bench/sync.py")
    parser.add_argument("--sync", required=True, help="control plane address")
    parser.add_argument("--echo", required=True, help="echo server address")
    parser.add_argument("--concurrency", type=int, default=32, help="calls in flight")
    parser.add_argument("--channels", type=int, default=2, help="connections per target")
    parser.add_argument(
        "--part",
        type=part_of,
        default=(0, 1),
        help="K/M: only every M-th device of the file, from the K-th (clients sharing a file)",
    )
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
