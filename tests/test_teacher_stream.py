"""The layer-streamed teacher (zgcore.models.teacher_stream) gives the whole teacher's bytes: the
boundary store, the per-sequence scores and context use, the top-k logit store, online targets and
healing's logits and hidden states, on tiny Llama, Qwen2 and Gemma2 teachers; each layer is read
once per shard; a layer larger than the free memory fails before any work."""
from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch

from zgcore.checks import ConfigError
from zgcore.data import boundary_store, logit_store
from zgcore.evaluation import flops, metrics
from zgcore.models import teacher_stream
from zgcore.models.teacher import build_tiny, load
from zgcore.models.teacher_stream import StreamedTeacher, plan, teacher_for
from zgcore.models.teacher_weights import load_base

FAMILIES = ("llama", "qwen2", "gemma2")
LAYERS = 4


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
    root = tmp_path_factory.mktemp("teachers")
    return {f: {"path": str(build_tiny(f, root / f, seed=1, n_layers=LAYERS)), "gguf_file": None, "n_layers": LAYERS,
                "hidden_size": 32} for f in FAMILIES}


def _rows(n=6, t=16, seed=0):
    return np.random.default_rng(seed).integers(0, 256, size=(n, t)).astype(np.int32)


def _h5(folder, name):
    with h5py.File(folder / name) as f:
        return {k: f[k][()].tobytes() for k in f}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_streamed_boundary_shard_is_the_whole_teacher_s_bytes_reading_each_layer_once(teachers, tmp_path, family, dtype):
    rec, rows, bs = teachers[family], _rows(), [0, 1, 3, 4]
    extra = {"teacher_dtype": dtype}
    (tmp_path / "whole").mkdir()
    (tmp_path / "stream").mkdir()
    a = boundary_store.write_shard(tmp_path / "whole", load_base(rec, 4, dtype), rows, "train", 0, bs, "float32", 2, extra)
    st = StreamedTeacher(rec, 4, dtype)
    st.precompute([torch.from_numpy(r[None].astype(np.int64)) for r in rows], bs, lazy=True)
    assert st.layer_reads == 0  # lazy: nothing read before the writer's first batch
    b = boundary_store.write_shard(tmp_path / "stream", st, rows, "train", 0, bs, "float32", 2, extra)
    assert st.layer_reads == LAYERS  # each layer read once for the whole shard
    for name in (f"b{x}.h5" for x in bs):
        assert _h5(tmp_path / "whole", name) == _h5(tmp_path / "stream", name)
    assert {k: v["sha256"] for k, v in a["files"].items()} == {k: v["sha256"] for k, v in b["files"].items()}
    assert flops.decoder_parameters(st) == flops.decoder_parameters(load_base(rec, 4, dtype))


