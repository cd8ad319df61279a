"""`skiff demo` (what `make demo` runs) works end to end and cleans up after itself."""

from __future__ import annotations

import re

from tests.control_plane.test_cli import skiff


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
    assert "every device is back on detector:1" in out
    assert "rolled_back" in out
    # stdout is the walkthrough only: logs go to stderr.
    assert " INFO " not in out
