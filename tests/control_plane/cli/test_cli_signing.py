"""What the CLI trusts: pinned signing keys, the signed manifest, and how pull writes."""

from __future__ import annotations

import json
import os
import stat

import pytest
from sqlalchemy import select, update

from contract import errors
from control_plane.pins import pins_path
from control_plane.settings import load_config
from control_plane.store import orm
from tests.control_plane.cli.test_cli import _error_line, model_file, server, skiff  # noqa: F401
from tests.control_plane.helpers import start_control_plane

EXIT_CONFLICT, EXIT_INTEGRITY = 7, 8


@pytest.fixture
def remote_home(server, tmp_path):  # noqa: F811 - fixture
    """A CLI home with a token and a server address but no pinned keys."""
    home = tmp_path / "remote"
    home.mkdir(mode=0o700)
    token = (server["home"] / "admin.token").read_text().strip()
    ca = load_config(server["home"], environ={}).tls_ca  # it trusts the server's CA, though
    env = {**server["env"], "SKIFF_HOME": str(home), "SKIFF_TOKEN": token, "SKIFF_CA": ca}
    return home, env


def test_pull_and_show_verify_the_signed_manifest(server, model_file, tmp_path):  # noqa: F811
    env = server["env"]
    skiff("model", "push", str(model_file), "--name", "sigdet", env=env)
    key_id = json.loads(pins_path(server["home"]).read_text())["keys"][0]["key_id"]
    out = tmp_path / "pulled.mnn"
    pulled = json.loads(
        skiff("model", "pull", "sigdet:1", "-o", str(out), "--json", env=env).stdout
    )
    assert pulled["signature_verified"] is True and pulled["signed_by"] == key_id
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    shown = json.loads(skiff("model", "show", "sigdet:1", "--json", env=env).stdout)
    assert shown["versions"][0]["signature_verified"] is True
    assert f"manifest  signed by {key_id}" in skiff("model", "show", "sigdet:1", env=env).stdout


def test_remote_home_pins_explicitly_then_follows_rotations(
    server,  # noqa: F811
    model_file,  # noqa: F811
    remote_home,
    tmp_path,
):
    home, env = remote_home
    skiff("model", "push", str(model_file), "--name", "remdet", env=server["env"])
    out = tmp_path / "remote.mnn"
    refused = skiff("model", "pull", "remdet:1", "-o", str(out), env=env, check=False)
    assert refused.returncode == EXIT_CONFLICT
    assert "skiff key pin" in _error_line(refused)
    assert not out.exists()
    shown = skiff("model", "show", "remdet:1", env=env).stdout
    assert "signature NOT verified: no pinned signing keys" in shown and "signed by" not in shown
    shown_json = json.loads(skiff("model", "show", "remdet:1", "--json", env=env).stdout)
    assert shown_json["versions"][0]["signature_verified"] is False

    pinned = skiff("key", "pin", env=env).stdout
    first = json.loads(pins_path(home).read_text())["keys"][0]["key_id"]
    assert first in pinned and "sha256:" in pinned
    again = skiff("key", "pin", env=env, check=False)
    assert again.returncode == EXIT_CONFLICT and "--replace" in _error_line(again)
    skiff("model", "pull", "remdet:1", "-o", str(out), env=env)

    rotated = json.loads(
        skiff("key", "rotate-signing", "--overlap", "1h", "--json", env=server["env"]).stdout
    )
    new = rotated["active"]["key_id"]
    assert rotated["previous"]["key_id"] == first and rotated["active"]["endorsed_by"] == first
    pulled = json.loads(
        skiff(
            "model", "pull", "remdet:1", "-o", str(out), "--json", "--variant", "fp32", env=env
        ).stdout
    )
    assert pulled["signed_by"] == new  # learnt through the endorsement, then verified
    assert {k["key_id"] for k in json.loads(pins_path(home).read_text())["keys"]} == {first, new}
    assert f"signed by {new}" in skiff("model", "show", "remdet:1", env=server["env"]).stdout


@pytest.fixture
def plane(tmp_path, model_file):  # noqa: F811
    """An in-process control plane with det:1 and other:1, for tampering with its database."""
    cp = start_control_plane(tmp_path / "home")
    with cp.client() as client:
        client.push(model_file, name="det")
        client.push(model_file, name="other")
    env = {"SKIFF_HOME": str(cp.config.home), "SKIFF_SERVER": cp.address, "SKIFF_TOKEN": ""}
    yield cp, env
    cp.stop()


