"""A server process runs NumPy's BLAS on the calling thread only (control_plane.blas_threads).

The guard's small products handed to OpenBLAS's pool waited for its threads to wake: a
health view of 10k devices took 378-701 ms on a busy 2-core machine, 233-272 ms without.
"""

from __future__ import annotations

from control_plane.home import init_home
from control_plane.settings import load_config
from tests.fresh_interpreter import printed_json


def test_a_started_server_leaves_blas_one_thread(tmp_path):
    home = tmp_path / "home"
    init_home(load_config(home, environ={}))
    script = f"""
import json
from pathlib import Path

import numpy
from threadpoolctl import threadpool_info, threadpool_limits

from control_plane.serve import start_server
from control_plane.settings import load_config


def blas():
    return sorted(p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas")


threadpool_limits(limits=3, user_api="blas")  # a pool, whatever this machine's cores
before = blas()
config = load_config(Path({str(home)!r}), environ={{}})
server, _ = start_server(config=config, address="127.0.0.1:0")
after = blas()
server.stop(grace=None)
server.app.store.close()
print(json.dumps({{"before": before, "after": after}}))
"""
    seen = printed_json(script)
    assert seen["before"] == [3], seen
    assert seen["after"] == [1], seen
