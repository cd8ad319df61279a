"""A control plane with its dashboard, fed by a simulated fleet through a guarded rollout.

The scenario runs once per module: 40 simulated devices on det:1, then det:2 rolled out
sliced by SoC with halt rules, 3x slower on one SoC, so the guardrail rolls that slice
back while the rest completes. The fleet stays connected (devices online) but stops
reporting once it is done, so the figures the tests read stand still. Meanwhile a second
model is pushed with derived variants (int8 held to a bar it misses, kept degraded),
notes and a pipeline, and one more device enrolls with attributes its token attests
(and one that means harm: `<script>`). Last, WIDE boards of as many device classes
report that model once each, so its version page draws a fleet of 40 classes, and
phones report generations of a language model (a tiny GGUF's q8 bundle): its decode
speed, time to first token and tokens.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import re
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import requests

from contract.report_batches import histogram_pb, new_batch_id, timestamp
from control_plane.demo import sample_models
from control_plane.demo.sample_pipeline import activity_pipeline
from control_plane.telemetry import series
from protos import device_pb2
from runtime.histogram import LatencyHistogram
from tests.control_plane.api.device_helpers import Device
from tests.control_plane.helpers import ControlPlane
from tests.control_plane.sim.conftest import (  # noqa: F401 - the session fixture
    MODEL,
    copy_home,
    serve,
    template_home,
    wait_for,
)
from tests.control_plane.sim.test_guardrails import (
    FAST_SOC,
    QUICK,
    SLOW_SOC,
    create,
    create_sliced,
    fleet_on_v1,
    wait_completed,
)

ARTIFACTS = Path(os.environ.get("SKIFF_TEST_ARTIFACTS", "build/test-artifacts")) / "dashboard"
# The second model: its int8 variant misses this bar (kept degraded), its fp16 reaches it.
VARIANTS_MODEL, STRICT_COSINE = "clf", 0.99999
# What the enrollment token of the extra device stamps (attested), and what it reports.
ATTESTED = {"region": "eu", "tags": ["lab"]}
# Device-reported strings are shown as text, never markup: this one would set window.pwned.
HOSTILE = "<script>window.pwned = 1</script>"
REPORTED = {
    "platform": "ios",
    "device_model": "Lab <b>1</b>",
    "region": "us",
    "soc": "a17",
    "custom": {"note": HOSTILE},
}
# Boards of one device class each that report VARIANTS_MODEL:1 (never assigned it).
WIDE, WIDE_CONFIG = 40, "CPU/normal/t4/mem-normal"
# Their OS version, a part of their device class: quotes that would end an HTML attribute.
OS = """14'"<i>"""


