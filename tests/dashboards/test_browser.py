"""The dashboard in a real browser (headless Chromium): each page against a control plane
fed by the simulator, its figures read off the page and checked against the CLI's JSON,
and a rollout paused by clicking. A screenshot of each page is kept (SKIFF_TEST_ARTIFACTS).
"""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
from urllib.parse import quote

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions as EC
from selenium.webdriver.support.ui import WebDriverWait

from control_plane.registry import accuracy_bars
from dashboards.web.auth import COOKIE
from tests.ci import on_ci
from tests.control_plane.sim.test_guardrails import FAST_SOC, SLOW_SOC
from tests.dashboards.conftest import (
    ARTIFACTS,
    HOSTILE,
    LLM_MODEL,
    LLM_PHONES,
    OS,
    VARIANTS_MODEL,
    WIDE,
    Site,
)

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


def _open(driver, site: Site, path: str, shot: str, *, lands: str | None = None, status: int = 200):
    """Open a page (answering `status`), keep its screenshot, and check the console."""
    driver.get(site.url + path)
    WebDriverWait(driver, 15).until(EC.presence_of_element_located((By.TAG_NAME, "main")))
    landed = driver.current_url.split("?")[0]
    assert landed == site.url + (path if lands is None else lands).split("?")[0]
    driver.save_screenshot(str(ARTIFACTS / f"{shot}.png"))
    _console_clean(driver, status)


def _console_clean(driver, status: int = 200) -> None:
    """Assert the browser logged no error (a CSP violation or a script error shows here)
    but, for a page meant to answer an error `status`, the page's own."""
    expected = f"the server responded with a status of {status} "
    severe = [
        e
        for e in driver.get_log("browser")
        if e["level"] == "SEVERE" and not (status != 200 and expected in e["message"])
    ]
    assert not severe, severe


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
    listed = site.cli_list("rollouts", "rollout", "ls")
    rows = browser.find_elements(By.CSS_SELECTOR, "table.rollouts tbody tr[data-rollout]")
    assert sorted(r.get_attribute("data-rollout") for r in rows) == sorted(r["id"] for r in listed)
    for r in listed:
        row = f"table.rollouts tr[data-rollout='{r['id']}']"
        assert _text(browser, f"{row} .state") == r["state"]
        for rule in r["guardrails"]["halt_rules"]:
            assert rule in _text(browser, row)

    # Overview: devices, online and per platform, as `skiff fleet ls --json` counts them
    # (the 40 simulated devices, the one enrolled with attested attributes, the boards,
    # the phones reporting a language model).
    _open(browser, site, "", "overview")
    devices = site.cli_list("devices", "fleet", "ls")
    assert int(_text(browser, "#devices-total")) == len(devices) == 40 + 1 + WIDE + LLM_PHONES
    assert int(_text(browser, "#devices-online")) == sum(d["online"] for d in devices)
    assert int(_text(browser, "tr[data-platform=android] .online")) == sum(
        d["online"] for d in devices if d["attributes"]["platform"] == "android"
    )
    on_v2 = sum(d["installed"].get("det", {}).get("version") == 2 for d in devices)
    assert int(_text(browser, "tr[data-model=det][data-version='2'] .installed")) == on_v2

    # The guarded rollout: state, stages, counts, and each slice's state and figures.
    _open(browser, site, f"rollouts/{site.guarded}", "rollout-guarded")
    doc = site.cli("rollout", "show", site.guarded)
    assert _text(browser, "#state") == doc["state"] == "completed"
    for key, value in doc["counts"].items():
        if not key.endswith("_reasons"):  # a mapping, shown under the table when not empty
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

    _open(browser, site, "models", "models")
    models = site.cli_list("models", "model", "ls")
    for m in models:
        assert int(_text(browser, f"tr[data-model={m['name']}] .latest")) == m["latest_version"]
    _open(browser, site, "models/det", "model")
    assert len(browser.find_elements(By.CSS_SELECTOR, "#versions tbody tr")) == 2
    # The version pages, the devices pages and the overview's health: tests below.


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
    assert (
        last["actor"] == site.cli_list("tokens", "token", "ls")[0]["name"]
    )  # the admin token's name

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


def _rows(driver, css: str) -> list:
    return driver.find_elements(By.CSS_SELECTOR, css)


