"""Each supported family on a tiny random model built from a config (no download)."""
import pytest
import torch

from zgcore.models.adapters import assemble, build_block, capture_boundaries, head_logits
from zgcore.models.teacher import TINY_FAMILIES, load, materialise

FAMILIES = list(TINY_FAMILIES.values())


@pytest.fixture(scope="module", params=FAMILIES)
def teacher(request, tmp_path_factory):
    rec = materialise(f"tiny-{request.param}", outputs=tmp_path_factory.mktemp(request.param))
    model, tok = load(rec)
    return model


def test_boundaries_are_the_raw_residual_stream(teacher):
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    bd = capture_boundaries(teacher, ids, [0, 1, 3, 4])
    hs = teacher(ids, output_hidden_states=True).hidden_states
    for b in (0, 1, 3):
        assert torch.equal(bd[b], hs[b])
    # HF's last hidden state has the final norm applied; ours is the raw stream before it
    assert not torch.allclose(bd[4], hs[4])
    assert torch.allclose(head_logits(teacher, bd[4]), teacher(ids).logits, atol=1e-5)


def test_block_with_all_layers_reproduces_next_boundary(teacher):
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    bd = capture_boundaries(teacher, ids, [0, 2, 4])
    with torch.no_grad():
        assert torch.allclose(build_block(teacher, [0, 1], "teacher", 0)(bd[0]), bd[2], atol=1e-5)
        assert torch.allclose(build_block(teacher, [2, 3], "teacher", 0)(bd[2]), bd[4], atol=1e-5)


def test_assembled_full_student_equals_teacher_and_partial_has_fewer_layers(teacher):
    ids = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(2))
    full = assemble(teacher, [build_block(teacher, [0, 1], "teacher", 0), build_block(teacher, [2, 3], "teacher", 0)])
    with torch.no_grad():
        assert torch.allclose(full(ids).logits, teacher(ids).logits, atol=1e-5)
    part = assemble(teacher, [build_block(teacher, [0], "teacher", 0), build_block(teacher, [3], "teacher", 0)])
    assert len(list(part.parameters())) < len(list(teacher.parameters()))
    with torch.no_grad():
        assert part(ids).logits.shape == teacher(ids).logits.shape


def test_random_init_differs_by_seed(teacher):
    a = build_block(teacher, [0], "random", 1).layer_state_dict()
    b = build_block(teacher, [0], "random", 2).layer_state_dict()
    c = build_block(teacher, [0], "random", 1).layer_state_dict()
    assert any(not torch.equal(a[k], b[k]) for k in a)
    assert all(torch.equal(a[k], c[k]) for k in a)


@pytest.fixture(scope="module")
def load_tiny(tmp_path_factory):
    def get(family):
        return load(materialise(f"tiny-{family}", outputs=tmp_path_factory.mktemp(family)))[0]
    return get


def test_gemma2_boundary0_is_the_scaled_embedding_and_head_soft_caps(load_tiny):
    gemma = load_tiny("gemma2")
    assert gemma.config._attn_implementation == "eager"  # SDPA cannot soft-cap attention scores
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3))
    bd = capture_boundaries(gemma, ids, [0, 4])
    raw = gemma.model.embed_tokens.weight[ids]
    assert torch.allclose(bd[0], raw * 32 ** 0.5, rtol=1e-6)  # what layer 0 receives: scaled by sqrt(hidden)
    uncapped = gemma.lm_head(gemma.model.norm(bd[4]))
    assert uncapped.abs().max() > 2.0  # soft-capping at 2.0 changes the logits a lot
    capped = head_logits(gemma, bd[4])
    assert capped.abs().max() < 2.0 and torch.allclose(capped, gemma(ids).logits, atol=1e-5)


def test_granite_multipliers_stay_where_they_act(load_tiny):
    granite = load_tiny("granite")
    ids = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(4))
    bd = capture_boundaries(granite, ids, [0, 4])
    assert torch.allclose(bd[0], granite.model.embed_tokens.weight[ids] * 4.0)  # embedding_multiplier in boundary 0
    block = build_block(granite, [0, 1, 2, 3], "teacher", 0)
    assert block.body.config.embedding_multiplier == 1.0  # ... and not applied twice by the block
    with torch.no_grad():
        assert torch.allclose(block(bd[0]), bd[4], atol=1e-5)
    assert torch.allclose(head_logits(granite, bd[4]) * 3.0, granite.lm_head(granite.model.norm(bd[4])), atol=1e-5)


def test_dropped_layers_keep_their_layer_types(load_tiny):
    gemma = load_tiny("gemma3")
    block = build_block(gemma, [1, 2], "teacher", 0)
    assert block.body.config.layer_types == ["full_attention", "sliding_attention"]
    student = assemble(gemma, [build_block(gemma, [0], "teacher", 0), block])
    assert student.config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    assert [layer.self_attn.is_sliding for layer in student.model.layers] == [True, False, True]


def test_unsupported_architecture_names_it_and_lists_supported():
    from transformers import BertConfig

    from zgcore.models.adapters import adapter_for
    from zgcore.checks import ConfigError

    with pytest.raises(ConfigError, match=r"unsupported architecture 'bert'; supported: llama, .*gemma2.*granite.*gpt2"):
        adapter_for(BertConfig())
