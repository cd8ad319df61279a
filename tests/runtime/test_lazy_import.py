"""`import runtime` is cheap: numpy, MNN and the native stream engine load only when used.

Each check runs in a fresh interpreter: this test process has long since imported all
of them, so only a new one can tell what an import really pulls in.
"""

from __future__ import annotations

import ast
import sys
import textwrap
from pathlib import Path

import pytest

import runtime
from tests.fresh_interpreter import printed_json

REPO_ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("numpy", "MNN", "runtime._native._core")


def _loaded_after(script: str) -> dict:
    """Run `script` in a fresh interpreter; return the JSON it prints on its last line."""
    prelude = f"import json, sys\nheavy = lambda: [m for m in {HEAVY!r} if m in sys.modules]\n"
    return printed_json(prelude + textwrap.dedent(script))


def test_importing_runtime_loads_no_numpy_mnn_or_native_engine():
    found = _loaded_after(
        """
        import runtime
        bare = heavy()
        from runtime import Model
        after_model = heavy()
        engine = runtime.StreamEngine
        print(json.dumps({
            "bare": bare,
            "after_model": after_model,
            "after_stream": heavy(),
            "model": f"{Model.__module__}.{Model.__name__}",
            "stream": f"{engine.__module__}.{engine.__name__}",
        }))
        """
    )
    assert found["bare"] == []
    assert found["after_model"] == ["numpy"]  # Model needs numpy; MNN waits for a load
    assert found["after_stream"] == ["numpy", "runtime._native._core"]
    assert found["model"] == "runtime.model.Model"
    assert found["stream"] == "runtime.stream.StreamEngine"


@pytest.mark.parametrize("module", ["runtime.histogram", "runtime.backends", "runtime.mnn_host"])
def test_modules_the_control_plane_and_sandbox_import_stay_light(module):
    # The histogram layout and backend configs are read by the server; mnn_host by the
    # registry's sandboxed child before it loads MNN on its own terms.
    assert _loaded_after(f"import {module}\nprint(json.dumps(heavy()))") == []


@pytest.mark.parametrize("op", ["inspect", "golden", "convert", "variant"])
def test_the_registry_sandbox_child_never_loads_the_native_stream_engine(op):
    # What the child imports: its module, then everything `_preload` brings in for `op`
    # before it confines itself.
    found = _loaded_after(
        f"""
        import control_plane.registry.mnn_worker as worker
        worker._preload({op!r})
        print(json.dumps(heavy()))
        """
    )
    assert "MNN" in found and "runtime._native._core" not in found


def test_every_public_name_resolves_from_the_module_that_defines_it():
    for name in runtime.__all__:
        value = getattr(runtime, name)
        defining = sys.modules[runtime._EXPORTS[name]]
        assert value is getattr(defining, name), name
    assert set(runtime.__all__) == set(runtime._EXPORTS)
    assert set(runtime.__all__) <= set(dir(runtime))
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        runtime.Nope  # noqa: B018 - the lookup is the test


def test_type_checkers_see_the_same_names_as_the_lazy_map():
    tree = ast.parse((REPO_ROOT / "runtime" / "__init__.py").read_text())
    guarded = next(node for node in tree.body if isinstance(node, ast.If))
    static = {
        alias.name: node.module
        for node in guarded.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert static == runtime._EXPORTS