@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_scores_and_context_use_are_the_whole_teacher_s(teachers, family):
    rec, tokens = teachers[family], _rows(7, 16, 1)
    whole = load(rec)[0]
    ce_w = metrics.sequence_cross_entropy(whole, tokens, 3)
    cu_w = metrics.context_use(whole, tokens[:2], 4)
    st = StreamedTeacher(rec, head=True)
    st.precompute(metrics.scoring_batches(tokens, 3, 2, 4), head=True)
    assert st.layer_reads == LAYERS
    ce_s, cu_s = metrics.sequence_cross_entropy(st, tokens, 3), metrics.context_use(st, tokens[:2], 4)
    assert st.layer_reads == LAYERS  # every batch was planned: no layer read again
    assert ce_s.tobytes() == ce_w.tobytes() and cu_s == cu_w
    assert flops.model_parameters(st) == flops.model_parameters(whole)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_streamed_top_k_store_online_targets_and_heal_s_teacher_are_the_whole_teacher_s(teachers, tmp_path, family):
    rec, rows = teachers[family], _rows(4, 16, 2)
    whole = load(rec)[0]
    (tmp_path / "w").mkdir()
    (tmp_path / "s").mkdir()
    logit_store.write_logit_shard(tmp_path / "w", whole, rows, "train", 0, 5, 2.0, 2, {})
    st = StreamedTeacher(rec, head=True)
    st.precompute([torch.from_numpy(r[None].astype(np.int64)) for r in rows], head=True, lazy=True)
    logit_store.write_logit_shard(tmp_path / "s", st, rows, "train", 0, 5, 2.0, 2, {})
    assert _h5(tmp_path / "w", "b0.h5") == _h5(tmp_path / "s", "b0.h5") and st.layer_reads == LAYERS
    ids = torch.from_numpy(rows.astype(np.int64))  # heal online: a batch as given, logits and hidden states
    ow, os_ = whole(input_ids=ids, use_cache=False, output_hidden_states=True), st(input_ids=ids, output_hidden_states=True)
    assert torch.equal(ow.logits, os_.logits)
    assert all(torch.equal(x, y) for x, y in zip(ow.hidden_states, os_.hidden_states, strict=True))
    assert torch.equal(logit_store.online_targets(whole, ids, 5, 2.0), logit_store.online_targets(st, ids, 5, 2.0))
    # online boundary targets (TrainBlock, ScoreBlock): statistics and every batch the same bits
    sw = boundary_store.OnlineBoundaries(load_base(rec, 3), rows, [1, 3], "bfloat16", 2)
    ss = boundary_store.OnlineBoundaries(StreamedTeacher(rec, 3), rows, [1, 3], "bfloat16", 2)
    assert all(torch.equal(sw.stats(b), ss.stats(b)) for b in (1, 3))
    for (_, a_in, a_out), (_, b_in, b_out) in zip(sw.batches("train", 1, 3, np.array([3, 0, 2]), 2),
                                                  ss.batches("train", 1, 3, np.array([3, 0, 2]), 2), strict=True):
        assert torch.equal(a_in, b_in) and torch.equal(a_out, b_out)


