"""A stream that is closed (revoked, or replaced by the device's newer stream) stays closed.

Opening, a stream tells a device that is behind its desired state that it missed a change.
That push used to replace a close queued while the stream loaded its device: the stream
then sent one revision and stayed open for good, held by no one (helper-53's review).
"""

from __future__ import annotations

import asyncio

from contract import errors
from control_plane.rollouts.watchers import Watchers, fingerprint
from control_plane.store.fleet import Change


class _Desired:
    version, variant = 2, "fp32"


class _Snapshot:
    revision = 7

    def desired(self, device_id, attrs):
        return {"det": _Desired()}  # the devices here synced nothing: always behind


class _Resolver:
    def snapshot(self):
        return _Snapshot()

    def current(self):
        return _Snapshot()


class _Store:
    def set_online(self, ids, until):
        pass


async def _next(stream, timeout: float = 10.0):
    """The stream's next item, "ended" when it ends, or "open" if it just waits."""
    try:
        return await asyncio.wait_for(stream.__anext__(), timeout)
    except StopAsyncIteration:
        return "ended"
    except TimeoutError:
        return "open"


def test_a_revocation_while_the_stream_loads_closes_it_though_the_device_is_behind():
    async def scenario():
        watchers = Watchers(resolver=_Resolver(), store=_Store())
        await watchers.start()
        rechecked = asyncio.Event()
        recheck = watchers._recheck

        def recheck_then_tell():
            recheck()
            rechecked.set()

        watchers._recheck = recheck_then_tell

        async def load():  # the device was read live; its revocation lands right after
            watchers.on_change(Change(8, "device", "dev_a"))
            await rechecked.wait()  # processed (the stream closed) before the load returns
            return {}, fingerprint({})

        stream = watchers.stream("dev_a", 0, load)
        try:
            return await _next(stream)
        except errors.PermissionDenied as exc:
            return str(exc)
        finally:
            await watchers.stop()

    assert asyncio.run(scenario()) == "device dev_a is revoked"


def test_a_stream_replaced_while_it_loads_ends():
    async def scenario():
        watchers = Watchers(resolver=_Resolver(), store=_Store())
        release = asyncio.Event()

        async def slow_load():
            await release.wait()
            return {}, fingerprint({})

        async def fast_load():
            return {}, fingerprint({})

        first = watchers.stream("dev_a", 0, slow_load)
        first_next = asyncio.create_task(_next(first))
        await asyncio.sleep(0)  # registered, loading
        second = watchers.stream("dev_a", 0, fast_load)  # the device's newer connection
        second_next = asyncio.create_task(_next(second))
        await asyncio.sleep(0)
        release.set()
        return await first_next, await second_next

    first, second = asyncio.run(scenario())
    assert first == "ended"  # not a revision, then open for good
    assert second == 7  # the newer stream tells the device what it missed