@dataclass
class Site:
    """A served dashboard and what the scenario made."""

    cp: ControlPlane
    guarded: str = ""  # the sliced rollout the guardrail acted on (completed)
    staged: str = ""  # a rollout left active at its first stage, for actions
    attested: str = ""  # the device enrolled with ATTESTED attributes (never reports)
    stop: threading.Event = field(default_factory=threading.Event)

    @property
    def url(self) -> str:
        return self.cp.server.dashboard.url

    @property
    def ca(self) -> str:
        return self.cp.config.tls_ca

    def http(self) -> requests.Session:
        """A session that trusts the home's CA (and nothing from the environment)."""
        s = requests.Session()
        s.trust_env = False  # REQUESTS_CA_BUNDLE would replace our CA
        s.verify = self.ca
        return s

    def login(self, token: str | None = None) -> requests.Session:
        s = self.http()
        r = s.post(self.url + "login", data={"token": token or self.cp.token, "next": "/"})
        assert r.status_code == 200 and r.url == self.url, (r.status_code, r.url)
        return s

    def csrf(self, session: requests.Session, path: str = "") -> str:
        page = session.get(self.url + path).text
        return re.search(r'name="csrf" value="([0-9a-f]{64})"', page).group(1)

    def cli(self, *args: str, token: str | None = None) -> object:
        """Run `skiff ... --json` against this control plane and return what it printed."""
        out = self._run_cli(args, token)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    def cli_list(self, key: str, *args: str) -> list:
        """Run a listing `skiff ... --json` and return its items.

        Lists print as {KEY: [...], "more": false} (`control_plane.cli.listing.listed`);
        a bare list, the shape they once had, is read too.
        """
        body = self.cli(*args)
        if isinstance(body, list):
            return body
        assert body["more"] is False, body  # the tests read every item
        return body[key]

    def cli_error(self, *args: str) -> str:
        """Run `skiff ... --json` that must fail; return the line it wrote on stderr."""
        out = self._run_cli(args, None)
        assert out.returncode != 0 and not out.stdout, (out.returncode, out.stdout)
        return out.stderr.strip()

    def _run_cli(self, args: tuple[str, ...], token: str | None) -> subprocess.CompletedProcess:
        env = {
            **os.environ,
            "SKIFF_SERVER": str(self.cp.address),
            "SKIFF_TOKEN": token or self.cp.token,
        }
        return subprocess.run(
            [sys.executable, "-m", "control_plane.cli", *args, "--home", str(self.cp.config.home)]
            + ["--json"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )


def _run_fleet(site: Site, ready: threading.Event, failed: list) -> None:
    cp = site.cp
    inject = [{"select": f"soc={SLOW_SOC}", "model": f"{MODEL}:2", "latency_x": 3.0}]

    async def main() -> None:
        async with fleet_on_v1(cp, inject) as sim:
            r = await asyncio.to_thread(create_sliced, cp)
            site.guarded = r.id
            await asyncio.to_thread(wait_completed, cp, r.id)
            await asyncio.sleep(1.0)  # a last report from every device, rolled up
            await sim.stop_reporting()
            await asyncio.to_thread(cp.app.roller.roll)
            site.attested = await asyncio.to_thread(_enroll_attested, cp)
            staged = await asyncio.to_thread(
                create, cp, 2, selector=f"soc={FAST_SOC}", stages=[50, 100], priority=5
            )
            site.staged = staged.id
            ready.set()
            while not site.stop.is_set():
                await asyncio.sleep(0.1)

    try:
        asyncio.run(main())
    except BaseException as exc:  # noqa: BLE001 - reported to the fixture
        failed.append(exc)
        ready.set()


def _enroll_attested(cp: ControlPlane) -> str:
    """Enroll one more device through a token that stamps ATTESTED; return its id."""
    with cp.client() as client:
        token = client.create_enrollment_token(uses=1, attributes=ATTESTED).token
    return Device.enroll(cp.address, token, REPORTED).id


def _report_wide(cp: ControlPlane) -> None:
    """Enroll WIDE boards (each its own device model: its own class), then have each report
    VARIANTS_MODEL:1 once, the busier the higher its number, and roll the reports up."""
    with cp.client() as client:
        token = client.create_enrollment_token(uses=WIDE).token
    boards = [
        Device.enroll(
            cp.address,
            token,
            {"platform": "linux", "soc": "x86", "device_model": f"Board {i:02d}", "os_version": OS},
        )
        for i in range(WIDE)
    ]
    for i, board in enumerate(boards):
        n = 100 + 10 * i
        h = LatencyHistogram()
        h.record_many_ns(np.full(n, 1_000_000.0 + 20_000 * i))
        enrolled = cp.app.fleet.get(board.id).enrolled_at
        stats = device_pb2.ModelStats(
            model=VARIANTS_MODEL,
            version=1,
            variant="fp32",
            config=WIDE_CONFIG,
            inferences=n,
            latency=histogram_pb(h),
        )
        now = dt.datetime.now(dt.UTC)
        board.report(
            device_pb2.ReportRequest(
                batch_id=new_batch_id(),
                period_start=timestamp(enrolled),
                period_end=timestamp(now),
                models=[stats],
                installs=_installs(i, enrolled, now),
            )
        )
    total = sum(100 + 10 * i for i in range(WIDE))

    def rolled_up() -> bool:
        cp.app.roller.roll()
        charted = series.version_series(cp.app.store, VARIANTS_MODEL, 1, hours=1)
        tables = cp.app.recommendations.table(VARIANTS_MODEL, 1)
        return (
            sum(p["inferences"] for s in charted for p in s.points) == total and len(tables) == WIDE
        )

    wait_for(rolled_up, 30, "the boards' reports to be rolled up")


# The language model (a tiny GGUF) and the phones that report its generations.
LLM_MODEL, LLM_PHONES, LLM_CONFIG = "chat", 3, "CPU/low/t4/mem-low"


def _report_llm(cp: ControlPlane, folder: Path) -> None:
    """Push a tiny GGUF as LLM_MODEL, and have LLM_PHONES report its generations."""
    from tests.control_plane.registry.llm.tiny_gguf import write_tiny_gguf

    gguf = folder / "chat.gguf"
    write_tiny_gguf(gguf)
    with cp.client() as client:
        client.push(gguf, name=LLM_MODEL, variants=("q8",))
        token = client.create_enrollment_token(uses=LLM_PHONES).token
    rng = np.random.default_rng(3)
    for _ in range(LLM_PHONES):
        phone = Device.enroll(cp.address, token, {"platform": "linux", "soc": "rk3588"})
        decode, first = LatencyHistogram(), LatencyHistogram()
        decode.record_many_ns(rng.lognormal(np.log(1e9 / 50), 0.05, 40))  # 50 tokens/s
        first.record_many_ns(rng.lognormal(np.log(0.2e9), 0.05, 40))  # 200 ms
        stats = device_pb2.ModelStats(
            model=LLM_MODEL,
            version=1,
            variant="q8",
            config=LLM_CONFIG,
            inferences=40,
            latency=histogram_pb(decode),
            ttft=histogram_pb(first),
            tokens_in=40 * 30,
            tokens_out=40 * 64,
            cancellations=1,
        )
        enrolled = cp.app.fleet.get(phone.id).enrolled_at
        phone.report(
            device_pb2.ReportRequest(
                batch_id=new_batch_id(),
                period_start=timestamp(enrolled),
                period_end=timestamp(dt.datetime.now(dt.UTC)),
                models=[stats],
            )
        )

    def rolled_up() -> bool:
        cp.app.roller.roll()
        charted = series.version_series(cp.app.store, LLM_MODEL, 1, hours=1)
        return sum(p.get("tokens_out", 0) for s in charted for p in s.points) == 3 * 40 * 64

    wait_for(rolled_up, 30, "the phones' generations to be rolled up")


def _installs(i: int, start: dt.datetime, end: dt.datetime) -> list[device_pb2.InstallReport]:
    """A board's install outcomes of VARIANTS_MODEL:1: activated, every 4th after a failure
    whose reason (device-reported text) carries markup."""
    activated = device_pb2.InstallReport(
        at=timestamp(end),
        model=VARIANTS_MODEL,
        version=1,
        variant="fp32",
        result="activated",
        config=WIDE_CONFIG,
        download_s=0.25,
        downloaded_bytes=4096,
    )
    if i % 4:
        return [activated]
    failed = device_pb2.InstallReport(
        at=timestamp(start + (end - start) / 2),
        model=VARIANTS_MODEL,
        version=1,
        variant="fp32",
        result="failed",
        reason=f"self-test failed: {HOSTILE}",
    )
    return [failed, activated]


def _push_variants(cp: ControlPlane, folder: Path) -> None:
    """Push VARIANTS_MODEL:1 with int8 and fp16 variants, notes and the sample pipeline."""
    path = folder / f"{VARIANTS_MODEL}.onnx"
    path.write_bytes(sample_models.tiny_mlp_onnx(seed=7))
    with cp.client() as client:
        client.push(
            path,
            name=VARIANTS_MODEL,
            notes="classifier <i>beta</i>",
            variants=("int8", "fp16"),
            min_cosine=STRICT_COSINE,
            allow_degraded=True,
            pipeline=activity_pipeline(),
        )


@pytest.fixture(scope="module")
def site(template_home, tmp_path_factory):  # noqa: F811 - pytest's fixture injection
    home = copy_home(template_home, tmp_path_factory.mktemp("dashboard"))
    cp = serve(home, http="127.0.0.1:0", **QUICK)
    site = Site(cp)
    ready, failed = threading.Event(), []
    fleet = threading.Thread(target=_run_fleet, args=(site, ready, failed), daemon=True)
    fleet.start()
    try:
        _push_variants(cp, home.parent)  # while the fleet runs its scenario
        assert ready.wait(150), "the fleet scenario did not finish"
        if failed:
            raise failed[0]
        _report_wide(cp)
        _report_llm(cp, home.parent)
        yield site
    finally:
        site.stop.set()
        fleet.join(30)
        cp.stop()
