"""The dashboard in a real browser (headless Chromium): each page against a control plane
fed by the simulator, its figures read off the page and checked against the CLI's JSON,
and a rollout paused by clicking. A screenshot of each page is kept (SKIFF_TEST_ARTIFACTS).
"""

from __future__ import annotations

import base64
import hashlib
import shutil

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions as EC
from selenium.webdriver.support.ui import WebDriverWait

from tests.ci import on_ci
from tests.control_plane.sim.test_guardrails import FAST_SOC, SLOW_SOC
from tests.dashboards.conftest import ARTIFACTS, Site

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
# On CI a missing browser fails the tests (make test installs it); elsewhere it skips.
pytestmark = [
    pytest.mark.skipif(
        not (CHROMIUM and DRIVER) and not on_ci(),
        reason="needs Debian's chromium and chromium-driver (make test installs them)",
    ),
    # One worker runs the module, so its scenario (the `site` fixture) is built once.
    pytest.mark.xdist_group("dashboard-browser"),
]


def _spki_pin(cert_path: str) -> str:
    """Return the base64 SHA-256 of the server certificate's public key (Chromium's pin)."""
    with open(cert_path, "rb") as f:
        cert = x509.load_pem_x509_certificate(f.read())
    der = cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return base64.b64encode(hashlib.sha256(der).digest()).decode()


@pytest.fixture(scope="module")
def browser(site: Site, tmp_path_factory):
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--window-size=1280,1600",
        f"--user-data-dir={tmp_path_factory.mktemp('chromium')}",
        # Trust exactly this server's key (the home's CA is not in the browser's store).
        f"--ignore-certificate-errors-spki-list={_spki_pin(site.cp.config.tls_cert)}",
    ):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(DRIVER))
    driver.set_page_load_timeout(30)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    yield driver
    driver.quit()


def _open(driver, site: Site, path: str, shot: str, *, lands: str | None = None):
    driver.get(site.url + path)
    WebDriverWait(driver, 15).until(EC.presence_of_element_located((By.TAG_NAME, "main")))
    landed = driver.current_url.split("?")[0]
    assert landed == site.url + (path if lands is None else lands)
    driver.save_screenshot(str(ARTIFACTS / f"{shot}.png"))
    severe = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert not severe, severe  # a CSP violation or a script error shows here


def _text(driver, css: str) -> str:
    return driver.find_element(By.CSS_SELECTOR, css).text.strip()


def _sign_in(driver, site: Site, path: str) -> None:
    """Open `path` without a session, log in through the form, and land back on `path`."""
    driver.delete_all_cookies()
    _open(driver, site, path, "login", lands="login")
    driver.find_element(By.ID, "token").send_keys(site.cp.token)
    driver.find_element(By.ID, "login").click()
    # Logged in when the page that asked for it has loaded (its header names the token).
    WebDriverWait(driver, 15).until(EC.presence_of_element_located((By.ID, "who")))
    assert driver.current_url == site.url + path


