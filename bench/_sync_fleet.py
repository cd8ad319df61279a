"""A realistic fleet for bench/sync.py: models, rollouts, bulk devices, expected answers.

Models and rollouts go through the admin API, as an operator's would. Devices are
inserted straight into the database (enrolling 100k through Enroll would take minutes),
shaped like the one device this module does enroll through Enroll: its enrollment token,
its public keyset (every bulk device shares it: it only wraps keys, and sharing it lets
the check below open every wrapped key), canonical attributes, no stamped attributes.
What each device should be told is computed with the server's own resolver over the
same database, and `verify` checks real Sync answers against it end to end with the
device agent's own verifier.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import random
import secrets
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
from sqlalchemy import create_engine, insert

from contract.assignment import load_public_keys, new_nonce, verify_sync
from contract.key_wrap import DeviceKeyPair
from control_plane.api.client import AdminClient
from control_plane.api.fleet_convert import attributes_dict, attributes_pb
from control_plane.demo import sample_models
from control_plane.fleet.attributes import normalize_attributes
from control_plane.fleet.selector import parse_selector
from control_plane.rollouts.lifecycle import MAX_BAKE_S
from control_plane.rollouts.resolver import Desired, Resolver
from control_plane.store import orm
from control_plane.store.sql_store import SqlStore
from protos import device_pb2, device_pb2_grpc, fleet_pb2

# (device_model, soc) per platform, os versions, RAM sizes.
HARDWARE = {
    "android": [
        ("Pixel 8 Pro", "tensor-g3"),
        ("Pixel 7", "tensor-g2"),
        ("Galaxy S24", "sm8650"),
        ("Galaxy S23", "sm8550"),
        ("Galaxy S22", "sm8450"),
        ("Galaxy A54", "exynos1380"),
        ("OnePlus 12", "sm8650"),
        ("Xiaomi 13", "sm8550"),
        ("Redmi Note 12", "sm6225"),
        ("moto g84", "sm6375"),
    ],
    "ios": [
        ("iPhone 15 Pro", "a17"),
        ("iPhone 15", "a16"),
        ("iPhone 14", "a15"),
        ("iPhone 13", "a15"),
        ("iPhone SE", "a15"),
    ],
    "linux": [
        ("Jetson Orin Nano", "orin"),
        ("Rock 5B", "rk3588"),
        ("i.MX 8M Plus EVK", "imx8mp"),
        ("Raspberry Pi 5", "bcm2712"),
    ],
}
OS_VERSIONS = {
    "android": ["12", "13", "14", "14", "15"],
    "ios": ["16.7.8", "17.4.1", "17.5", "17.6.1"],
    "linux": ["5.15.0", "6.1.0", "6.6.12"],
}
RAM_MB = {
    "android": [4096, 6144, 8192, 8192, 12288, 16384],
    "ios": [4096, 6144, 8192],
    "linux": [2048, 4096, 8192, 16384],
}
REGIONS = ["us"] * 7 + ["eu"] * 5 + ["apac"] * 4 + ["latam"] * 2 + ["in"] * 2
TAGS = (
    [[]] * 85 + [["beta"]] * 8 + [["internal"]] * 3 + [["canary"]] * 2 + [["beta", "low-power"]] * 2
)
CARRIERS = ["verizon", "att", "vodafone", "docomo", "jio", "tmobile"]
SELECTORS = [
    "",
    "platform=android",
    "platform=ios",
    "platform=linux",
    "platform=android, app_version>=5.2",
    "platform=ios, app_version>=5.3",
    "soc in (sm8650, sm8550)",
    "soc in (a17, a16), ram_mb>=6144",
    "region!=eu, tags=beta",
    "region=eu",
    "region in (us, latam), app_version>=5.1",
    "ram_mb>=8192",
    "ram_mb<4096",
    "tags=internal",
    "tags in (canary, internal)",
    'device_model~"Pixel *"',
    'device_model~"Galaxy S2*", region=apac',
    "platform=android, os_version>=14",
    "platform=linux, soc=rk3588",
    "app_version<5.1",
    "platform!=linux, tags not in (low-power)",
    "custom.carrier in (verizon, att), platform=android",
]
for _text in SELECTORS:
    parse_selector(_text)  # fail at import, not halfway through a setup
# Models are often built per platform: some ship everywhere, most to one platform only.
MODEL_SCOPES = (
    "",
    "platform=android",
    "platform=ios",
    "",
    "platform=android",
    "platform=ios",
    "platform=android",
    "platform=linux",
)


def rollout_selector(model_index: int, rng: random.Random) -> str:
    """Return a selector within the model's platform scope, plus a random condition."""
    scope = MODEL_SCOPES[model_index % len(MODEL_SCOPES)]
    if not scope:
        return rng.choice(SELECTORS)
    extra = rng.choice([s for s in SELECTORS if "platform" not in s or scope in s])
    return extra if scope in extra else ", ".join(filter(None, (scope, extra)))


