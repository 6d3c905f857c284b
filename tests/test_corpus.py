"""Corpus sources (text, JSONL, Parquet, save_to_disk, python-stdlib), skipping unusable files in a
glob, and streaming tokenisation that writes the same store as tokenising everything at once."""
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import tiny_cfg
from workflows import RunExperiment
from workflows.experiment import build_experiment, load_config
from zgcore.data import corpus
from zgcore.checks import ConfigError
from zgcore.config.experiment import DEFAULTS
from zgcore.models.teacher import byte_tokenizer
from zgcore.data.sources import stdlib_files

TEXT = [f"Document {i}: " + "the residual stream carries every layer's update. " * (3 + i % 5) for i in range(40)]


def _parquet(path, texts, column="text"):
    pq.write_table(pa.table({column: texts, "id": list(range(len(texts)))}), path)
    return path


def _docs_to_fill(texts, n_tokens=2048):
    """Documents the byte tokenizer reads before ``n_tokens`` (each text's bytes plus EOS)."""
    total = np.cumsum([len(t.encode()) + 1 for t in texts])
    return int(np.searchsorted(total, n_tokens) + 1)


def _meta(ev):
    return json.loads((ev.requires()["corpus"].out_dir / "meta.json").read_text())


def _run(source, tmp_path, run_graph, **over):
    out = str(tmp_path / "out")
    cfg = tiny_cfg(**{"corpus.source": source, "corpus.max_tokens": 2048, "train.max_steps": 2, **over})
    ok, _ = run_graph(RunExperiment(preset="", set=cfg, outputs=out))
    assert ok
    return build_experiment(load_config(overrides=cfg, preset=""), out)


def test_parquet_corpus_runs_the_graph(tmp_path, run_graph):
    ev = _run(str(_parquet(tmp_path / "c.parquet", TEXT, "body")), tmp_path, run_graph, **{"corpus.text_field": "body"})
    m = _meta(ev)
    assert m["documents"] == _docs_to_fill(TEXT) and m["source_files"] == 1 and m["skipped_files"] == 0
    report = json.loads((ev.out_dir / "report.json").read_text())
    assert report["val_sequences"] == m["n_val"] > 0


def test_saved_dataset_corpus_runs_the_graph(tmp_path, run_graph):
    import datasets

    datasets.Dataset.from_dict({"text": TEXT}).save_to_disk(str(tmp_path / "ds"))
    m = _meta(_run(str(tmp_path / "ds"), tmp_path, run_graph))
    assert m["documents"] == _docs_to_fill(TEXT) and m["tokens"] == (m["n_train"] + m["n_val"]) * 32


def test_python_stdlib_corpus_runs_the_graph(tmp_path, run_graph):
    m = _meta(_run("python-stdlib", tmp_path, run_graph))
    stream = []
    for f in stdlib_files():  # byte tokenizer: each file's UTF-8 bytes then EOS (256), in sorted path order
        stream += list(f.read_bytes()) + [256]
        if len(stream) >= 2048:
            break
    want_train, want_val = corpus.split(np.asarray(stream[:2048], np.int32).reshape(64, 32), 0.1, 0)
    store = next((tmp_path / "out" / "PrepareCorpus").glob("*/tokens.h5"))
    assert np.array_equal(corpus.read_tokens(store, "train"), want_train)
    assert np.array_equal(corpus.read_tokens(store, "val"), want_val)
    assert m["tokens"] == 2048 and m["skipped_files"] == 0


def test_glob_with_empty_and_unreadable_files_skips_them_and_records_it(tmp_path, run_graph, capsys):
    d = tmp_path / "texts"
    d.mkdir()
    for i in range(4):
        (d / f"good{i}.txt").write_text(TEXT[i])
    (d / "empty.txt").write_text("")
    (d / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 50)
    ev = _run(str(d / "*.txt"), tmp_path, run_graph)
    m = _meta(ev)
    assert m["source_files"] == 4 and m["skipped_files"] == 2
    assert {(s["file"].rsplit("/", 1)[-1], s["reason"].split(";")[0]) for s in m["skipped"]} == {
        ("empty.txt", "is empty"), ("latin1.txt", "is not UTF-8 text (byte 0xe9 at offset 3)")}  # found in its header
    assert capsys.readouterr().out.count("warning: skipping corpus file") == 2


