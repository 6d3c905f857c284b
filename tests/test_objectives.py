import pytest
import torch

from zgcore.objectives import OBJECTIVES, ObjectiveContext, regression_loss


def test_loss_normalisations_by_hand():
    pred = torch.tensor([[[1.0, 0.0], [0.0, 0.0]]])      # [1, 2, 2]
    target = torch.tensor([[[3.0, 0.0], [0.0, 2.0]]])
    # plain MSE: errors (-2, 0, 0, -2) -> (4 + 4) / 4
    assert regression_loss(pred, target, "none").item() == pytest.approx(2.0)
    # token: token0 4/9, token1 4/4 -> mean 13/18
    assert regression_loss(pred, target, "token").item() == pytest.approx(13 / 18)
    # channel: position-0 scale (2, 1), later scale (1, 4): (-2/2)^2 + 0 + 0 + (-2/4)^2 = 1.25 -> /4
    scale = torch.tensor([[2.0, 1.0], [1.0, 4.0]])
    assert regression_loss(pred, target, "channel", scale).item() == pytest.approx(1.25 / 4)


def test_channel_norm_is_not_dominated_by_the_sink_position():
    target = torch.ones(1, 4, 3)
    target[:, 0] = 100.0  # a massive activation at position 0
    scale = torch.tensor([[100.0] * 3, [1.0] * 3])
    off_sink = target.clone()
    off_sink[:, 1:] += 1.0  # unit error everywhere but the sink
    on_sink = target.clone()
    on_sink[:, 0] += 1.0  # the same unit error on the sink only
    assert regression_loss(off_sink, target, "none") > regression_loss(on_sink, target, "none") / 10
    assert regression_loss(off_sink, target, "channel", scale) > 100 * regression_loss(on_sink, target, "channel", scale)


def test_objectives_pairs():
    x, y = torch.randn(2, 5, 3), torch.randn(2, 5, 3)
    ctx = lambda: ObjectiveContext(torch.Generator().manual_seed(0), 0.5, torch.ones(2, 3))
    inp, tgt = OBJECTIVES["clean"](x, y, ctx())
    assert inp is x and tgt is y
    inp, tgt = OBJECTIVES["noisy"](x, y, ctx())
    assert tgt is y and not torch.equal(inp, x)
    assert (inp - x).std().item() == pytest.approx(0.5, rel=0.3)
    inp2, tgt2 = OBJECTIVES["denoise"](x, y, ctx())
    assert torch.equal(inp2, inp) and tgt2 is x  # same generator seed -> same noise; target is the clean input