def _ids_on_page(driver) -> list[str]:
    return [r.get_attribute("data-device") for r in _rows(driver, "#devices tbody tr")]


def _pills(row, css: str) -> dict[str, int]:
    """Return {model: version} of the version pills in one cell of a row."""
    return {
        a.get_attribute("data-model"): int(a.get_attribute("data-version"))
        for a in row.find_elements(By.CSS_SELECTOR, f"{css} a.pill")
    }


def _attributes_shown(row) -> tuple[list[str], list[str]]:
    """Return the attribute texts of a devices row, and those marked attested."""
    spans = row.find_elements(By.CSS_SELECTOR, ".attr")
    marked = [s.text for s in spans if "attested" in s.get_attribute("class").split()]
    return [s.text for s in spans], marked


def _attribute_texts(attrs: dict) -> list[str]:
    """Return the key=value texts the page shows for a device document's attributes."""
    out = [f"{k}={v}" for k, v in attrs.items() if k not in ("tags", "custom")]
    out += [f"tags={t}" for t in attrs.get("tags", [])]
    return out + [f"custom.{k}={v}" for k, v in attrs.get("custom", {}).items()]


# Reads every row of the devices table in one round trip (a page holds dozens).
_DEVICE_ROWS_JS = """
const text = (e) => e.innerText.trim();
const pills = (row, css) => Array.from(row.querySelectorAll(css + ' a.pill'),
  (a) => [a.dataset.model, Number(a.dataset.version)]);
return Array.from(document.querySelectorAll('#devices tbody tr'), (row) => ({
  id: row.dataset.device,
  attributes: Array.from(row.querySelectorAll('.attr'), text),
  attested: Array.from(row.querySelectorAll('.attr.attested'), text),
  desired: pills(row, '.desired'),
  installed: pills(row, '.installed'),
  online: text(row.querySelector('.online')),
  serving: Array.from(row.querySelectorAll('.serving-figure'), (f) => [
    f.dataset.model, Number(f.dataset.version), f.dataset.variant, f.dataset.config,
    Number(text(f.querySelector('.inferences'))), text(f.querySelector('.p95'))]),
  outcomes: Array.from(row.querySelectorAll('.installs .outcome'), text),
}));
"""


def _serving_expected(doc: dict) -> dict[tuple, tuple[int, str]]:
    return {
        (x["model"], x["version"], x["variant"], x["config"]): (
            x["inferences"],
            f"{x['p95_us']:.1f}" if x["p95_us"] is not None else "-",
        )
        for x in doc["latency"]
    }


def _installs_expected(doc: dict) -> list[str]:
    return [f"{i['model']}:{i['version']} {i['result']}" for i in doc["recent_installs"][:3]]


def test_the_devices_page_pages_through_the_fleet_as_fleet_ls_lists_it(browser, site):
    _sign_in(browser, site, "devices?per_page=30")
    browser.save_screenshot(str(ARTIFACTS / "devices.png"))
    listed = {d["id"]: d for d in site.cli_list("devices", "fleet", "ls")}
    # What `fleet show --json` adds per device (its installs, its serving figures): the
    # API's document, checked equal to the CLI's for a device that reported both.
    auth = {"Authorization": f"Bearer {site.cp.token}"}
    http = site.http()
    shown = {i: http.get(site.url + f"api/v1/devices/{i}", headers=auth).json() for i in listed}
    sim = next(i for i, d in shown.items() if d["recent_installs"] and d["latency"])
    cli = site.cli("fleet", "show", sim)
    assert (cli["recent_installs"], cli["latency"]) == (
        shown[sim]["recent_installs"],
        shown[sim]["latency"],
    )
    seen, pages = [], 0
    while True:
        pages += 1
        ids = _ids_on_page(browser)
        assert 0 < len(ids) <= 30
        assert _text(browser, "#page-range").startswith(f"Devices {len(seen) + 1}–")
        rows = browser.execute_script(_DEVICE_ROWS_JS)
        assert [r["id"] for r in rows] == ids
        for r in rows:
            d = listed[r["id"]]
            # (in any order: the CLI's JSON sorts keys, the page keeps the device's order)
            assert sorted(r["attributes"]) == sorted(_attribute_texts(d["attributes"]))
            assert sorted(r["attested"]) == sorted(_attribute_texts(d["attested"]))
            assert dict(r["desired"]) == {m: s["version"] for m, s in d["desired"].items()}
            assert dict(r["installed"]) == {m: s["version"] for m, s in d["installed"].items()}
            online = "revoked" if d["revoked"] else "yes" if d["online"] else "no"
            assert r["online"] == online
            serving = {tuple(f[:4]): (f[4], f[5]) for f in r["serving"]}
            assert serving == _serving_expected(shown[r["id"]])
            assert r["outcomes"] == _installs_expected(shown[r["id"]])
        row = browser.find_element(By.CSS_SELECTOR, "#devices tbody tr")
        seen += ids
        following = _rows(browser, "#next-page")
        if not following:
            break
        following[0].click()
        WebDriverWait(browser, 15).until(EC.staleness_of(row))
    # Every device once, in the CLI's order (by id), over ceil(81 / 30) pages.
    assert seen == list(listed) and pages == 3
    row = browser.find_element(By.CSS_SELECTOR, "#devices tbody tr")
    browser.find_element(By.ID, "first-page").click()
    WebDriverWait(browser, 15).until(EC.staleness_of(row))
    assert _ids_on_page(browser) == seen[:30]
    # A device's id links to its page.
    browser.find_element(By.CSS_SELECTOR, f"tr[data-device='{seen[0]}'] .id a").click()
    WebDriverWait(browser, 15).until(EC.presence_of_element_located((By.ID, "device-id")))
    assert _text(browser, "#device-id") == seen[0]


