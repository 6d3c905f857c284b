"""What healing from the top-k logit store costs and saves, measured on real ``Heal`` tasks.

A randomly initialised Llama teacher with SmolLM2's vocabulary size (49,152 tokens; byte tokenizer,
so only 260 of them occur in the text), ``--layers`` layers of width ``--hidden``, is written from a
config (no download). One experiment (two blocks, a few steps each) is built once; then each arm's
``Heal`` runs alone in a fresh process (``luigi.build``, all its inputs done), and its own
``metrics.json`` gives its peak resident memory (``VmHWM`` reset at the task's start) and its
seconds per step. Arms: full-vocabulary KD online (``top_k`` = 0), top-k online, top-k cached
(k = 8 and 64 by default). For the cached arms the logit store's build time (teacher time summed
over shards) and bytes per stored token come from its manifest.

    python bench/logit_store.py [--layers 8] [--hidden 512] [--vocab 49152] [--steps 8] [--ks 8 64] [--workdir DIR] [--keep]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def experiment(teacher: Path, steps: int) -> str:
    """Override string of the benchmark's experiment on ``teacher`` (heal settings added per arm)."""
    return (f"teacher={teacher} corpus.seq_len=128 corpus.max_tokens=16384 boundary.num_blocks=2 train.n_layers=2 "
            f"train.max_steps=2 eval.context_window=8 eval.context_sequences=0 heal.steps={steps} heal.batch_size=4 "
            "heal.checkpoint_every=1000 heal.tensorboard=false")


def heal_of(cfg: str, outputs: str):
    from workflows.experiment import build_experiment, load_config

    return build_experiment(load_config(overrides=cfg, preset=""), outputs).requires()["assemble"]


def child(spec: str) -> None:
    """Run one arm's Heal alone; print ``{"ok", "seconds"}`` as JSON."""
    import luigi

    s = json.loads(spec)
    t0 = time.perf_counter()
    ok = luigi.build([heal_of(s["cfg"], s["outputs"])], local_scheduler=True, log_level="WARNING")
    print(json.dumps({"ok": bool(ok), "seconds": time.perf_counter() - t0}))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--ks", type=int, nargs="+", default=[8, 64])
    p.add_argument("--workdir", default=None)
    p.add_argument("--keep", action="store_true")
    a = p.parse_args(argv)
    os.environ.setdefault("TQDM_DISABLE", "1")
    import luigi

    from bench.common import log
    from zgcore.models.teacher import build_tiny

    work = Path(a.workdir or tempfile.mkdtemp(prefix="zg-logits-"))
    teacher, outputs = work / "teacher", str(work / "out")
    try:
        if not teacher.is_dir():
            log(f"random Llama teacher: {a.layers} layers, hidden {a.hidden}, vocabulary {a.vocab}")
            build_tiny("llama", teacher, n_layers=a.layers, hidden=a.hidden, vocab=a.vocab, max_positions=256)
        base = experiment(teacher, a.steps)
        arms = [("full vocabulary, online", "heal.top_k=0")]
        for k in a.ks:
            arms += [(f"top-{k}, online", f"heal.top_k={k}"), (f"top-{k}, cached", f"heal.top_k={k} heal.targets=cached")]
        first = heal_of(f"{base} heal.top_k=0", outputs)
        prereq = [first.requires()["assemble"]] + [heal_of(f"{base} {o}", outputs).requires()["logits"]
                                                 for _, o in arms if "cached" in o]
        log("building the blocks, the assembled student and the logit stores")
        assert luigi.build(prereq, local_scheduler=True, log_level="WARNING")
        rows = []
        for name, over in arms:
            cfg = f"{base} {over}"
            r = subprocess.run([sys.executable, __file__, "--child", json.dumps({"cfg": cfg, "outputs": outputs})],
                               cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True)
            if r.returncode != 0 or not json.loads(r.stdout.strip().splitlines()[-1])["ok"]:
                raise SystemExit(f"Heal ({name}) failed:\n{r.stderr[-3000:]}")
            task = heal_of(cfg, outputs)
            m = json.loads((task.out_dir / "metrics.json").read_text())
            row = {"arm": name, "peak_rss_mib": m["peak_rss_mib"], "s_per_step": m["seconds"] / m["steps"],
                   "final_kd": m["final_kd"]}
            if "logits" in task.requires():
                man = json.loads((task.requires()["logits"].out_dir / "manifest.json").read_text())
                tokens = (man["n_train"] + man["n_val"]) * man["seq_len"]
                row |= {"store_bytes_per_token": man["bytes"] / tokens, "store_build_s": man["build_seconds"],
                        "store_tokens": tokens}
            rows.append(row)
            log(f"{name}: peak RSS {row['peak_rss_mib']:.0f} MiB, {row['s_per_step']:.2f} s/step")
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\nHeal, {a.steps} steps of 4 x 128 tokens; teacher {a.layers} layers, hidden {a.hidden}, vocabulary {a.vocab}; "
          "a fresh process per arm:")
    print(f"{'arm':<26}{'peak RSS MiB':>14}{'s/step':>9}{'store B/token':>15}{'store build s':>15}")
    for r in rows:
        b = f"{r['store_bytes_per_token']:.1f}" if "store_bytes_per_token" in r else "-"
        s = f"{r['store_build_s']:.1f}" if "store_build_s" in r else "-"
        print(f"{r['arm']:<26}{r['peak_rss_mib']:>14.0f}{r['s_per_step']:>9.2f}{b:>15}{s:>15}")
    full = rows[0]
    for r in rows[1:]:
        print(f"{r['arm']}: peak RSS {r['peak_rss_mib'] / full['peak_rss_mib']:.3f}x, "
              f"s/step {r['s_per_step'] / full['s_per_step']:.3f}x the full-vocabulary online arm")
    return 0


if __name__ == "__main__":
    from bench.common import run_script

    run_script(main, "--child", child)
