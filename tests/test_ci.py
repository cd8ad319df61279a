"""Only a true CI value makes a missing PostgreSQL or tool a failure."""

from __future__ import annotations

import pytest

from tests.ci import on_ci


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "yes", "Yes", " true "])
def test_true_values_mean_ci(value):
    assert on_ci({"CI": value}) is True


@pytest.mark.parametrize("value", ["false", "False", "0", "no", "", "off"])
def test_other_values_do_not(value):
    assert on_ci({"CI": value}) is False


def test_unset_is_not_ci():
    assert on_ci({}) is False
