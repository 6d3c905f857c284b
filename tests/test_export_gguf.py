"""GGUF export checked by llama.cpp itself (docs/export.md): on the tiny experiment, the
uniform student (llama architecture) and a heterogeneous one (deci architecture: a narrower MLP
and one key-value head in block 0, no attention in block 1) load in llama-cpp-python; their
held-out CE from llama.cpp's logits on the validation sequences matches the Hugging Face student's
within 1e-3 nats/token at f32, and 32 greedy tokens from a fixed prompt match token for token. A
mixer llama.cpp cannot run fails in one line when the graph is built.

llama-cpp-python is part of the test extra (README's test command builds it from the sdist): where it
is missing these tests fail, saying how to install it, and never skip."""
from __future__ import annotations

import json

import luigi
import numpy as np
import pytest
import torch

import workflows
from tasks.export import GGUF, RECORD, ExportGGUF
from workflows.experiment import block_settings, load_config
from zgcore.data import corpus
from zgcore.models import gguf_export

PROMPT = "The"
NEW = 32


def llama_cpp():
    try:
        import llama_cpp as mod
    except ImportError:
        pytest.fail(f"llama-cpp-python is not installed; these tests need it: {gguf_export.INSTALL}")
    return mod


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The tiny experiment's uniform student exported at f32 and q4_k_m, and a heterogeneous one at f32."""
    llama_cpp()
    out = str(tmp_path_factory.mktemp("export"))
    uniform = workflows.ExportStudent(preset="tiny", outputs=out).export
    quant = workflows.ExportStudent(preset="tiny", quant="q4_k_m", outputs=out).export
    cfg = load_config(preset="tiny")
    blocks = block_settings(cfg)
    blocks[0].update(intermediate_size=32, kv_heads=1)  # layer 0: half the MLP, one of two kv heads
    blocks[1].update(mixer="none")  # layer 1: no attention sub-layer
    hetero = ExportGGUF(teacher=cfg["teacher"], corpus=cfg["corpus"], boundary=cfg["boundary"], blocks=blocks,
                        exact=True, outputs=out)
    assert luigi.build([uniform, quant, hetero], local_scheduler=True, log_level="WARNING")
    return {"uniform": uniform, "q4_k_m": quant, "hetero": hetero, "cfg": cfg}


def load_gguf(path, n_ctx: int):
    """llama.cpp on ``path``: every position's logits kept, one thread, the KV cache in float32 (its default,
    float16, rounds keys and values: the f32 comparison is of the model, not of the cache's precision)."""
    cpp = llama_cpp()
    return cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_threads=1, logits_all=True, verbose=False,
                     type_k=cpp.GGML_TYPE_F32, type_v=cpp.GGML_TYPE_F32)


def llama_logits(llm, ids) -> np.ndarray:
    """llama.cpp's logits ``[len(ids), vocab]`` (float64) of one sequence from position 0."""
    llm.reset()
    llm.eval([int(i) for i in ids])
    return np.asarray(llm.scores[: len(ids)], dtype=np.float64)


def ce(logits: np.ndarray, ids) -> np.ndarray:
    """Per-token next-token cross-entropy (nats) of ``logits`` ``[T, V]`` on ``ids`` ``[T]``."""
    z = logits[:-1] - logits[:-1].max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return -logp[np.arange(len(ids) - 1), np.asarray(ids[1:])]


def hf_model(task):
    from transformers import AutoModelForCausalLM

    folder = task.requires()["student"].out_dir / "model"
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, trust_remote_code=True).eval()


def val_sequences(task) -> np.ndarray:
    """The experiment's validation sequences ``[n, seq_len]`` (token ids)."""
    from tasks.teacher import PrepareCorpus

    folder = PrepareCorpus(teacher=task.teacher, corpus=task.corpus, outputs=task.outputs).out_dir
    return corpus.read_tokens(folder / "tokens.h5", "val")


def greedy_llama(llm, ids: list[int], n: int) -> list[int]:
    llm.reset()
    llm.eval(ids)
    out = []
    for _ in range(n):
        nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(nxt)
        llm.eval([nxt])
    return out


