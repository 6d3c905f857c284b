import math

import pytest

from zgcore.markdown import num, table


def test_num_formats_finite_missing_and_non_finite():
    assert num(3.14159) == "3.1416"
    assert num(0.931, ".1%") == "93.1%"
    assert num(None) == "—"
    assert num(float("nan")) == "NaN (not finite)"
    assert num(math.inf, "+.3f") == "inf (not finite)"
    assert num(-math.inf) == "-inf (not finite)"
    assert num("PASS") == "PASS"


def test_table_builds_rows_and_refuses_ragged_rows():
    assert table(["a", "b"], [[1, "x|y"]]) == "| a | b |\n|---|---|\n| 1 | x\\|y |"
    with pytest.raises(ValueError, match="row 0 has 1 cells"):
        table(["a", "b"], [[1]])
