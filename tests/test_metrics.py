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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_sequence_ce_is_bitwise_the_ce_of_the_sliced_logits(tiny, dtype):
    """The per-sequence CE is taken over every position's logits with the last one ignored (no copy
    of the logits): bitwise what the CE of the logits with the last position sliced off gives."""
    import torch.nn.functional as F

    tokens = np.random.default_rng(3).integers(0, 256, (5, 24))
    with torch.no_grad():
        def logits_of(ids):
            return [tiny(input_ids=ids, use_cache=False).logits.to(dtype)]
        got = metrics.sequence_cross_entropies(logits_of, tokens, 2, "cpu")[0]
        want = []
        for lo in range(0, len(tokens), 2):
            ids = torch.as_tensor(tokens[lo: lo + 2], dtype=torch.long)
            lg = logits_of(ids)[0][:, :-1].float()
            ce = F.cross_entropy(lg.reshape(-1, lg.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
            want.append(ce.reshape(ids.shape[0], -1).double().mean(dim=1).numpy())
    assert got.dtype == np.float64 and got.shape == (5,)
    assert got.tobytes() == np.concatenate(want).tobytes()