def _version_row(session, model: str):
    return session.scalar(
        select(orm.VersionRow).join(orm.ModelRow).where(orm.ModelRow.name == model)
    )


def _tamper(cp, model: str, **values) -> None:
    with cp.registry.store._scope() as session:
        row = _version_row(session, model)
        session.execute(update(orm.VersionRow).where(orm.VersionRow.id == row.id).values(**values))


def _signed_copy(cp, model: str) -> dict:
    with cp.registry.store._read() as session:
        row = _version_row(session, model)
        return {"manifest": row.manifest, "manifest_signature": row.manifest_signature}


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 1]) + data[at + 1 :]


def _lying_digest(cp, model: str = "det") -> dict:
    """The manifest, validly signed by the server's key, naming a wrong plaintext digest."""
    manifest = json.loads(_signed_copy(cp, model)["manifest"])
    manifest["variants"]["fp32"]["plaintext_sha256"] = "0" * 64
    signed = cp.registry.signer.sign(manifest)
    return {"manifest": signed.body, "manifest_signature": signed.signature}


@pytest.mark.parametrize(
    ("tampering", "words"),
    [
        (lambda cp: _signed_copy(cp, "other"), "names model 'other', not 'det'"),
        (lambda cp: {"manifest": _flip(_signed_copy(cp, "det")["manifest"], 40)}, "not verify"),
        (
            lambda cp: {
                "manifest_signature": _flip(_signed_copy(cp, "det")["manifest_signature"], 5)
            },
            "not verify",
        ),
        (_lying_digest, "does not match its signed manifest"),
    ],
    ids=["other-model", "flipped-manifest", "flipped-signature", "signed-digest"],
)
def test_tampered_manifest_fails_pull_with_integrity(plane, tmp_path, tampering, words):
    cp, env = plane
    _tamper(cp, "det", **tampering(cp))
    out = tmp_path / "det.mnn"
    result = skiff("model", "pull", "det:1", "-o", str(out), env=env, check=False)
    assert result.returncode == EXIT_INTEGRITY, result.stderr
    assert words in _error_line(result)
    assert not out.exists()
    assert not list(tmp_path.glob(".det.mnn.*"))
    shown = skiff("model", "show", "det:1", env=env).stdout
    if words != "does not match its signed manifest":  # that one is signed, just untrue
        assert "signature NOT verified" in shown and "signed by" not in shown


def test_another_versions_manifest_fails_pull(plane, tmp_path, model_file):  # noqa: F811
    cp, env = plane
    with cp.client() as client:
        client.push(model_file, name="det", allow_duplicate=True)
    with cp.registry.store._scope() as session:
        rows = session.scalars(
            select(orm.VersionRow).join(orm.ModelRow).where(orm.ModelRow.name == "det")
        ).all()
        v1, v2 = sorted(rows, key=lambda r: r.number)
        v2.manifest, v2.manifest_signature = v1.manifest, v1.manifest_signature
    result = skiff("model", "pull", "det:2", "-o", str(tmp_path / "x.mnn"), env=env, check=False)
    assert result.returncode == EXIT_INTEGRITY
    assert "names version 1, not 2" in _error_line(result)
    skiff("model", "pull", "det:1", "-o", str(tmp_path / "x.mnn"), env=env)


def test_pull_never_writes_through_a_planted_symlink(plane, tmp_path):
    cp, _ = plane
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    out = tmp_path / "det.mnn"
    planted = tmp_path / f".det.mnn.{os.getpid()}.part"
    planted.symlink_to(victim)
    with cp.client() as client, pytest.raises(errors.AlreadyExists, match="already exists"):
        client.pull("det", 1, out, pins=cp.pins)
    assert victim.read_bytes() == b"precious" and not out.exists()
    assert planted.is_symlink()  # not ours to remove

    planted.unlink()
    out.symlink_to(victim)  # the output name itself: replaced, never followed
    old_umask = os.umask(0o022)
    try:
        with cp.client() as client:
            client.pull("det", 1, out, pins=cp.pins)
    finally:
        os.umask(old_umask)
    assert victim.read_bytes() == b"precious"
    assert not out.is_symlink() and out.stat().st_size > 0
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
