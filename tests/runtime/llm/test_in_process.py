"""MNN-LLM loaded in the test process: `in_process_real_model.py`, in a pytest of its own.

See `tests/llm_bundles.run_in_own_pytest` for why.
"""

from __future__ import annotations

from pathlib import Path

from tests.llm_bundles import run_in_own_pytest


def test_the_session_in_process(tmp_path_factory):
    run_in_own_pytest(Path(__file__).with_name("in_process_real_model.py"), tmp_path_factory)