def make_attributes(rng: random.Random) -> dict:
    """Return one device's canonical attributes (a plausible mix, see the tables above)."""
    platform = rng.choices(("android", "ios", "linux"), weights=(6, 3, 1))[0]
    model, soc = rng.choice(HARDWARE[platform])
    attrs = {
        "platform": platform,
        "os_version": rng.choice(OS_VERSIONS[platform]),
        "app_version": f"5.{rng.randrange(5)}.{rng.randrange(4)}",
        "device_model": model,
        "soc": soc,
        "ram_mb": rng.choice(RAM_MB[platform]),
        "region": rng.choice(REGIONS),
        "tags": rng.choice(TAGS),
    }
    if platform == "android" and rng.random() < 0.3:
        attrs["custom"] = {"carrier": rng.choice(CARRIERS)}
    # As the server sees them after Enroll or Sync: the wire has no "reports no tags".
    return normalize_attributes(attributes_dict(attributes_pb(attrs)))


def push_models(client: AdminClient, tmp: Path, n_models: int, n_versions: int) -> dict:
    """Push n_models tiny models, n_versions each; return {model: [version numbers]}."""
    out: dict[str, list[int]] = {}

    def push(m: int, v: int):
        path = tmp / f"model-{m}-{v}.onnx"
        path.write_bytes(sample_models.tiny_mlp_onnx(seed=100 * m + v))
        return client.push(path, name=f"bench-model-{m}")

    # Two at a time: the server validates two pushes at once by default.
    with ThreadPoolExecutor(2) as pool:
        for v in range(n_versions):
            for pushed in pool.map(push, range(n_models), [v] * n_models):
                out.setdefault(pushed.model, []).append(pushed.version)
    return out


def create_rollouts(client: AdminClient, models: dict, n: int, rng: random.Random) -> dict:
    """Create n rollouts over the models in mixed states; return how many ended in each."""
    names = sorted(models, key=lambda name: int(name.rsplit("-", 1)[1]))
    states: dict[str, int] = {}
    for i in range(n):
        model = names[i % len(names)]
        stages = rng.choice(([100.0], [1.0, 10.0, 50.0, 100.0], [5.0, 25.0, 100.0]))
        rollout = client.create_rollout(
            fleet_pb2.CreateRolloutRequest(
                model=model,
                version=rng.choice(models[model]),
                selector=rollout_selector(i % len(names), rng),
                stages=stages,
                # Long bakes: the scheduler must not move anything while the bench runs.
                bake_s=MAX_BAKE_S,
                priority=rng.choice((0, 0, 0, 1, 5, 10)),
                allow_empty=True,  # made before the bulk fleet exists
            )
        )
        fate = rng.random()
        if fate < 0.45:  # completed: promoted through every stage
            promotes, action = len(stages), None
        elif fate < 0.55:
            promotes, action = rng.randrange(len(stages)), "pause"
        elif fate < 0.6:
            promotes, action = 0, "rollback"
        else:  # active at some stage
            promotes, action = rng.randrange(len(stages)), None
        for _ in range(promotes):
            rollout = client.transition_rollout(rollout.id, "promote")
        if action:
            rollout = client.transition_rollout(rollout.id, action)
        states[rollout.state] = states.get(rollout.state, 0) + 1
    return states


@dataclass(frozen=True)
class Enrolled:
    """The one device enrolled through the API: its shape is what bulk rows copy."""

    device_id: str
    credential: str
    attributes: dict
    keys: DeviceKeyPair
    signing_public_keys: tuple[bytes, ...]
    token_id: str


def enroll_one(address: str, client: AdminClient, rng: random.Random) -> Enrolled:
    """Enroll one device through Enroll with a fresh key pair."""
    token = client.create_enrollment_token(uses=0, name="bench")
    keys = DeviceKeyPair.generate()
    attrs = make_attributes(rng)
    with grpc.insecure_channel(address) as channel:
        response = device_pb2_grpc.DeviceServiceStub(channel).Enroll(
            device_pb2.EnrollRequest(
                enrollment_token=token.token,
                attributes=attributes_pb(attrs),
                public_keyset=keys.public_keyset(),
            ),
            timeout=30,
        )
    return Enrolled(
        response.device_id,
        response.credential,
        attrs,
        keys,
        tuple(response.signing_public_keys),
        token.id,
    )


