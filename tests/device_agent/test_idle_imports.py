"""An idle agent holds no numpy: it is imported with the first model or pipeline push.

numpy is the largest library the daemon could hold for nothing (about 16 MB resident);
a device runs the agent all day, mostly with no request in flight. Nor does it hold
urllib.request (with http.client): presigned downloads need it, an idle agent does not;
nor Tink (about 13 MB resident), which unwraps and decrypts what the agent installs.
"""

from __future__ import annotations

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
