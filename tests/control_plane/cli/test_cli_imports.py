"""An operator's command that only talks to the server loads neither numpy nor Tink.

Each CLI call is a process of its own: numpy (~80 ms to import) and Tink (~20 ms) were
loaded by every `skiff token create`, through the push request's golden settings and the
crypto package's envelope names. Commands that need them (push, pull, convert) import
them where they run.
"""

from __future__ import annotations

from tests.fresh_interpreter import printed_json

HEAVY = ("numpy", "tink", "MNN", "sqlalchemy")


def test_the_command_line_imports_no_numpy_tink_or_mnn():
    script = (
        "import json, sys\n"
        "import control_plane.cli.main\n"
        "from control_plane.cli import commands, connect, fleet_commands, signing_commands\n"
        "from control_plane.api.transport import client_tls\n"
        f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))\n"
    )
    assert printed_json(script) == []


def test_the_crypto_packages_lazy_names_still_resolve():
    script = (
        "import json, sys\n"
        "import control_plane.crypto as crypto\n"
        "before = 'tink' in sys.modules\n"
        "from control_plane.crypto import SEGMENT_SIZE, decrypt_stream, LocalKek\n"
        "from contract import envelope\n"
        "same = decrypt_stream is envelope.decrypt_stream and SEGMENT_SIZE > 0\n"
        "try:\n"
        "    crypto.nothing_here\n"
        "    missing = False\n"
        "except AttributeError as exc:\n"
        "    missing = 'nothing_here' in str(exc)\n"
        "print(json.dumps([before, same, callable(LocalKek.create), missing]))\n"
    )
    assert printed_json(script) == [False, True, True, True]