def test_device_reported_strings_are_shown_as_text(browser, site):
    """Attributes are what a device says: a `<script>` in one is text, and never runs
    (the page escapes it; the CSP would refuse it too, and _open fails on that)."""
    _sign_in(browser, site, f"devices?select={quote('@region=eu')}")
    _open(
        browser, site, f"devices?select={quote('@region=eu')}", "devices-hostile", lands="devices"
    )
    row = browser.find_element(By.CSS_SELECTOR, f"tr[data-device='{site.attested}']")
    shown, marked = _attributes_shown(row)
    # The stamped values marked attested; what it reported itself (as text) not.
    assert marked == ["region=eu", "tags=lab"]
    assert "platform=ios" in shown and "device_model=Lab <b>1</b>" in shown
    assert f"custom.note={HOSTILE}" in shown  # as a selector writes it
    assert not row.find_elements(By.CSS_SELECTOR, ".attributes script, .attributes b")
    assert browser.execute_script("return typeof window.pwned") == "undefined"

    _open(browser, site, f"devices/{site.attested}", "device-hostile")
    assert _text(browser, "#attributes tr[data-key='custom.note'] .value") == HOSTILE
    assert not browser.find_elements(By.CSS_SELECTOR, "#attributes script, #attributes b")
    assert browser.execute_script("return typeof window.pwned") == "undefined"


def test_the_devices_search_is_the_fleet_selector(browser, site):
    _sign_in(browser, site, "devices")
    for selector, shot in ((f"soc={SLOW_SOC}", "devices-search"), ("@region=eu", None)):
        box = browser.find_element(By.ID, "select")
        box.clear()
        box.send_keys(selector)
        browser.find_element(By.ID, "search").click()
        WebDriverWait(browser, 15).until(EC.staleness_of(box))  # the next page has loaded
        assert browser.find_element(By.ID, "select").get_attribute("value") == selector
        assert "select=" in browser.current_url
        if shot:
            browser.save_screenshot(str(ARTIFACTS / f"{shot}.png"))
        expected = [d["id"] for d in site.cli_list("devices", "fleet", "ls", "--select", selector)]
        assert _ids_on_page(browser) == expected and expected
    assert _ids_on_page(browser) == [site.attested]  # @ matches attested values only

    # A typo in a key, typed into the box: refused with the parser's own words, as the
    # CLI prints them ("did you mean"), the box still holding it to correct; no table.
    typo = "platfrom=android"
    box = browser.find_element(By.ID, "select")
    box.clear()
    box.send_keys(typo)
    browser.find_element(By.ID, "search").click()
    WebDriverWait(browser, 15).until(EC.staleness_of(box))
    WebDriverWait(browser, 15).until(EC.presence_of_element_located((By.ID, "select-error")))
    browser.save_screenshot(str(ARTIFACTS / "devices-typo.png"))
    _console_clean(browser, 400)  # the page answered 400: a bad request, not a crash
    said = site.cli_error("fleet", "ls", "--select", typo)
    message = _text(browser, "#select-error")
    assert "did you mean `platform`" in message and message in said
    assert browser.find_element(By.ID, "select").get_attribute("value") == typo
    assert not _rows(browser, "#devices")
    # A value that does not parse: the same, and the page answers 400, not 500.
    bad = "ram_mb>=lots"
    _open(browser, site, f"devices?select={quote(bad)}", "devices-bad-selector", status=400)
    said = site.cli_error("fleet", "ls", "--select", bad)
    message = _text(browser, "#select-error")
    assert message and message in said
    assert browser.find_element(By.ID, "select").get_attribute("value") == bad
    assert not _rows(browser, "#devices")
    cookie = {COOKIE: browser.get_cookie(COOKIE)["value"]}
    r = site.http().get(site.url + "devices", params={"select": typo}, cookies=cookie)
    assert r.status_code == 400 and "did you mean" in r.text