@pytest.mark.parametrize("kind,arch", [("uniform", "llama"), ("hetero", "deci")])
def test_an_exported_student_in_llama_cpp_scores_and_generates_as_the_hf_student(built, kind, arch):
    task = built[kind]
    rec = json.loads((task.out_dir / RECORD).read_text())
    assert rec["arch"] == arch and rec["quant"] == "f32"
    if kind == "hetero":
        assert rec["widths"] == [32, 64] and rec["kv_heads"] == [1, 0] and rec["heads"] == [4, 0]
    model = hf_model(task)
    val = val_sequences(task)
    assert len(val) >= 4
    llm = load_gguf(task.out_dir / GGUF, 2 * val.shape[1] + NEW)
    ours, theirs, worst = [], [], 0.0
    with torch.no_grad():
        for ids in val:
            hf = model(torch.as_tensor(ids[None], dtype=torch.long)).logits[0].double().numpy()
            cpp = llama_logits(llm, ids)
            worst = max(worst, float(np.abs(hf - cpp).max()))
            ours.append(ce(hf, ids))
            theirs.append(ce(cpp, ids))
    hf_ce, cpp_ce = float(np.concatenate(ours).mean()), float(np.concatenate(theirs).mean())
    assert np.isfinite(hf_ce) and abs(hf_ce - cpp_ce) < 1e-3, (hf_ce, cpp_ce)
    # a tiny random model's CE is near log(vocab) for any small error: every logit is compared too (measured: 2e-7)
    assert worst < 1e-3, worst
    prompt = [int(i) for i in val[0][:8]]
    with torch.no_grad():
        hf_out = model.generate(torch.as_tensor([prompt]), max_new_tokens=NEW, do_sample=False)[0, len(prompt) :]
    assert greedy_llama(llm, prompt, NEW) == hf_out.tolist()


def test_a_q4_k_m_export_is_smaller_and_llama_cpp_generates_from_it(built):
    small, full = built["q4_k_m"], built["uniform"]
    rec = json.loads((small.out_dir / RECORD).read_text())
    assert rec["quant"] == "q4_k_m" and rec["bytes"] < (full.out_dir / GGUF).stat().st_size
    from gguf import GGUFReader

    types = {t.tensor_type.name for t in GGUFReader(str(small.out_dir / GGUF)).tensors}
    assert types - {"F32"}, types  # llama.cpp's quantizer changed the matrices
    llm = load_gguf(small.out_dir / GGUF, 64)
    out = greedy_llama(llm, [1, 2, 3, 4], 8)
    assert len(out) == 8 and all(0 <= t < 260 for t in out)


@pytest.mark.parametrize("mixer", ["linear", "window", "linear_window"])
def test_a_mixer_llama_cpp_cannot_run_fails_in_one_line_at_graph_build(mixer):
    with pytest.raises(gguf_export.ExportError) as e:
        workflows.ExportStudent(preset="tiny", set=f"blocks.1.mixer={mixer}", outputs="/nonexistent")
    msg = str(e.value)
    assert len(msg.splitlines()) == 1 and f"blocks.1.mixer={mixer!r}" in msg and "softmax, none" in msg


def test_no_attention_in_the_first_block_and_an_unknown_quant_fail_in_one_line():
    with pytest.raises(gguf_export.ExportError, match="first block"):
        workflows.ExportStudent(preset="tiny", set="blocks.0.mixer=none", outputs="/nonexistent")
    with pytest.raises(gguf_export.ExportError, match="choose one of f32, f16, q8_0, q4_k_m"):
        workflows.ExportStudent(preset="tiny", quant="q3", outputs="/nonexistent")


def test_a_library_pick_not_chosen_yet_names_the_command_that_chooses_it(tmp_path):
    with pytest.raises(gguf_export.ConfigError) as e:
        workflows.ExportStudent(preset="library_tiny", outputs=str(tmp_path))
    assert len(str(e.value).splitlines()) == 1 and "SelectStudent --local-scheduler" in str(e.value)
    with pytest.raises(gguf_export.ConfigError, match="--budget 9: the library has"):
        workflows.ExportStudent(preset="library_tiny", budget=9, outputs=str(tmp_path))
