"""docs/export.md's SmolLM2 table: the teacher and the default experiment's student as GGUF at f32, q8_0 and
q4_k_m, scored and timed by llama.cpp (llama-cpp-python) in one process.

    .venv/bin/python -m bench.gguf_table [--teacher-only] [--threads 2] [--json table.json]

Needs the default experiment built (`.venv/bin/luigi --module workflows RunExperiment --local-scheduler`)
and its student exported (`.venv/bin/zerograph export --gguf --quant <q>` for each quant) unless
``--teacher-only``. The teacher's files are written here from its de-quantized Hugging Face folder with
the same writer (tokenizer keys copied from its own GGUF). Per file: size, per-sequence CE on the
experiment's test rows (in domain) and on every ``eval.extra`` corpus (out of domain), prompt-processing
tokens/s (the scoring passes) and generation tokens/s (64 greedy tokens after 64 prompt tokens), and per
document the increase from f32; the question "does the student lose more than the teacher?" is the paired
interval over documents of (student's increase - teacher's increase), documents resampled
(:func:`zgcore.evaluation.estimators.bootstrap`).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

QUANTS = ("f32", "q8_0", "q4_k_m")


def score(path: Path, rows: np.ndarray, threads: int) -> dict:
    """Per-sequence mean CE of ``rows`` ``[n, T]`` by llama.cpp, and its prompt / generation tokens/s."""
    import llama_cpp

    n_ctx = int(rows.shape[1])
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=max(n_ctx, 128), n_batch=max(n_ctx, 128), n_threads=threads,
                          logits_all=True, verbose=False)
    ce, t0 = [], time.perf_counter()
    for ids in rows:
        llm.reset()
        llm.eval([int(i) for i in ids])
        z = np.asarray(llm.scores[: len(ids) - 1], dtype=np.float64)
        z -= z.max(-1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
        ce.append(float(-logp[np.arange(len(ids) - 1), ids[1:]].mean()))
    prompt = rows.size / (time.perf_counter() - t0)
    llm.reset()
    llm.eval([int(i) for i in rows[0][:64]])
    t0 = time.perf_counter()
    for _ in range(64):
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
    return {"ce": ce, "prompt_tps": prompt, "gen_tps": 64 / (time.perf_counter() - t0), "bytes": path.stat().st_size}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--outputs", default="outputs")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--teacher-only", action="store_true")
    ap.add_argument("--json", default="")
    a = ap.parse_args()

    from tasks.heldout import held_out_tasks, read_held_out
    from tasks.teacher import PrepareCorpus, PrepareTeacher, teacher_record
    from tasks.export import GGUF, teacher_gguf
    from workflows.experiment import load_config
    from workflows.export import build_export
    from zgcore.data import corpus
    from zgcore.evaluation import estimators, metrics
    from zgcore.models import gguf_export

    import luigi

    cfg = load_config(preset="default")
    pc = PrepareCorpus(teacher=cfg["teacher"], corpus=cfg["corpus"], outputs=a.outputs)
    probe = build_export(cfg, a.outputs, "f32")
    if not luigi.build([pc, *held_out_tasks(probe, cfg["eval"])], local_scheduler=True, log_level="WARNING"):
        raise SystemExit("the teacher, its corpus or a held-out corpus failed to build")
    val = corpus.read_tokens(pc.out_dir / "tokens.h5", "val")
    rows = metrics.eval_subset(len(val), int(cfg["eval"]["max_sequences"]), int(cfg["eval"]["subset_seed"]))
    docs = corpus.read_documents(pc.out_dir / "tokens.h5", "val")
    sets = {"in": (val[rows], None if docs is None else np.asarray(docs)[rows])}
    for t in held_out_tasks(probe, cfg["eval"]):
        sets[t.extra["name"]] = (read_held_out(t), None)
    rec = teacher_record(PrepareTeacher(teacher=cfg["teacher"], outputs=a.outputs))
    here = Path(a.outputs) / "bench-gguf"
    here.mkdir(parents=True, exist_ok=True)
    files = {}
    for q in QUANTS:
        files[("teacher", q)] = here / f"teacher-{q}.gguf"
        if not files[("teacher", q)].is_file():
            gguf_export.export(rec["path"], files[("teacher", q)], q, teacher_gguf(rec), threads=a.threads)
        if not a.teacher_only:
            files[("student", q)] = build_export(cfg, a.outputs, q).out_dir / GGUF
            if not files[("student", q)].is_file():
                raise SystemExit(f"{files[('student', q)]} is missing: run "
                                 f".venv/bin/zerograph export --gguf --quant {q}")
    res = {f"{m}/{q}/{s}": score(p, x, a.threads) for (m, q), p in files.items() for s, (x, _) in sets.items()}
    for key in sorted(res):
        r = res[key]
        print(f"{key:28s} {r['bytes'] / 1e6:8.1f} MB  CE {np.mean(r['ce']):.4f}  prompt {r['prompt_tps']:7.1f} tok/s  "
              f"gen {r['gen_tps']:6.1f} tok/s")
    if not a.teacher_only:
        for s, (_, groups) in sets.items():
            for q in QUANTS[1:]:
                inc = {m: np.asarray(res[f"{m}/{q}/{s}"]["ce"]) - np.asarray(res[f"{m}/f32/{s}"]["ce"])
                       for m in ("teacher", "student")}
                d = inc["student"] - inc["teacher"]
                lo, hi, p = estimators.bootstrap(d, estimators.clusters(len(d), groups), 10000, 0, 0.95)
                print(f"{s} {q}: student's increase - teacher's {d.mean():+.4f} nats/token "
                      f"[{lo:+.4f}, {hi:+.4f}] p={p:.3f}")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
