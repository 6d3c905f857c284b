"""The learning-rate search (zgcore.training.lr_search) on hand-made score curves."""
import math

import pytest

from zgcore.training import lr_search as ls


def bowl(opt):
    """A loss unimodal in log lr with its minimum at ``opt``; diverges (None) above 100 x opt."""
    return lambda lr: None if lr > 100 * opt else (math.log(lr / opt)) ** 2


def test_refines_between_grid_points_to_within_a_factor_two():
    # the case: the optimum (5e-3) lies between grid points 3e-3 and 1e-2
    res, rounds = ls.search(bowl(5e-3), [1e-3, 3e-3, 1e-2, 3e-2], rounds=6)
    s = ls.summary(res, rounds, 6)
    assert s["converged"] and not s["at_edge"]
    i = s["lrs"].index(s["best_lr"])
    assert s["lrs"][i] / s["lrs"][i - 1] <= 2 and s["lrs"][i + 1] / s["lrs"][i] <= 2
    assert 5e-3 / 2 ** 0.5 <= s["best_lr"] <= 5e-3 * 2 ** 0.5  # within the final bracket's half-width
    assert s["best_lr"] not in (1e-3, 3e-3, 1e-2, 3e-2)  # a point no grid value was


@pytest.mark.parametrize("opt", [2e-5, 7.0])
def test_extends_past_either_edge_until_the_best_is_interior(opt):
    grid = [1e-3, 3e-3, 1e-2]
    res, rounds = ls.search(bowl(opt), grid, rounds=20)
    s = ls.summary(res, rounds, 20)
    assert s["converged"] and not s["at_edge"] and s["best_lr"] not in grid
    assert opt / 2 ** 0.5 <= s["best_lr"] <= opt * 2 ** 0.5


def test_one_round_steps_and_midpoints():
    # best at the low edge: one step below at the grid's spacing (3x), and the midpoint above (3x > 2x)
    assert ls.next_lrs({1e-3: 1.0, 3e-3: 2.0, 1e-2: 3.0}) == [3.33e-4, 1.73e-3]
    # interior with neighbours 3x away: both midpoints
    assert ls.next_lrs({1e-3: 2.0, 3e-3: 1.0, 1e-2: 3.0}) == [1.73e-3, 5.48e-3]
    # a step past an edge is at least 2x and at most 4x
    assert ls.next_lrs({1e-3: 1.0, 1.5e-3: 2.0}) == [5e-4]  # 1.5x above: no midpoint
    assert ls.next_lrs({1e-3: 1.0, 1e9: None}) == [2.5e-4, 4e-3]  # a far neighbour: 4x towards it
    assert ls.next_lrs({1e-3: 1.0}) == [2.5e-4, 4e-3]
    # converged: interior, neighbours within 2x (a diverged neighbour bounds the search too)
    assert ls.next_lrs({1e-3: 2.0, 2e-3: 1.0, 4e-3: None}) == []
    assert ls.next_lrs({1e-3: None, 2e-3: None}) == []  # nothing finite: the caller fails


def test_diverged_candidates_lose_are_listed_and_all_diverged_fails():
    s = ls.summary({1e-3: 4.0, 1e9: float("nan")}, 1, 1, diverged={1e9: {"step": 0, "what": "the loss"}})
    assert s["best_lr"] == 1e-3 and s["scores"] == [4.0, None] and s["at_edge"] and not s["converged"]
    assert s["diverged"] == [{"lr": 1e9, "step": 0, "what": "the loss"}]
    assert "lowest lr searched" in ls.edge_note(s)
    with pytest.raises(ValueError, match="every learning rate .* diverged"):
        ls.summary({1e-3: None, 1e9: None}, 1, 1)
    assert ls.choose_lr([1e-3, 3e-3], [3.5, 3.5]) == 1e-3  # a tie goes to the smaller lr


def test_the_rounds_bound_stops_the_search():
    res, rounds = ls.search(lambda lr: math.log(lr / 1e-7) ** 2, [1e-3, 1e-2], rounds=2)
    s = ls.summary(res, rounds, 2)
    assert rounds == 2 and sorted(res) == [2.5e-4, 1e-3, 3.16e-3, 1e-2] and s["at_edge"] and not s["converged"]


@pytest.mark.parametrize("bad", [{}, {0.0: 1.0}, {-1e-3: 1.0}, {float("inf"): 1.0}])
def test_bad_learning_rates_raise(bad):
    with pytest.raises(ValueError):
        ls.next_lrs(bad)


def test_numpy_scores_count_as_finite_and_bools_and_nan_do_not():
    import numpy as np

    from zgcore.training.lr_search import _finite

    assert _finite(np.float32(1.0)) and _finite(np.float64(2.5)) and _finite(3) and _finite(np.int64(4))
    assert not any(_finite(x) for x in (None, True, float("nan"), np.float32("inf"), "1.0"))
