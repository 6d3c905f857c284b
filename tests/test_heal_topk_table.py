"""scripts/heal_topk_table.py on stored figures (its runs faked): documents reach every comparison,
one Holm family spans the whole table, and every arm's healing FLOPs are printed."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "heal_topk_table.py"


def _run(k, seed, r):
    ce = lambda shift: list(3.0 + shift + r.normal(0, 0.05, 40))
    docs = list(np.repeat(np.arange(20), 2))
    par = {"teacher": {"layers": [100, 100], "head": 50, "width": 4}, "student": {"layers": [100], "head": 50, "width": 4}}
    return {"scores": {"val": {"ce": {"student": ce(0.001 * k), "teacher": ce(-0.1)}, "documents": docs},
                       "extra": {"docstrings": {"ce": {"student": ce(0.002 * k), "teacher": ce(-0.1)}, "documents": docs}}},
            "heal": {"seconds": 10.0, "steps": 5, "peak_rss_mib": 100.0},
            "store": {"n_train": 8, "n_val": 2} if k else None, "batch_size": 2,
            "report": {"seq_len": 8, "parameters": par, "logit_store": {"bytes_per_token": 68.0} if k else None}}


def test_the_table_passes_documents_and_corrects_the_whole_table_together(monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("heal_topk_table", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    r = np.random.default_rng(0)
    monkeypatch.setattr(mod, "find", lambda outputs, k, seed: _run(k, seed, r))
    assert mod.main(["--seeds", "0", "1", "2", "--ks", "0", "8", "64"]) == 0
    out = capsys.readouterr().out
    assert "Holm over all 6 comparisons of this table" in out and out.count("| run | 3 |") == 6
    rows = [line for line in out.splitlines() if line.startswith("| top-8, cached | 0 |")]
    # healing FLOPs: student 3 x 80 tokens x 364 + the top-k store's 10 sequences x 8 tokens x the teacher's 628
    assert rows and rows[0].rstrip(" |").split("| ")[-1].strip() == f"{3 * 80 * 364 + 10 * 8 * 628:.3e}"
    assert out.count("| 40 | 20 |") == 6  # sequences and documents beside every comparison
