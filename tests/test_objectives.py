import pytest
import torch

from zgcore.training.objectives import OBJECTIVES, ObjectiveContext, regression_loss


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


class _Reader:
    """A boundary source of random tensors that records whose per-channel scale was asked for."""

    def __init__(self, n=8, hidden=4):
        g = torch.Generator().manual_seed(0)
        self.data = {b: torch.randn(n, 3, hidden, generator=g) for b in (0, 2)}
        self.asked = []

    def n(self, split):
        return len(self.data[0])

    def widen(self, t):
        return t.float()

    def stats(self, b):
        self.asked.append(b)
        return torch.full((2, self.data[0].shape[-1]), 1.0 + b)

    def batches(self, split, b_in, b_out, order, bs, start=0):
        for k in range(start, (len(order) + bs - 1) // bs):
            idx = torch.as_tensor(order[k * bs: (k + 1) * bs])
            yield k, self.data[b_in][idx], self.data[b_out][idx]


def test_a_new_unanchored_objective_gets_the_input_scale_and_its_own_hash_rule(tmp_path):
    from zgcore.training.objectives import Objective, noise_like, register
    from zgcore.config.experiment import effective_train
    from zgcore.training.blocks import BlockTraining, train_block
    from zgcore.config.experiment import DEFAULTS

    @register
    class Reconstruct(Objective):  # unanchored, reads noise: rebuild the clean input from a noisy one
        name = "test_reconstruct"
        anchored = False
        reads = ("noise",)

        def make_pair(self, x, y, ctx):
            return x + noise_like(x, ctx), x

    @register
    class Identity(Objective):  # anchored, reads nothing
        name = "test_identity"

        def make_pair(self, x, y, ctx):
            return x, y

    try:
        t = {**DEFAULTS["train"], "max_steps": 2, "batch_size": 4, "checkpoint_every": 1}
        for name, want in (("test_reconstruct", 0), ("test_identity", 2), ("denoise", 0), ("clean", 2)):
            reader = _Reader()
            run = BlockTraining({**t, "objective": name}, 0, tmp_path / name, "h")
            train_block(torch.nn.Linear(4, 4), reader, 0, 2, run)
            assert reader.asked[0] == want, name  # the loss scale: input boundary 0 if unanchored, else output 2
        # hash: a setting the objective does not read never enters it; one it reads does
        eff = lambda name, **o: effective_train({**t, "objective": name, **o})
        assert "noise" in eff("test_reconstruct") and eff("test_reconstruct", noise=0.2) != eff("test_reconstruct")
        assert "noise" not in eff("test_identity") and eff("test_identity", noise=0.2) == eff("test_identity")
        assert eff("clean", noise=0.3) == eff("clean") and eff("noisy", noise=0.3) != eff("noisy")
    finally:
        OBJECTIVES.pop("test_reconstruct", None)
        OBJECTIVES.pop("test_identity", None)


def test_effective_train_drops_what_cannot_take_effect():
    from zgcore.config.experiment import DEFAULTS
    from zgcore.config.experiment import effective_train

    t = dict(DEFAULTS["train"])
    assert "epochs" in effective_train(t)  # max_steps = 0: epochs decide
    capped = {**t, "max_steps": 20}
    assert "epochs" not in effective_train(capped) and effective_train({**capped, "epochs": 1}) == effective_train(capped)
    assert effective_train({**t, "n_layers": 2}) == effective_train({**t, "n_layers": 2, "keep_fraction": 0.5})
    assert effective_train({**t, "checkpoint_every": 7}) == effective_train(t)
    assert effective_train({**t, "lr": 1e-4}) != effective_train(t)