def test_the_device_page_shows_what_fleet_show_does(browser, site):
    _sign_in(browser, site, "devices")
    # A simulated device outside the still-active rollout (so nothing moves it meanwhile).
    slow = next(
        d["id"] for d in site.cli_list("devices", "fleet", "ls", "--select", f"soc={SLOW_SOC}")
    )
    _open(browser, site, f"devices/{slow}", "device")
    d = site.cli("fleet", "show", slow)
    assert _text(browser, "#device-id") == slow
    assert _text(browser, "#online") == ("yes" if d["online"] else "no")
    for key, value in d["attributes"].items():
        assert _text(browser, f"#attributes tr[data-key='{key}'] .value") == str(value)
    for model, s in d["installed"].items():
        row = browser.find_element(By.CSS_SELECTOR, f"#models tr[data-model='{model}']")
        assert _pills(row, ".installed") == {model: s["version"]}
        assert _pills(row, ".desired") == {model: d["desired"][model]["version"]}
        assert d["desired"][model]["rollout"] in row.find_element(By.CSS_SELECTOR, ".desired").text
    assert d["latency"]  # the scenario ran models on it
    for x in d["latency"]:
        row = browser.find_element(
            By.CSS_SELECTOR,
            f"#latency tr[data-model='{x['model']}'][data-version='{x['version']}']"
            f"[data-variant='{x['variant']}'][data-config='{x['config']}']",
        )
        assert int(row.find_element(By.CSS_SELECTOR, ".inferences").text) == x["inferences"]
        assert int(row.find_element(By.CSS_SELECTOR, ".crashes").text) == x["crashes"]
        for q in ("p50", "p95", "p99"):
            value = x[f"{q}_us"]
            assert row.find_element(By.CSS_SELECTOR, f".{q}").text == (
                f"{value:.1f}" if value is not None else "-"
            )

    # A board that reported a failed install, then its activation: both, newest first,
    # the failure's reason (device-reported) as text.
    board = next(
        d["id"]
        for d in site.cli_list("devices", "fleet", "ls", "--select", 'device_model="Board 04"')
    )
    _open(browser, site, f"devices/{board}", "device-installs")
    d = site.cli("fleet", "show", board)
    assert [i["result"] for i in d["recent_installs"]] == ["activated", "failed"]
    installs = _rows(browser, "#installs tbody tr")
    for row, i in zip(installs, d["recent_installs"], strict=True):
        assert row.find_element(By.CSS_SELECTOR, ".result").text == i["result"]
        assert row.find_element(By.CSS_SELECTOR, ".at").text == i["at"]
        assert row.find_element(By.CSS_SELECTOR, ".reason").text == i["reason"]
    assert HOSTILE in d["recent_installs"][1]["reason"]
    assert browser.execute_script("return typeof window.pwned") == "undefined"

    # The attested device: stamped values marked, what it said itself as plain text.
    _open(browser, site, f"devices/{site.attested}", "device-attested")
    d = site.cli("fleet", "show", site.attested)
    assert d["attested"] == {"region": "eu", "tags": ["lab"]}
    assert _text(browser, "#last-seen") == d["last_seen"]
    region = browser.find_element(By.CSS_SELECTOR, "#attributes tr[data-key=region]")
    assert (
        "attested" in region.get_attribute("class")
        and _text(browser, "tr[data-key=region] .value") == "eu"
    )
    assert "attested" not in (
        browser.find_element(By.CSS_SELECTOR, "#attributes tr[data-key=platform]").get_attribute(
            "class"
        )
        or ""
    )
    assert _text(browser, "#attributes tr[data-key=device_model] .value") == "Lab <b>1</b>"
    assert _text(browser, "#attributes tr[data-key=tags] .mark") == "lab"
    assert "No install reported yet" in _text(browser, "#installs")
    # Any unique prefix of an id finds the device, as `fleet show` takes one.
    prefix = site.attested[:12]
    _open(browser, site, f"devices/{prefix}", "device-prefix", lands=f"devices/{site.attested}")


