import numpy as np
import pytest
import torch

from zgcore.evaluation import metrics
from zgcore.models.teacher import load, materialise


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model, _ = load(materialise("tiny-llama", outputs=tmp_path_factory.mktemp("t")))
    return model


def test_context_use_is_zero_for_a_model_blind_to_context(tiny):
    blind = type(tiny)(tiny.config)
    blind.load_state_dict(tiny.state_dict())
    for layer in blind.model.layers:  # no attention output: each position sees only its own token
        torch.nn.init.zeros_(layer.self_attn.o_proj.weight)
    tokens = np.random.default_rng(0).integers(0, 256, (2, 16))
    r = metrics.context_use(blind.eval(), tokens, window=4)
    assert r["context_use"] == pytest.approx(0.0, abs=1e-5)
    assert r["full"] > 0


def test_context_use_bookkeeping_and_window_bound(tiny):
    tokens = np.random.default_rng(1).integers(0, 256, (1, 16))
    r = metrics.context_use(tiny, tokens, window=8)
    assert r["context_use"] == pytest.approx(r["window"] - r["full"])
    with pytest.raises(ValueError, match="context window"):
        metrics.context_use(tiny, tokens, window=9)


def test_cross_entropy_matches_hf_loss(tiny):
    tokens = np.random.default_rng(2).integers(0, 256, (3, 12))
    ids = torch.as_tensor(tokens)
    with torch.no_grad():
        ref = tiny(input_ids=ids, labels=ids).loss.item()
    assert metrics.cross_entropy(tiny, tokens, batch_size=2) == pytest.approx(ref, rel=1e-5)
