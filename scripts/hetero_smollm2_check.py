"""A heterogeneous SmolLM2 student from teacher-initialised (untrained) blocks of three shapes —
layers 0-9 at 75% MLP width, layers 10-19 with one key-value head instead of three, 8 of layers
20-29 — saved, copied elsewhere, reloaded with ``AutoModelForCausalLM.from_pretrained(folder,
trust_remote_code=True)``, and checked: parameter count against the blocks' costs, logits against
the blocks run one after another, held-out CE beside the teacher's (docs/library.md).

Usage: ``.venv/bin/python scripts/hetero_smollm2_check.py OUTPUTS`` where ``OUTPUTS`` holds a
finished ``PrepareTeacher`` of smollm2-135m and a ``PrepareCorpus`` (any SmolLM2 run, e.g. the
``library`` preset's first tasks). Prints the figures; exits non-zero when a check fails.
"""
from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from zgcore.data import corpus
from zgcore.evaluation.metrics import cross_entropy
from zgcore.models import costs, students
from zgcore.models.adapters import build_block, head_logits
from zgcore.models.hetero import assemble_exact, save_student


def main(outputs: Path) -> None:
    tdir = next(outputs.glob("PrepareTeacher/smollm2-135m-*/model"))
    tokens = next(outputs.glob("PrepareCorpus/*/tokens.h5"))
    teacher = AutoModelForCausalLM.from_pretrained(tdir, dtype=torch.float32).eval()
    cfg = teacher.config
    channels = students.measure(teacher, corpus.read_tokens(tokens, "train")[:4])["channels"]
    spread8 = [20 + round(j * 9 / 7) for j in range(8)]
    shapes = ((list(range(10)), 1152, None), (list(range(10, 20)), None, 1), (spread8, None, None))
    blocks = [build_block(teacher, k, "teacher", 0, intermediate_size=w, channels=channels, kv_heads=kv) for k, w, kv in shapes]
    with tempfile.TemporaryDirectory() as d:
        save_student(assemble_exact(teacher, blocks), AutoTokenizer.from_pretrained(tdir), Path(d) / "built")
        shutil.copytree(Path(d) / "built", Path(d) / "moved")
        shutil.rmtree(Path(d) / "built")
        loaded = AutoModelForCausalLM.from_pretrained(Path(d) / "moved", trust_remote_code=True, dtype=torch.float32).eval()
    want = costs.student_extra(cfg)["params"] + sum(costs.block_cost(cfg, k, w, kv, 256)["params"] for k, w, kv in shapes)
    got, full = costs.non_embedding_params(loaded), costs.non_embedding_params(teacher)
    val = corpus.read_tokens(tokens, "val")[:4]
    ids = torch.as_tensor(val[:2, :64], dtype=torch.long)
    with torch.no_grad():
        h = teacher.get_input_embeddings()(ids)
        for b in blocks:
            h = b(h)
        diff = float((loaded(input_ids=ids).logits - head_logits(teacher, h)).abs().max())
    print(f"{type(loaded).__name__}, {len(loaded.model.layers)} layers; non-embedding parameters {got:,} "
          f"(budgeted {want:,}; teacher {full:,}, share {got / full:.4f}); max |logits - blocks in order| {diff:.3g}")
    print(f"held-out CE on {len(val)} validation sequences: teacher {cross_entropy(teacher, val, 2):.4f}, "
          f"untrained heterogeneous student {cross_entropy(loaded, val, 2):.4f} nats/token")
    if got != want or diff > 1e-4:
        sys.exit("check failed: parameter count or logits differ")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "outputs"))