def test_the_version_page_shows_model_show_then_its_telemetry(browser, site):
    _sign_in(browser, site, f"models/{VARIANTS_MODEL}/1")
    _open(browser, site, f"models/{VARIANTS_MODEL}/1", "version-variants")
    (v,) = site.cli("model", "show", f"{VARIANTS_MODEL}:1")["versions"]
    assert _text(browser, "#notes") == v["notes"] == "classifier <i>beta</i>"
    assert _text(browser, "#inputs") == "x[1x16] float32"
    assert v["signing_key_id"] in _text(browser, "#manifest")
    assert f"{v['golden']['plaintext_size']:,} B" in _text(browser, "#golden")
    for trigger in v["pipeline"]["triggers"]:
        assert f"{trigger['name']} ({trigger['pattern']})" in _text(browser, "#pipeline")
    names = [r.get_attribute("data-variant") for r in _rows(browser, "#variants tbody tr")]
    assert names == [x["name"] for x in v["variants"]] == ["fp32", "int8", "fp16"]
    for x in v["variants"]:
        row = browser.find_element(By.CSS_SELECTOR, f"#variants tr[data-variant='{x['name']}']")
        assert row.find_element(By.CSS_SELECTOR, ".size").text == f"{x['plaintext_size']:,} B"
        assert ("degraded" in row.get_attribute("class")) == x["degraded"]
        verdict = row.find_element(By.CSS_SELECTOR, ".verdict").text
        if x["accuracy"] is None:
            assert verdict == "-"
            continue
        a = x["accuracy"]
        # Each bar in registry.accuracy_bars' words; those marked failed are the ones
        # `model show --json` names, and the verdict is its label, naming the failed bar.
        checks = row.find_elements(By.CSS_SELECTOR, ".check")
        assert [c.text for c in checks] == [b.text() for b in accuracy_bars.bars(a)]
        failed = {
            c.get_attribute("data-check")
            for c in row.find_elements(By.CSS_SELECTOR, ".check.failed")
        }
        assert failed == {b["bar"] for b in x["failed_bars"]}
        assert verdict.startswith("DEGRADED") == x["degraded"] == (x["status"] == "degraded")
        if x["degraded"]:
            assert failed and verdict.startswith(accuracy_bars.degraded_label(a))
    # The push held int8 to a bar it missed (kept, marked) and fp16 passed it.
    assert [x["degraded"] for x in v["variants"]] == [False, True, False]

    # det:2's telemetry: one backend table, every (variant, class, config) of --backends.
    _open(browser, site, "models/det/2", "version")
    backends = site.cli("model", "show", "det:2", "--backends")
    expected = [
        (t["variant"], t["device_class"], c) for t in backends["classes"] for c in t["configs"]
    ]
    rows = _rows(browser, "#backends tbody tr")
    assert len(_rows(browser, "table#backends")) == 1 and len(rows) == len(expected) > 8
    for row, (variant, cls, c) in zip(rows, expected, strict=True):
        assert row.get_attribute("data-variant") == variant
        assert json.loads(row.get_attribute("data-class")) == cls
        assert row.get_attribute("data-config") == c["config"]
        assert int(row.find_element(By.CSS_SELECTOR, ".samples").text) == c["samples"]
        assert int(row.find_element(By.CSS_SELECTOR, ".devices").text) == c["devices"]
        for q in ("p50", "p95"):
            value = c[f"{q}_us"]  # None where too few devices are left to judge one
            assert row.find_element(By.CSS_SELECTOR, f".{q}").text == (
                f"{value:.1f}" if value is not None else "-"
            )
        assert (row.find_element(By.CSS_SELECTOR, ".star").text == "★") == c["recommended"]

    # Sorted by a column in the browser: by p95 up (rows without a figure last), then down.
    header = browser.find_element(By.XPATH, "//table[@id='backends']//th[text()='p95 µs']")
    header.click()
    up = _column(browser, ".p95")
    figures = [x for x in up if x is not None]
    assert figures == sorted(figures) and up == figures + [None] * (len(up) - len(figures))
    assert header.get_attribute("aria-sort") == "ascending"
    browser.save_screenshot(str(ARTIFACTS / "version-sorted.png"))
    header.click()
    down = _column(browser, ".p95")
    assert [x for x in down if x is not None] == sorted(figures, reverse=True)
    assert sorted(map(str, down)) == sorted(map(str, up))  # the same rows, reordered

    # The charts: the busiest series, the rest folded into one "other" line.
    charts = (
        site.http()
        .get(
            site.url + "api/v1/models/det/2/series",
            headers={"Authorization": f"Bearer {site.cp.token}"},
        )
        .json()["series"]
    )
    folded = charts[-1]["labels"]
    n, k = len(expected) - 7, folded["device_classes"]
    assert len(charts) == 8 and folded["other"] == n and 0 < k <= n
    label = f"other ({k} classes)" if k == n else f"other ({n} series of {k} classes)"
    assert label in _text(browser, "#chart-latency")
    total = sum(p["inferences"] for s in charts for p in s["points"])
    assert total == sum(c["inferences"] for t in backends["classes"] for c in t["configs"])


