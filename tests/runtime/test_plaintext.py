"""Plaintext models stay in memory, in every mode: no core dumps, no files, no leaks."""

from __future__ import annotations

import gc
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from runtime.model import Isolation, Model
from tests.ci import on_ci
from tests.runtime._model_helpers import CPU_1, tiny_mnn, x16

REPO_ROOT = Path(__file__).resolve().parents[2]


def _run(script: str, *prefix: str, cwd: Path | None = None, env: dict | None = None):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), **(env or {})}
    return subprocess.run(
        [*prefix, sys.executable, "-c", textwrap.dedent(script)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("isolation", ["in_process", "worker"])
def test_loading_a_model_makes_the_process_undumpable(tmp_path, isolation):
    model = tmp_path / "model.bin"
    model.write_bytes(tiny_mnn())
    script = f"""
        import json, resource
        from runtime.hardening import is_dumpable
        from runtime.model import Model
        before = is_dumpable()
        data = open({str(model)!r}, "rb").read()  # as if just decrypted
        with Model.from_bytes(data, config={CPU_1.key!r}, isolation={isolation!r}) as m:
            pass
        limits = open("/proc/self/limits").read()
        print(json.dumps([before, is_dumpable(), resource.getrlimit(resource.RLIMIT_CORE)]))
        print(limits)
        """
    result = _run(script)
    assert result.returncode == 0, result.stderr
    first, *limits = result.stdout.splitlines()
    assert json.loads(first) == [True, False, [0, 0]]  # read back through prctl(PR_GET_DUMPABLE)
    assert any(re.match(r"Max core file size\s+0\s+0\s", line) for line in limits)


def _memfds(prefix: str = "/memfd:skiff-model") -> int:
    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{name}").startswith(prefix)
        except FileNotFoundError:  # the listing's own descriptor, closed already
            pass
    return count


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def test_dropped_models_release_their_plaintext_memfds():
    before = _memfds()
    models = [Model.from_bytes(tiny_mnn(), config=CPU_1, version=f"v{i}") for i in range(5)]
    for model in models:
        model.run(x16())
    assert _memfds() == before + 5
    del model, models  # never closed
    gc.collect()
    assert _memfds() == before


def test_a_dropped_worker_model_ends_its_worker():
    before = _memfds()
    model = Model.from_bytes(tiny_mnn(), config=CPU_1, isolation=Isolation.WORKER)
    model.run(x16())
    pid = model._chain.active.pid
    assert _alive(pid)
    del model
    gc.collect()
    assert not _alive(pid) and _memfds() == before


_WRITES = (
    "open,openat,openat2,creat,write,pwrite64,writev,pwritev,pwritev2,sendfile,"
    "copy_file_range,splice,rename,renameat,renameat2,link,linkat,truncate,ftruncate"
)
# A descriptor strace -y annotates; these never reach a filesystem.
_IN_MEMORY = ("/memfd:", "pipe:[", "socket:[", "/dev/null")


@pytest.mark.slow
def test_no_plaintext_is_written_anywhere_but_memfds(tmp_path):
    if shutil.which("strace") is None:
        (pytest.fail if on_ci() else pytest.skip)("needs strace (make test installs it)")
    model = tmp_path / "model.bin"
    model.write_bytes(tiny_mnn())  # the test's copy; the app below only ever reads it
    work, trace = tmp_path / "cwd", tmp_path / "trace.log"
    work.mkdir()
    script = f"""
        import numpy as np
        from runtime.model import Model
        data = open({str(model)!r}, "rb").read()  # as if just decrypted
        x = {{"x": np.ones((1, 16), np.float32)}}
        for isolation in ("in_process", "worker"):
            with Model.from_bytes(data, isolation=isolation, probe_runs=2) as m:
                m.run(x)
                m.run({{"x": np.ones((3, 16), np.float32)}})  # a new shape: MNN may log
        print("served")
        """
    prefix = ("strace", "-f", "-qq", "-y", "-e", f"trace={_WRITES}", "-o", str(trace))
    env = {"TMPDIR": str(work), "PYTHONDONTWRITEBYTECODE": "1"}  # .pyc writes would muddy it
    result = _run(script, *prefix, cwd=work, env=env)
    if result.returncode != 0 and "ptrace" in result.stderr.lower():
        (pytest.fail if on_ci() else pytest.skip)("ptrace is not permitted here")
    assert result.returncode == 0 and result.stdout == "served\n", result.stderr
    lines = [line for line in trace.read_text().splitlines() if "= -1 " not in line]
    opened = [line for line in lines if re.search(r"open.*O_(WRONLY|RDWR|CREAT)", line)]
    opened = [re.search(r"= \d+<([^>]*)>", line).group(1) for line in opened]
    calls = r"\d+\s+(p?write|sendfile|copy_file_range|splice|ftruncate)\("
    written = [line for line in lines if re.match(calls, line)]
    written = [re.search(r"\(\d+<([^>]*)>", line).group(1) for line in written]
    assert any(t.startswith("/memfd:skiff-model") for t in written)  # the trace sees writes
    assert [t for t in opened + written if not t.startswith(_IN_MEMORY)] == []
    assert [line for line in lines if re.match(r"\d+\s+(rename|link|truncate)", line)] == []
    assert list(work.iterdir()) == []
