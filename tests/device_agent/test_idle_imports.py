"""An idle agent holds no numpy: it is imported with the first model or pipeline push.

numpy is the largest library the daemon could hold for nothing (about 16 MB resident);
a device runs the agent all day, mostly with no request in flight. Nor does it hold
urllib.request (with http.client): presigned downloads need it, an idle agent does not;
nor Tink (about 13 MB resident), which unwraps and decrypts what the agent installs.
"""

from __future__ import annotations

import sys

import pytest

from contract.key_wrap import DeviceKeyPair
from device_agent.device_keys import _LENGTH, _read_pair, new_key_pair
from tests.fresh_interpreter import printed_json

NOT_AT_IDLE = ("http.client", "urllib.request", "tink")


def test_the_daemons_modules_import_no_numpy():
    script = (
        "import json, sys\n"
        "import device_agent.cli, device_agent.agent, device_agent.local_api\n"
        "import device_agent.commands, device_agent.serving, device_agent.pipelines\n"
        "print(json.dumps('numpy' in sys.modules))\n"
    )
    assert printed_json(script) is False


def test_the_daemon_imports_no_http_client():
    # What `skiff agent run` imports before it serves (device_agent.commands.start_agent_run).
    script = (
        "import json, sys\n"
        "import device_agent.cli, device_agent.commands, device_agent.agent\n"
        "import device_agent.local_api, device_agent.client_settings, runtime.hardening\n"
        "from device_agent.device_facts import _mnn_version\n"
        "_mnn_version()\n"
        f"print(json.dumps(sorted(m for m in {NOT_AT_IDLE!r} if m in sys.modules)))\n"
    )
    assert printed_json(script) == []


def test_tensors_still_convert_where_numpy_is_imported_late():
    script = (
        "import json, sys\n"
        "from contract.local_api import to_array, to_tensor\n"
        "before = 'numpy' in sys.modules\n"
        "import numpy as np\n"
        "x = np.arange(6, dtype=np.float32).reshape(2, 3)\n"
        "back = to_array(to_tensor('x', x))\n"
        "print(json.dumps([before, back.tolist()]))\n"
    )
    before, back = printed_json(script)
    assert before is False and back == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]


def test_the_key_pair_made_at_enrollment_leaves_no_tink_behind():
    # Made in a child, so an agent that has just enrolled idles as small as one that
    # started with its identity (bench/agent.py: idle_rss_mb against idle_rss_restarted_mb).
    script = (
        "import json, sys\n"
        "from device_agent.device_keys import new_key_pair\n"
        "pairs = [new_key_pair() for _ in range(2)]\n"
        "print(json.dumps(['tink' in sys.modules, [[k.hex() for k in p] for p in pairs]]))\n"
    )
    held, pairs = printed_json(script)
    assert held is False
    (private, public), (other, _) = [[bytes.fromhex(k) for k in p] for p in pairs]
    assert DeviceKeyPair.from_private(private).public_keyset() == public
    assert other != private  # a new pair each time


def test_the_key_pair_is_made_here_when_no_child_can_run(monkeypatch, caplog):
    monkeypatch.setattr(sys, "executable", "/nonexistent/python3")
    private, public = new_key_pair()
    assert DeviceKeyPair.from_private(private).public_keyset() == public
    assert "making the key pair in a child failed" in caplog.text
    assert private.hex() not in caplog.text


@pytest.mark.parametrize(
    "out",
    [
        b"",
        _LENGTH.pack(5) + b"abc",
        _LENGTH.pack(1) + b"a",
        _LENGTH.pack(0) + _LENGTH.pack(1) + b"a",
        _LENGTH.pack(1) + b"a" + _LENGTH.pack(1) + b"b" + b"!",
    ],
)
def test_a_key_pair_that_comes_back_wrong_is_refused(out):
    with pytest.raises(ValueError, match="key pair came back"):
        _read_pair(out)


def test_a_module_in_the_working_directory_cannot_make_the_key_pair(tmp_path):
    # An agent started in a directory others can write to: their struct.py, or a
    # contract/ package, would shadow ours in a plain `python -c` (its sys.path starts
    # with the working directory), as would one on PYTHONPATH. The child runs isolated.
    (tmp_path / "struct.py").write_text("raise SystemExit('planted struct ran')\n")
    (tmp_path / "contract").mkdir()
    (tmp_path / "contract" / "__init__.py").write_text("raise SystemExit('planted')\n")
    script = (
        "import json, os, sys\n"
        "from device_agent.device_keys import new_key_pair\n"
        f"os.chdir({str(tmp_path)!r})\n"
        f"os.environ['PYTHONPATH'] = {str(tmp_path)!r}\n"
        "new_key_pair()\n"
        "print(json.dumps('tink' in sys.modules))\n"
    )
    assert printed_json(script) is False  # made in the child, not by the fallback here