def test_a_fleet_of_40_device_classes_stays_one_table_and_readable_charts(browser, site):
    """WIDE boards, each its own device class, report VARIANTS_MODEL:1: the backend table
    is one table of WIDE rows, sortable, and the charts draw 7 lines and one "other"."""
    path = f"models/{VARIANTS_MODEL}/1"
    _sign_in(browser, site, path)
    _open(browser, site, path, "version-40-classes")
    backends = site.cli("model", "show", f"{VARIANTS_MODEL}:1", "--backends")
    assert len(backends["classes"]) == WIDE
    assert len(_rows(browser, "table#backends")) == 1
    rows = _rows(browser, "#backends tbody tr")
    assert len(rows) == WIDE == sum(len(t["configs"]) for t in backends["classes"])
    # Every class as `--backends` has it, quotes and all (its OS version holds ' and ").
    inferences = {
        json.dumps(t["device_class"], sort_keys=True): c["inferences"]
        for t in backends["classes"]
        for c in t["configs"]
    }
    shown = {
        json.dumps(json.loads(r.get_attribute("data-class")), sort_keys=True): int(
            r.find_element(By.CSS_SELECTOR, ".inferences").text
        )
        for r in rows
    }
    assert shown == inferences
    assert {json.loads(k)["os_version"] for k in shown} == {OS}

    # Sorted by clicking a column's title: the busiest board first, then the quietest.
    header = browser.find_element(By.XPATH, "//table[@id='backends']//th[text()='Inferences']")
    header.click()
    assert header.get_attribute("aria-sort") == "ascending"
    assert _column(browser, ".inferences") == sorted(float(n) for n in inferences.values())
    header.click()
    assert header.get_attribute("aria-sort") == "descending"
    down = _column(browser, ".inferences")
    assert down == sorted((float(n) for n in inferences.values()), reverse=True)
    first = browser.find_element(By.CSS_SELECTOR, "#backends tbody tr")
    assert json.loads(first.get_attribute("data-class"))["device_model"] == f"Board {WIDE - 1:02d}"
    browser.save_screenshot(str(ARTIFACTS / "version-40-classes-sorted.png"))

    # The charts: the 7 busiest boards by name, the other 33 folded into one line that
    # holds every inference they reported.
    auth = {"Authorization": f"Bearer {site.cp.token}"}
    charts = site.http().get(site.url + f"api/v1/{path}/series", headers=auth).json()["series"]
    assert len(charts) == 8
    busiest = [c["labels"]["device_class"]["device_model"] for c in charts[:7]]
    assert busiest == [f"Board {i:02d}" for i in range(WIDE - 1, WIDE - 8, -1)]
    assert charts[-1]["labels"] == {"other": WIDE - 7, "device_classes": WIDE - 7}
    folded = sum(p["inferences"] for p in charts[-1]["points"])
    assert folded == sum(100 + 10 * i for i in range(WIDE - 7))
    legend = _text(browser, "#chart-latency")
    assert f"other ({WIDE - 7} classes)" in legend
    assert "Board 00" not in legend and f"Board {WIDE - 1:02d}" in legend