def test_teacher_stream_picks_the_path_and_a_layer_larger_than_free_memory_fails_first(teachers, monkeypatch):
    rec = teachers["llama"]
    layer = 4 * (2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 64 + 2 * 32)  # q, o 32x32; k, v 32x16; three MLP matrices; two norms
    assert layer == 4 * StreamedTeacher(rec).src.layer_numel(0)
    big = 10 * 2**30
    assert plan(rec, 4, "float32", "cpu", True, setting="auto", free=big) is False
    assert plan(rec, 4, "float32", "cpu", True, setting="true", free=big) is True
    assert plan(rec, 4, "float32", "cpu", True, setting="false", free=1) is False  # today's path, unchecked
    other = 4 * 260 * 32 + 4 * 32  # the tied embedding and the final norm
    assert plan(rec, 4, "float32", "cpu", True, setting="auto", free=4 * layer + other - 1) is True  # does not fit whole
    with pytest.raises(ConfigError, match=r"teacher layer 0 needs 0\.00 GiB in float32 .* more than the 0\.00 GiB free "
                                          r"on cpu even streamed layer by layer") as e:
        plan(rec, 4, "float32", "cpu", True, setting="auto", free=layer + other - 1)
    assert "\n" not in str(e.value)
    # the task's way in: the setting from the environment, the error before any weight is read
    monkeypatch.setenv(teacher_stream.ENV, "true")
    monkeypatch.setattr(teacher_stream, "free_memory", lambda device: layer // 2)
    read = []
    monkeypatch.setattr(StreamedTeacher, "layer", lambda self, i: read.append(i))
    with pytest.raises(ConfigError, match="teacher layer"):
        teacher_for(rec, 4, "float32", "cpu", head=False)
    assert read == []
    monkeypatch.setattr(teacher_stream, "free_memory", lambda device: big)
    assert isinstance(teacher_for(rec, 4, "float32", "cpu"), StreamedTeacher)
    monkeypatch.setenv(teacher_stream.ENV, "auto")
    assert not isinstance(teacher_for(rec, 4, "float32", "cpu"), StreamedTeacher)


def test_teacher_stream_true_needs_safetensors(tmp_path):
    with pytest.raises(ConfigError, match="teacher_stream = true needs the teacher's weights as local safetensors"):
        plan({"path": str(tmp_path), "gguf_file": None}, 4, "float32", "cpu", False, setting="true")


def test_after_a_one_block_change_no_task_runs_the_teacher_and_the_shift_is_the_teacher_s(tmp_path, run_graph,
                                                                                         monkeypatch):
    import json

    from tasks.blocks import load_blocks
    from tasks.teacher import teacher_record
    from workflows import RunExperiment, build_experiment, load_config
    from zgcore.data import corpus
    from zgcore.models import teacher as zteacher
    from zgcore.models import teacher_weights
    from zgcore.models.adapters import adapter_for

    out = str(tmp_path)
    ok, _ = run_graph(RunExperiment(preset="tiny", outputs=out))
    assert ok
    forwards = []  # every teacher forward from here: the loaded teacher's base model, or a streamed run

    def counted(m):
        adapter_for(m).base_model(m).register_forward_pre_hook(lambda *_: forwards.append(type(m).__name__))
        return m

    load, base, run = zteacher.load, teacher_weights.load_base, StreamedTeacher.run

    def counted_load(*a, **k):
        model, tok = load(*a, **k)
        return counted(model), tok

    monkeypatch.setattr(zteacher, "load", counted_load)
    monkeypatch.setattr(teacher_weights, "load_base", lambda *a, **k: counted(base(*a, **k)))
    monkeypatch.setattr(StreamedTeacher, "run", lambda self, *a, **k: forwards.append("streamed") or run(self, *a, **k))
    ok, ran = run_graph(RunExperiment(preset="tiny", set="blocks.1.lr=5e-4", outputs=out))
    assert ok and {"TrainBlock", "Assemble", "ScoreAssembled", "BoundaryShift", "Evaluate"} <= {f for f, _ in ran}
    assert forwards == []
    from zgcore.models.adapters import capture_boundaries

    rec = teacher_record(build_experiment(load_config("", "", "tiny"), out).requires()["shift"].teacher_task())
    ids = torch.zeros((1, 8), dtype=torch.long)
    for setting in ("false", "true"):  # the count sees the teacher run either way
        capture_boundaries(teacher_for(rec, 2, setting=setting), ids, [2])
    assert forwards == ["LlamaModel", "streamed"]
    monkeypatch.undo()
    # the boundary shift read from the store is the one the teacher's forward gives
    shift_task = build_experiment(load_config("", "blocks.1.lr=5e-4", "tiny"), out).requires()["shift"]
    rec = teacher_record(shift_task.teacher_task())
    blocks = [json.loads((t.out_dir / "metrics.json").read_text()) for t in shift_task.block_tasks()]
    bounds = [b["start"] for b in blocks] + [blocks[-1]["end"]]
    val = corpus.read_tokens(shift_task.requires()["corpus"].out_dir / "tokens.h5", "val")
    e = shift_task.eval
    rows = val[metrics.eval_subset(len(val), int(e["max_sequences"]), int(e["subset_seed"]))][: int(e["context_sequences"])]
    trained = load_blocks(load(rec)[0], shift_task.block_tasks())
    want = metrics.boundary_shift(load(rec)[0], trained, bounds, rows)
    assert json.loads((shift_task.out_dir / "shift.json").read_text()) == json.loads(json.dumps(want))


def test_a_streamed_student_s_sample_is_greedy_generation_s(teachers):
    from tasks.score_student import _greedy

    rec, ids = teachers["qwen2"], torch.tensor([[84, 104]])
    want = load(rec)[0].generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(_greedy(StreamedTeacher(rec, head=True), ids, 6), want)
