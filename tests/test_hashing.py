import pytest

from zgcore.hashing import canonical, canonical_json, config_hash


def test_key_order_and_int_float_do_not_change_hash():
    a = config_hash("TrainBlock", {"lr": 1, "nested": {"x": 2.0, "y": [1, 2]}}, ["abc"])
    b = config_hash("TrainBlock", {"nested": {"y": (1, 2), "x": 2}, "lr": 1.0}, ["abc"])
    assert a == b
    assert len(a) == 12


def test_any_change_moves_hash():
    base = config_hash("TrainBlock", {"lr": 1e-4}, ["u1"])
    assert config_hash("TrainBlock", {"lr": 2e-4}, ["u1"]) != base
    assert config_hash("TrainBlock", {"lr": 1e-4}, ["u2"]) != base
    assert config_hash("Assemble", {"lr": 1e-4}, ["u1"]) != base


def test_canonical_json_is_sorted_and_compact():
    assert canonical_json({"b": 1.0, "a": [2.5, True, None]}) == '{"a":[2.5,true,null],"b":1}'
    assert canonical(True) is True  # bools are not turned into ints


def test_nan_is_rejected():
    with pytest.raises(TypeError):
        canonical(float("nan"))


def test_results_are_written_in_the_same_canonical_form_with_non_finite_figures_as_null(tmp_path):
    import json
    import math

    import numpy as np

    from zgcore.atomic import write_json

    obj = {"ce": math.nan, "rows": [1.0, np.float32(2.5), (math.inf, -math.inf)], 3: np.int64(4), "p": tmp_path}
    assert canonical(obj, nonfinite="null") == {"ce": None, "rows": [1, 2.5, [None, None]], "3": 4, "p": str(tmp_path)}
    write_json(tmp_path / "r.json", obj)
    assert json.loads((tmp_path / "r.json").read_text()) == canonical(obj, nonfinite="null")