def _column(driver, css: str) -> list[float | None]:
    values = [c.get_attribute("data-value") for c in _rows(driver, f"#backends tbody td{css}")]
    return [float(x) if x else None for x in values]


def test_the_overview_shows_each_versions_health(browser, site):
    _sign_in(browser, site, "")
    _open(browser, site, "", "overview-health")
    auth = {"Authorization": f"Bearer {site.cp.token}"}
    doc = site.http().get(site.url + "api/v1/fleet", headers=auth).json()
    devices = site.cli_list("devices", "fleet", "ls")
    rows = _rows(browser, "#versions-health tbody tr")
    assert [
        (r.get_attribute("data-model"), int(r.get_attribute("data-version"))) for r in rows
    ] == [(v["model"], v["version"]) for v in doc["versions"]]
    assert {(v["model"], v["version"]) for v in doc["versions"]} >= {("det", 1), ("det", 2)}
    for v in doc["versions"]:
        row = f"#versions-health tr[data-model='{v['model']}'][data-version='{v['version']}']"
        live = [d for d in devices if not d["revoked"]]
        for kind, css in (("desired", "assigned"), ("installed", "installed")):
            count = sum(d[kind].get(v["model"], {}).get("version") == v["version"] for d in live)
            assert int(_text(browser, f"{row} .{css}")) == v[f"devices_{css}"] == count
        assert int(_text(browser, f"{row} .inferences")) == v["inferences"]
        p95 = v["p95_us"]
        assert _text(browser, f"{row} .p95") == (f"{p95:.1f}" if p95 is not None else "-")
        # Over the same day, the version's chart series hold the same inferences and crashes.
        found = (
            site.http()
            .get(
                site.url + f"api/v1/models/{v['model']}/{v['version']}/series?hours=24",
                headers=auth,
            )
            .json()["series"]
        )
        points = [p for s in found for p in s["points"]]
        assert v["inferences"] == sum(p["inferences"] for p in points)
        assert v["crashes"] == sum(p["crashes"] for p in points)
        if v["inferences"]:
            assert v["crash_rate"] == v["crashes"] / v["inferences"]
            # A pooled quantile lies between those of the series it pools.
            p95s = [p["p95_us"] for p in points if p["p95_us"] is not None]
            assert min(p95s) <= p95 <= max(p95s)
    assert doc["versions"][0]["inferences"] > 0 or doc["versions"][1]["inferences"] > 0


def test_a_language_models_version_page_draws_its_decode_speed_and_first_token_time(browser, site):
    _sign_in(browser, site, f"models/{LLM_MODEL}/1")
    _open(browser, site, f"models/{LLM_MODEL}/1", "version-llm")
    auth = {"Authorization": f"Bearer {site.cp.token}"}
    charts = (
        site.http()
        .get(site.url + f"api/v1/models/{LLM_MODEL}/1/series", headers=auth)
        .json()["series"]
    )
    points = [p for s in charts for p in s["points"]]
    assert sum(p["tokens_out"] for p in points) == 3 * 40 * 64
    for p in points:  # reported at 50 tokens/s and 200 ms to the first token
        assert 45 < p["decode_tps"] < 55 and 180 < p["ttft_p95_ms"] < 240
    for chart, title in (("#chart-decode", "Decode speed"), ("#chart-ttft", "first token")):
        WebDriverWait(browser, 15).until(
            EC.presence_of_element_located((By.CSS_SELECTOR, f"{chart} .main-svg"))
        )
        assert title in _text(browser, chart)
    assert "llama, 2 layers" in _text(browser, "#llm")
    assert "fits a device with" in _text(browser, "#variants tr[data-variant='q8'] .accuracy")
    assert _text(browser, "#variants tr[data-variant='q8'] .max-abs") == "-"
    # A model that is not a language model draws neither.
    _open(browser, site, "models/det/2", "version-not-llm")
    assert not browser.find_elements(By.CSS_SELECTOR, "#chart-decode, #chart-ttft")