def test_login_then_every_page_matches_the_cli(browser, site):
    _sign_in(browser, site, "rollouts")

    # Rollouts: every one `rollout ls --json` lists, with its state and guardrails.
    _open(browser, site, "rollouts", "rollouts")
    listed = site.cli("rollout", "ls")
    rows = browser.find_elements(By.CSS_SELECTOR, "table.rollouts tbody tr[data-rollout]")
    assert sorted(r.get_attribute("data-rollout") for r in rows) == sorted(r["id"] for r in listed)
    for r in listed:
        row = f"table.rollouts tr[data-rollout='{r['id']}']"
        assert _text(browser, f"{row} .state") == r["state"]
        for rule in r["guardrails"]["halt_rules"]:
            assert rule in _text(browser, row)

    # Overview: devices, online and per platform, as `skiff fleet ls --json` counts them.
    _open(browser, site, "", "overview")
    devices = site.cli("fleet", "ls")
    assert int(_text(browser, "#devices-total")) == len(devices) == 40
    assert int(_text(browser, "#devices-online")) == sum(d["online"] for d in devices)
    assert int(_text(browser, "tr[data-platform=android] .online")) == sum(
        d["online"] for d in devices if d["attributes"]["platform"] == "android"
    )
    on_v2 = sum(d["installed"].get("det", {}).get("version") == 2 for d in devices)
    assert f"v2: {on_v2}" in _text(browser, "tr[data-model=det]")

    # The guarded rollout: state, stages, counts, and each slice's state and figures.
    _open(browser, site, f"rollouts/{site.guarded}", "rollout-guarded")
    doc = site.cli("rollout", "show", site.guarded)
    assert _text(browser, "#state") == doc["state"] == "completed"
    for key, value in doc["counts"].items():
        assert int(_text(browser, f"#count-{key}")) == value
    for s in doc["health"]["slices"]:
        row = f"#health tr[data-slice='{s['slice']}']"
        assert _text(browser, f"{row} .slice-state") == s["state"]
        assert int(_text(browser, f"{row} .cand-devices")) == s["candidate"]["devices"]
        p95 = s["candidate"]["p95_us"]
        assert _text(browser, f"{row} .cand-p95") == (f"{p95:,.0f}" if p95 is not None else "-")
    states = {s["slice"]: s["state"] for s in doc["health"]["slices"]}
    assert states[f"soc={SLOW_SOC}"] == "rolled_back" and states[f"soc={FAST_SOC}"] == "active"
    assert "slice_rollback" in _text(browser, "#audit")
    # Candidate vs baseline charts were drawn (Plotly's SVG), both cohorts in the legend.
    assert browser.find_elements(By.CSS_SELECTOR, "#chart-latency .main-svg")
    legend = _text(browser, "#chart-latency")
    assert "candidate p95" in legend and "baseline p95" in legend
    assert browser.find_elements(By.CSS_SELECTOR, "#chart-crash .main-svg")

    # The version page: the backend table per device class, as --backends --json has it.
    _open(browser, site, "models/det/2", "version")
    backends = site.cli("model", "show", "det:2", "--backends")
    tables = browser.find_elements(By.CSS_SELECTOR, "table.backends")
    assert len(tables) == len(backends["classes"]) > 0
    for table, cls in zip(tables, backends["classes"], strict=True):
        for c in cls["configs"]:
            row = table.find_element(By.CSS_SELECTOR, f"tr[data-config='{c['config']}']")
            assert int(row.find_element(By.CSS_SELECTOR, ".samples").text) == c["samples"]
            p50 = c["p50_us"]  # None where too few devices are left to judge one
            assert row.find_element(By.CSS_SELECTOR, ".p50").text == (
                f"{p50:.1f}" if p50 is not None else "-"
            )
    assert browser.find_elements(By.CSS_SELECTOR, "#chart-latency .main-svg")

    _open(browser, site, "models", "models")
    models = site.cli("model", "ls")
    for m in models:
        assert int(_text(browser, f"tr[data-model={m['name']}] .latest")) == m["latest_version"]
    _open(browser, site, "models/det", "model")
    assert len(browser.find_elements(By.CSS_SELECTOR, "#versions tbody tr")) == 2


def test_pause_from_the_dashboard_goes_through_the_audit_log(browser, site):
    # Each test signs in itself: pytest-xdist may run this one first, or on its own worker.
    _sign_in(browser, site, f"rollouts/{site.staged}")
    _open(browser, site, f"rollouts/{site.staged}", "rollout-active")
    assert _text(browser, "#state") == "active"
    browser.find_element(By.ID, "action-pause").click()
    WebDriverWait(browser, 15).until(EC.presence_of_element_located((By.ID, "confirm")))
    browser.save_screenshot(str(ARTIFACTS / "confirm-pause.png"))
    browser.find_element(By.ID, "reason").send_keys("paused from the browser test")
    browser.find_element(By.ID, "confirm").click()
    WebDriverWait(browser, 15).until(EC.presence_of_element_located((By.ID, "notice")))
    browser.save_screenshot(str(ARTIFACTS / "rollout-paused.png"))
    assert _text(browser, "#state") == "paused"
    doc = site.cli("rollout", "show", site.staged)
    assert doc["state"] == "paused"
    last = doc["audit"][-1]
    assert last["action"] == "pause" and last["reason"] == "paused from the browser test"
    assert last["actor"] == site.cli("token", "ls")[0]["name"]  # the admin token's name

    # And resumed the same way: the rollout runs again, the audit log has both.
    browser.find_element(By.ID, "action-resume").click()
    WebDriverWait(browser, 15).until(EC.presence_of_element_located((By.ID, "confirm")))
    browser.find_element(By.ID, "reason").send_keys("resumed from the browser test")
    browser.find_element(By.ID, "confirm").click()
    WebDriverWait(browser, 15).until(EC.presence_of_element_located((By.ID, "notice")))
    assert _text(browser, "#state") == "active"
    doc = site.cli("rollout", "show", site.staged)
    assert doc["state"] == "active"
    assert [(e["action"], e["reason"]) for e in doc["audit"][-2:]] == [
        ("pause", "paused from the browser test"),
        ("resume", "resumed from the browser test"),
    ]
