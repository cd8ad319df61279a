"""A control plane with its dashboard, fed by a simulated fleet through a guarded rollout.

The scenario runs once per module: 40 simulated devices on det:1, then det:2 rolled out
sliced by SoC with halt rules, 3x slower on one SoC, so the guardrail rolls that slice
back while the rest completes. The fleet stays connected (devices online) but stops
reporting once it is done, so the figures the tests read stand still.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import requests

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
    show,
)

ARTIFACTS = Path(os.environ.get("SKIFF_TEST_ARTIFACTS", "build/test-artifacts")) / "dashboard"


@dataclass
class Site:
    """A served dashboard and what the scenario made."""

    cp: ControlPlane
    guarded: str = ""  # the sliced rollout the guardrail acted on (completed)
    staged: str = ""  # a rollout left active at its first stage, for actions
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
        env = {
            **os.environ,
            "SKIFF_SERVER": str(self.cp.address),
            "SKIFF_TOKEN": token or self.cp.token,
        }
        out = subprocess.run(
            [sys.executable, "-m", "control_plane.cli", *args, "--home", str(self.cp.config.home)]
            + ["--json"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)


def _run_fleet(site: Site, ready: threading.Event, failed: list) -> None:
    cp = site.cp
    inject = [{"select": f"soc={SLOW_SOC}", "model": f"{MODEL}:2", "latency_x": 3.0}]

    async def main() -> None:
        async with fleet_on_v1(cp, inject) as sim:
            r = await asyncio.to_thread(create_sliced, cp)
            site.guarded = r.id

            def completed():
                return show(cp, r.id)["state"] == "completed"

            await asyncio.to_thread(wait_for, completed, 90, "the guarded rollout to complete")
            await asyncio.sleep(1.0)  # a last report from every device, rolled up
            await sim.stop_reporting()
            await asyncio.to_thread(cp.app.roller.roll)
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


@pytest.fixture(scope="module")
def site(template_home, tmp_path_factory):  # noqa: F811 - pytest's fixture injection
    home = copy_home(template_home, tmp_path_factory.mktemp("dashboard"))
    cp = serve(home, http="127.0.0.1:0", **QUICK)
    site = Site(cp)
    ready, failed = threading.Event(), []
    fleet = threading.Thread(target=_run_fleet, args=(site, ready, failed), daemon=True)
    fleet.start()
    try:
        assert ready.wait(150), "the fleet scenario did not finish"
        if failed:
            raise failed[0]
        yield site
    finally:
        site.stop.set()
        fleet.join(30)
        cp.stop()