def insert_devices(
    db_url: str, n: int, template: Enrolled, rng: random.Random
) -> list[tuple[str, str, dict]]:
    """Insert n devices in bulk; return (device_id, credential, attributes) for each."""
    keyset = template.keys.public_keyset()
    engine = create_engine(db_url)
    now = dt.datetime.now(dt.UTC)
    devices, batch = [], []
    try:
        with engine.begin() as conn:
            for i in range(n):
                device_id, credential = (
                    "dev_" + secrets.token_hex(8),
                    "skd_" + secrets.token_urlsafe(32),
                )
                attrs = make_attributes(rng)
                enrolled = now - dt.timedelta(seconds=rng.randrange(90 * 86_400))
                batch.append(
                    {
                        "id": device_id,
                        "credential_sha256": hashlib.sha256(credential.encode()).hexdigest(),
                        "public_keyset": keyset,
                        "attributes": attrs,
                        "stamped_attributes": {},
                        "enrollment_token_id": template.token_id,
                        "enrolled_at": enrolled,
                        "last_seen": enrolled,
                        "online_until": None,
                        "revoked_at": None,
                        "revoked_reason": "",
                    }
                )
                devices.append((device_id, credential, attrs))
                if len(batch) == 5000 or i == n - 1:
                    conn.execute(insert(orm.DeviceRow.__table__), batch)
                    batch = []
    finally:
        engine.dispose()
    return devices


def expected_answers(db_url: str, devices) -> tuple[int, list[dict[str, Desired]]]:
    """Return the revision and each device's desired models, by the server's resolver."""
    store = SqlStore(db_url, migrate=False)
    try:
        snap = Resolver(store).snapshot()
    finally:
        store.close()
    return snap.revision, [snap.desired(device_id, attrs) for device_id, _, attrs in devices]


def sync_requests(attrs: dict, desired: dict[str, Desired], revision: int) -> tuple[bytes, bytes]:
    """Return the worst-case (nothing installed) and steady-state SyncRequest bytes.

    Each carries a nonce like a device's; the load replays it (the server only echoes it).
    """
    reported = attributes_pb(attrs)
    worst = device_pb2.SyncRequest(attributes=reported, revision=0, nonce=new_nonce())
    steady = device_pb2.SyncRequest(
        attributes=reported,
        installed=[
            device_pb2.InstalledModel(model=m, version=d.version, variant=d.variant)
            for m, d in sorted(desired.items())
        ],
        revision=revision,
        nonce=new_nonce(),
    )
    return worst.SerializeToString(), steady.SerializeToString()


def verify(
    address: str, enrolled: Enrolled, sample: list[tuple[str, str, bytes, bytes, dict]]
) -> dict:
    """Check real Sync answers for (device_id, credential, worst, steady, desired) samples.

    Every answer must verify with the device agent's own checks, name exactly the
    expected versions, carry wrapped keys in the worst case (which open with the device
    key, to one data key per version) and none in the steady state.
    """
    keys = load_public_keys(enrolled.signing_public_keys)
    data_keys: dict[str, bytes] = {}
    sizes = {"worst": [], "steady": []}
    now = dt.datetime.now(dt.UTC)
    with grpc.insecure_channel(address) as channel:
        stub = device_pb2_grpc.DeviceServiceStub(channel)
        for device_id, credential, worst, steady, desired in sample:
            metadata = (("authorization", f"Bearer {credential}"),)
            for mode, body in (("worst", worst), ("steady", steady)):
                request = device_pb2.SyncRequest.FromString(body)
                response = stub.Sync(request, metadata=metadata, timeout=30)
                sizes[mode].append(response.ByteSize())
                got = verify_sync(
                    response,
                    device_id=device_id,
                    nonce=request.nonce,
                    keys=keys,
                    last_revision=0,
                    now=now,
                )
                want = {m: (d.version, d.variant, d.rollout) for m, d in desired.items()}
                have = {m: (v.version, v.variant, v.rollout) for m, v in got.models.items()}
                if have != want:
                    raise AssertionError(f"{device_id} ({mode}): got {have}, expected {want}")
                for v in got.models.values():
                    if mode == "steady":
                        if v.wrapped_data_key:
                            raise AssertionError(f"{device_id}: key wrapped for an installed model")
                        continue
                    key = enrolled.keys.unwrap(
                        v.wrapped_data_key, device_id=device_id, version_uid=v.uid
                    )
                    if data_keys.setdefault(v.uid, key) != key:
                        raise AssertionError(f"{v.uid}: two devices got different data keys")
    return {
        "checked_devices": len(sample),
        "response_bytes_worst": round(statistics.median(sizes["worst"])),
        "response_bytes_steady": round(statistics.median(sizes["steady"])),
    }


def models_per_device(desired: list[dict]) -> float:
    """Return the mean number of models a device is assigned."""
    return sum(map(len, desired)) / max(1, len(desired))


def timed(label: str, fn, *args):
    """Run fn(*args), print how long it took, return its result."""
    start = time.perf_counter()
    result = fn(*args)
    print(f"  {label}: {time.perf_counter() - start:.1f} s", flush=True)
    return result