@pytest.mark.parametrize("case", ["empty-bytes", "no-rows", "no-column", "explicit-empty-text", "all-empty-glob"])
def test_unusable_sources_fail_at_graph_construction(case, tmp_path):
    if case == "empty-bytes":
        src, want = tmp_path / "e.parquet", "e.parquet is empty"
        src.write_bytes(b"")
    elif case == "no-rows":
        src, want = _parquet(tmp_path / "e.parquet", []), "e.parquet has no rows"
    elif case == "no-column":
        src, want = _parquet(tmp_path / "c.parquet", TEXT, "body"), "c.parquet has no column 'text'"
    elif case == "explicit-empty-text":
        src, want = tmp_path / "e.txt", "e.txt is empty"
        src.write_text("")
    else:
        (tmp_path / "a.txt").write_text("")
        src, want = tmp_path / "*.txt", "none of the 1 matched file"
    with pytest.raises(ConfigError, match=want):
        load_config(overrides=tiny_cfg(**{"corpus.source": str(src)}), preset="")


def test_streaming_store_equals_tokenising_at_once_for_any_buffer(tmp_path):
    (tmp_path / "big.txt").write_text("\n".join(TEXT * 3))  # one document cut into pieces by small buffers
    _parquet(tmp_path / "p.parquet", TEXT)
    tok = byte_tokenizer()
    c = {**DEFAULTS["corpus"], "source": [str(tmp_path / "big.txt"), str(tmp_path / "p.parquet")], "seq_len": 16,
         "max_tokens": 0}
    train, val = corpus.split(corpus.tokenize(corpus.read_texts(c), tok, 16), 0.1, 0)
    want = corpus.fingerprint(train, val)
    for buf in (37, 1000, 1 << 20):
        meta = corpus.build_token_store(tmp_path / f"s{buf}.h5", {**c, "buffer_tokens": buf}, tok, "bytes", 128)
        assert meta["fingerprint"] == want
        assert np.array_equal(corpus.read_tokens(tmp_path / f"s{buf}.h5", "train"), train)
        assert meta["documents"] == 41
    meta = corpus.build_token_store(tmp_path / "m.h5", {**c, "max_tokens": 100, "buffer_tokens": 37}, tok, "bytes", 128)
    assert meta["tokens"] == 96 and meta["n_train"] + meta["n_val"] == 6


def test_a_flipped_byte_in_the_token_store_reads_the_same_tokens_or_fails_naming_the_file(tmp_path):
    """Every byte of tokens.h5 is checked (its SHA-256, written beside it) before a token is used:
    600 seeded flips each raise TokenStoreError naming the file and move it aside; none reads
    different tokens."""
    (tmp_path / "t.txt").write_text("\n".join(TEXT * 3))
    c = {**DEFAULTS["corpus"], "source": str(tmp_path / "t.txt"), "seq_len": 16, "max_tokens": 0}
    path = tmp_path / "tokens.h5"
    corpus.build_token_store(path, c, byte_tokenizer(), "bytes", 128)
    ref = {s: corpus.read_tokens(path, s) for s in ("train", "val")}
    raw = path.read_bytes()
    for off in sorted(set(np.random.default_rng(1).integers(0, len(raw), 600).tolist())):
        bad = bytearray(raw)
        bad[off] ^= 0x01
        path.write_bytes(bad)
        with pytest.raises(corpus.TokenStoreError, match=str(path)):
            corpus.read_tokens(path, "train")
        (moved,) = tmp_path.glob("tokens.h5.damaged-*")
        assert not path.exists()
        moved.unlink()
    path.write_bytes(raw)
    assert all(np.array_equal(corpus.read_tokens(path, s), ref[s]) for s in ref)
    assert corpus.read_meta(path)["seq_len"] == 16
