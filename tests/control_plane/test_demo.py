"""`skiff demo` (what `make demo` runs) works end to end and cleans up after itself."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

from tests.control_plane.cli.test_cli import SKIFF, skiff

# gRPC's own record of a response it could not send (a simulated device's connection
# closed under it as the demo stops its fleet): the transport's, not a fault of Skiff's.
_TRANSPORT = re.compile(r"ExecuteBatchError raised in core by servicer method \[[^\]]+\]$")


def _tracebacks(stderr: str) -> list[str]:
    """Return each logged traceback (with the line before it) but gRPC's transport records."""
    lines = stderr.splitlines()
    found = []
    for i, line in enumerate(lines):
        if "Traceback" in line and not (i and _TRANSPORT.search(lines[i - 1])):
            found.append("\n".join(lines[max(0, i - 1) : i + 30]))
    return found


def test_demo_runs_the_whole_loop(tmp_path):
    # `make demo` adds --real-models; what that shows is tested in test_real_models.py
    # (registry) and tests/runtime/test_real_models.py, without a minute of CI for the demo.
    result = skiff("demo", "--home", str(tmp_path / "demo"), timeout=600)
    out = result.stdout
    assert "sha256 verified = True" in out
    assert "push of random bytes rejected" in out
    assert re.search(r"300 simulated devices enrolled and running detector:1", out)
    stages = re.findall(r"stage (\d) \((\d+)%\): (\d+) devices installed detector:2", out)
    assert [s[:2] for s in stages] == [("1", "10"), ("2", "50"), ("3", "100")]
    counts = [int(s[2]) for s in stages]
    assert 0 < counts[0] < counts[1] < counts[2]  # each stage widens the rollout
    assert "every device is back on detector:1, the 3 agents included" in out
    assert "rolled_back" in out
    # Real agents: two in the selector moved to v2 and back, the third never moved.
    assert "3 agent processes up and serving" in out
    assert "and agent-3" in out  # outside the selector
    assert re.findall(r"agent-\d: serving detector:(\d)", out) == ["1", "1", "1"]
    # Events through the pipeline of v2 on an agent come back as model results.
    fired = re.search(r"3000 events in 6 PushEvents calls -> (\d+) firings -> (\d+) results", out)
    assert fired and int(fired[1]) == int(fired[2]) > 0, out
    assert re.search(r"user +\d+ at \+ *[\d.]+s  checkout -> \[[-+\d., ]+\]  \(v2\)", out)
    assert re.search(r"detector:2 \(fp32, CPU[^)]*\) answered y \[1, 4\]", out)
    # The guarded rollout: the slow SoC's slice is rolled back by its guardrail, with the
    # evidence, while the rest completes; those devices end up where they belong.
    assert re.search(r"guardrail +slice_rollback +soc=sm8550: .*p95_latency_ratio", out)
    assert re.search(r"evidence: p95 [\d,]+ us on \d+ candidate devices", out)
    assert "every sm8550 device is back on detector:1; the other SoCs run detector:2" in out
    assert re.search(r"guardrail +ro_\w+: soc=sm8550 rolled back .* the rest completed", out)
    assert "== summary" in out and "every agent process stopped" in out
    assert re.search(r"== dashboard at https?://127\.0\.0\.1:\d+/ while the demo runs", out)
    assert not _tracebacks(result.stderr), "\n\n".join(_tracebacks(result.stderr))
    _no_agent_left(tmp_path / "demo")
    # stdout is the walkthrough only: logs go to stderr.
    assert " INFO " not in out


def _agents_of(home) -> list[int]:
    """Pids of processes whose command line names the demo's agent state directories."""
    marker = str(home / "agents")
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    pids.append(int(pid))
        except OSError:
            continue
    return pids


def _no_agent_left(home) -> None:
    deadline = time.monotonic() + 10
    while _agents_of(home) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _agents_of(home)


def test_ctrl_c_stops_every_agent_the_demo_started(tmp_path):
    home = tmp_path / "demo"
    log = tmp_path / "demo.log"
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            [*SKIFF, "demo", "--home", str(home)], stdout=subprocess.PIPE, stderr=stderr, text=True
        )
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if "agent processes up and serving" in line:
                break
        why = "".join(seen[-5:]) + log.read_text()[-3000:]
        assert len(_agents_of(home)) == 3, why
        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends to the demo
        proc.communicate(timeout=60)
        assert proc.returncode != 0
        _no_agent_left(home)
    finally:
        proc.kill()
        proc.wait()
