"""TLS through the `skiff` command: init's certificates, refusals in one line, exit codes."""

from __future__ import annotations

import json
import signal

import pytest
from cryptography import x509

from tests.control_plane.cli.test_cli import skiff
from tests.control_plane.helpers import spawn_server


def _error_line(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr  # no traceback, no gRPC log lines
    assert lines[0].startswith("skiff: error: ")
    return lines[0]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    home = tmp_path_factory.mktemp("tls") / "home"
    made = json.loads(skiff("init", "--home", str(home), "--tls-san", "skiff.lan", "--json").stdout)
    proc, address = spawn_server(home)
    yield {"home": home, "made": made, "address": address}
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0


def test_init_names_the_extra_host_and_the_cli_verifies_against_the_home_ca(served):
    cert = x509.load_pem_x509_certificate(open(served["made"]["tls_cert"], "rb").read())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "skiff.lan" in sans.get_values_for_type(x509.DNSName)
    ok = skiff("model", "ls", "--home", str(served["home"]), "--json", env=_env(served))
    assert json.loads(ok.stdout) == {"models": [], "more": False}


def _env(served) -> dict:
    return {"SKIFF_SERVER": served["address"], "SKIFF_TOKEN": "", "SKIFF_CA": ""}


def test_cli_with_another_ca_refuses_in_one_line(served, tmp_path):
    skiff("init", "--home", str(tmp_path / "other"))
    other_ca = str(tmp_path / "other" / "tls" / "ca.pem")
    for how in (["--ca", other_ca], []):
        env = {**_env(served), **({} if how else {"SKIFF_CA": other_ca})}
        result = skiff("model", "ls", "--home", str(served["home"]), *how, env=env, check=False)
        assert result.returncode == 6, result.stderr
        assert "not signed by the CA this client trusts" in _error_line(result)


def test_server_without_a_certificate_refuses_a_public_bind(tmp_path):
    home = tmp_path / "home"
    skiff("init", "--home", str(home))
    config = json.loads((home / "skiff.json").read_text())
    for name in ("tls_cert", "tls_key", "tls_ca"):  # a home made before TLS existed
        del config[name]
    (home / "skiff.json").write_text(json.dumps(config))
    result = skiff("server", "--home", str(home), "--grpc", "0.0.0.0:0", check=False)
    assert result.returncode == 3
    # The server logs at INFO (imports log before anything else): the error is the end.
    line = result.stderr.strip().splitlines()[-1]
    assert "Traceback" not in result.stderr
    assert "refusing to listen on 0.0.0.0:0 without TLS" in line and "tls_cert" in line


def test_init_refuses_a_key_that_is_not_the_certificates(served, tmp_path):
    made = served["made"]
    other = tmp_path / "other"
    skiff("init", "--home", str(other))
    result = skiff(
        "init",
        "--home",
        str(tmp_path / "mine"),
        "--tls-cert",
        made["tls_cert"],
        "--tls-key",
        str(other / "keys" / "tls_server_key.pem"),
        check=False,
    )
    assert result.returncode == 3
    assert "does not match" in _error_line(result)
    assert not (tmp_path / "mine" / "skiff.json").exists()
