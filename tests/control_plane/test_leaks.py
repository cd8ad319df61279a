"""The leak finder finds: a key logged in any of the usual forms is caught."""

from __future__ import annotations

import base64
import logging

import pytest

from contract.envelope import new_data_key
from tests.control_plane.leaks import find_leaks, key_material

log = logging.getLogger("leak-self-test")


def _forms(data_key: bytes) -> dict[str, str]:
    value = key_material(data_key)["key value 0"]
    return {
        "keyset hex": data_key.hex(),
        "keyset repr": repr(data_key),
        "keyset base64": base64.b64encode(data_key).decode(),
        "keyset urlsafe base64, no padding": base64.urlsafe_b64encode(data_key)
        .decode()
        .rstrip("="),
        "keyset raw": data_key.decode("latin-1"),
        "key value hex": value.hex(),
        "key value upper hex": value.hex().upper(),
        "key value repr": repr(value),
        # Inside a bigger blob, at each base64 alignment.
        **{
            f"key value in a blob at offset {k}": base64.b64encode(
                b"x" * k + value + b"tail"
            ).decode()
            for k in range(3)
        },
    }


@pytest.mark.parametrize("form", list(_forms(new_data_key())))
def test_a_deliberately_logged_key_is_found(caplog, form):
    data_key = new_data_key()
    caplog.set_level(logging.DEBUG)
    log.info("pushing with %s", _forms(data_key)[form])
    assert find_leaks(caplog.text, data_key), form


def test_unrelated_text_and_another_key_are_not_leaks(caplog):
    data_key, other = new_data_key(), new_data_key()
    caplog.set_level(logging.DEBUG)
    for text in _forms(other).values():
        log.info("other key: %s", text)
    log.info("pushed det:1 (fp32, int8)")
    assert find_leaks(caplog.text, data_key) == []
