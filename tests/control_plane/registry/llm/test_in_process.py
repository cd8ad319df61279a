"""The converter and MNN-LLM run in the test process: each `in_process_*.py` module here,
in a pytest of its own (see `tests/llm_bundles.run_in_own_pytest` for why).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.llm_bundles import run_in_own_pytest

HERE = Path(__file__).parent


@pytest.mark.parametrize("module", ["convert_tiny", "convert_real", "convert_gemma3"])
def test_the_converter_in_process(module, tmp_path_factory):
    run_in_own_pytest(HERE / f"in_process_{module}.py", tmp_path_factory)
