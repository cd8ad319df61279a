"""Attacks on Watch, revocation and rollouts: races, concurrent promotes, bad requests.

Shared fixtures and helpers: _attack_helpers.py.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time

import grpc
import pytest

from contract import errors
from contract.device_client import DeviceCallError
from protos import fleet_pb2
from tests.control_plane.api._attack_helpers import (
    ANDROID,
    code_of,
    enroll,
    rollout,
)
from tests.control_plane.api._attack_helpers import fresh as fresh  # fixture
from tests.control_plane.api._attack_helpers import plane as plane  # fixture
from tests.control_plane.api._attack_helpers import run_id as run_id  # fixture
from tests.control_plane.api.device_helpers import Watching

# -- problems the review confirmed (each failed before its fix) -------------------------------


def _revoked_right_after_its_read(cp, monkeypatch) -> list[str]:
    """Revoke the device right after its Watch stream reads it back; return that read's ids.

    The revocation's change reaches the watchers while the stream is still loading.
    """
    real = cp.app.store.watch_states
    fired: list[str] = []

    def read_then_revocation_commits(device_ids):
        states = real(device_ids)
        if not fired:
            fired.extend(device_ids)
            cp.app.fleet.revoke(device_ids[0], reason="stolen")
        return states

    monkeypatch.setattr(cp.app.store, "watch_states", read_then_revocation_commits)
    return fired


def test_watch_opened_while_revocation_commits_is_closed(plane, run_id, monkeypatch):
    """A Watch stream registered just after a revocation stays open.

    Watch authenticates, then awaits the device record (a DB round trip), then registers
    its stream. A revocation committing in that window is processed by `Watchers._recheck`
    before the stream exists, so nothing closes it: the revoked device holds a stream (and
    shows online) until it disconnects, contrary to "Refuses the device at once, including
    its open Watch streams".
    """
    cp = plane
    device = enroll(cp, run_id)
    device.sync()
    fired = _revoked_right_after_its_read(cp, monkeypatch)
    with Watching(device) as watching:
        watching.wait(1, timeout=3)
        open_after = cp.app.watchers.is_online(device.id)
        error = watching.error
    assert fired == [device.id]
    assert not open_after, "a revoked device's Watch stream is still registered"
    assert isinstance(error, DeviceCallError) and error.code == grpc.StatusCode.PERMISSION_DENIED


def test_a_revoked_device_behind_its_desired_state_loses_its_stream_too(plane, run_id, monkeypatch):
    """The same race, for a device that never synced what it should run (helper-53).

    Opening, the stream tells such a device it missed a change: that push replaced the
    revocation queued meanwhile, so the stream sent one revision and then stayed open for
    good, held by no one (out of the registry, never pushed to or closed again). Any device
    can be behind: it only has to watch from revision 0 and not sync.
    """
    cp = plane
    device = enroll(cp, run_id)
    rollout(cp, run_id, 1)  # its desired state: det:1, which it never syncs
    fired = _revoked_right_after_its_read(cp, monkeypatch)
    with Watching(device, revision=0) as watching:
        watching.wait(2, timeout=30)  # returns as soon as the stream ends
        events, error = list(watching.events), watching.error
    assert fired == [device.id]
    assert isinstance(error, DeviceCallError), f"still open after {events}"
    assert error.code == grpc.StatusCode.PERMISSION_DENIED
    assert not cp.app.watchers.is_online(device.id)


def test_watch_hears_a_change_while_another_thread_reloads_the_snapshot(plane, run_id, monkeypatch):
    """A Watch stream can miss a change for good (until the 300 s poll), rollbacks too.

    `Resolver.snapshot` clears `_stale` before it reloads, and its fast path returns the
    current (old) snapshot whenever `_stale` is clear. If any thread (a Download, an
    operator's GetDevice or GetRollout) is reloading when a change lands, the watchers'
    recheck on the event loop gets the pre-change snapshot, sees no difference, and
    nobody rechecks again once the new snapshot is in. The recheck should wait for a
    snapshot at least as new as the change's revision.
    """
    cp = plane
    device = enroll(cp, run_id)
    device.sync()
    resolver, store = cp.app.resolver, cp.app.store
    real_list = store.list_rollouts
    loading, proceed = threading.Event(), threading.Event()

    def slow_list(**kw):
        if threading.current_thread().name == "reloader":
            loading.set()
            proceed.wait(5)
        return real_list(**kw)

    monkeypatch.setattr(store, "list_rollouts", slow_list)
    reloaders: list[threading.Thread] = []

    def someone_reloads(change):
        if not reloaders and change.kind == "rollout":
            reloaders.append(threading.Thread(target=resolver.snapshot, name="reloader"))
            reloaders[0].start()
            loading.wait(5)  # it has cleared `_stale` and is reading rollouts

    subscribers = cp.app.feed._subscribers
    subscribers.insert(subscribers.index(cp.app.watchers.on_change), someone_reloads)
    try:
        with Watching(device) as watching:
            time.sleep(0.3)
            rollout(cp, run_id, 1)
            time.sleep(0.5)  # the loop rechecks its watchers meanwhile
            proceed.set()
            reloaders[0].join(5)
            heard = watching.wait(1, timeout=3)
    finally:
        subscribers.remove(someone_reloads)
        proceed.set()
    assert resolver.snapshot().desired(device.id, {**ANDROID, "custom": {"run": run_id}})
    assert heard, "the watching device was never told about the new rollout"


def test_int64_fields_past_int32_columns_are_invalid_argument(fresh):
    """The API's int64 fields are int32 columns on PostgreSQL: CreateEnrollmentToken with
    uses=2**31 and CreateRollout with version=2**40 fail in the database, and the
    operator gets INTERNAL ("database error: DataError") instead of INVALID_ARGUMENT or
    NOT_FOUND. (SQLite stores or compares them without complaint.)"""
    cp = fresh
    with cp.client() as client:
        try:
            made = client.create_enrollment_token(uses=2**31)
            assert made.uses == 2**31
        except errors.InvalidArgument:
            pass
        with pytest.raises((errors.InvalidArgument, errors.NotFound)):
            client.create_rollout(fleet_pb2.CreateRolloutRequest(model="det", version=2**40))


# -- attacks that are refused today (regression tests) ----------------------------------------


def test_one_watch_stream_per_device_and_revoked_devices_stay_out(plane, run_id, monkeypatch):
    cp = plane
    device = enroll(cp, run_id)
    device.sync()
    streams = [Watching(device) for _ in range(5)]
    for w in streams:
        w.__enter__()
        time.sleep(0.2)
    try:
        assert cp.app.watchers.is_online(device.id)
        assert all(not w._thread.is_alive() for w in streams[:-1])  # older ones were replaced
        with cp.client() as client:
            client.revoke_device(device.id, "lost")
        assert streams[-1].wait(1, timeout=3) is False
        assert streams[-1].error.code == grpc.StatusCode.PERMISSION_DENIED
    finally:
        for w in streams:
            w.__exit__(None, None, None)
    assert code_of(lambda: device.next_watch_event(1)) == grpc.StatusCode.PERMISSION_DENIED
    # A revoked device hammering Sync costs no database lookups (its refusal is cached).
    lookups = []
    real = cp.app.store.find_device
    monkeypatch.setattr(cp.app.store, "find_device", lambda d: lookups.append(d) or real(d))
    for _ in range(30):
        assert code_of(device.sync_raw) == grpc.StatusCode.PERMISSION_DENIED
    assert len(lookups) <= 1


def test_repeated_or_concurrent_promotes_advance_one_stage(plane, run_id):
    """A promote sent twice (a client retry after a lost answer: AdminClient retries
    UNAVAILABLE; a double-click; two operators at once) advances the rollout twice: it
    skips a stage, or completes, without baking.

    The conditional update only guards against lost updates; each promote re-reads the
    current stage first, so one arriving a moment after another promotes again. 8
    promotes sent at once took a 1% canary several stages on SQLite. The request should
    say which stage it promotes from (`expected_stage`, filled by the CLI from what the
    operator saw) or carry an idempotency key, and be refused with FAILED_PRECONDITION
    when the rollout has moved on; this test sends `expected_stage` when the field exists.
    """
    cp = plane
    fields = fleet_pb2.TransitionRolloutRequest.DESCRIPTOR.fields_by_name

    def promote_from_stage_1(rollout_id):
        request = fleet_pb2.TransitionRolloutRequest(id=rollout_id, action="promote")
        if "expected_stage" in fields:
            setattr(request, "expected_stage", 1)  # noqa: B010 - stages are numbered from 1
        with cp.client() as client:
            try:
                client._unary(client._rollouts.TransitionRollout, request)
                return "ok"
            except errors.FailedPrecondition:
                return "refused"

    def shown(rollout_id):
        with cp.client() as client:
            r = client.get_rollout(rollout_id)
        return r.stage, r.state, [e.action for e in r.audit]

    # The same promote, retried.
    retried = rollout(cp, run_id, 1, stages=[1, 5, 10, 50, 100])
    assert promote_from_stage_1(retried.id) == "ok"
    promote_from_stage_1(retried.id)
    assert shown(retried.id) == (2, "active", ["create", "promote"])

    # Eight at once.
    burst = rollout(cp, run_id, 1, stages=[1, 5, 10, 50, 100])
    barrier = threading.Barrier(8)

    def at_once(_):
        barrier.wait()
        return promote_from_stage_1(burst.id)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(at_once, range(8)))
    assert shown(burst.id) == (2, "active", ["create", "promote"]), results
    assert results.count("ok") == 1


def test_error_messages_do_not_echo_unbounded_input(plane, run_id):
    """A NotFound for a 20 KB variant (or model) name echoes the whole name, which is
    past gRPC's 8 KiB metadata limit: the operator sees "Stream removed (received
    metadata size exceeds soft limit)" instead of NOT_FOUND. Echoed input should be
    truncated (as the attribute errors do with !r:.80) or refused as too long."""
    cp = plane
    for kw in ({"variant": "x" * 20_000}, {"model": "m" * 20_000}):
        request = {"model": "det", "version": 1, **kw}
        with cp.client() as client:
            with pytest.raises((errors.NotFound, errors.InvalidArgument)):
                client.create_rollout(fleet_pb2.CreateRolloutRequest(**request))


def test_rollout_requests_out_of_range(plane, run_id):
    cp = plane
    for kw in (
        {"stages": [float(i) for i in range(1, 101)]},
        {"stages": [float("nan"), 100]},
        {"stages": [0, 100]},
        {"stages": [100, 100]},
        {"priority": 2**31 - 1},
        {"bake_s": 2**62},
        {"version": -1},
        {"variant": "int4"},
        {"variant": "x" * 100},
        {"selector": "device_model~" + "*a" * 3000},
    ):
        with pytest.raises((errors.InvalidArgument, errors.NotFound)):
            rollout(cp, run_id, **{"version": 1, **kw})
    # A slow-looking glob against long values is evaluated quickly (no backtracking blowup).
    device = enroll(cp, run_id, {**ANDROID, "device_model": "a" * 128})
    rollout(cp, run_id, 1, 'device_model~"' + "*a" * 40 + '*b"')
    started = time.monotonic()
    assert device.sync().models == {}
    assert time.monotonic() - started < 1.0
