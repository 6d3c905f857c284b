"""Would ``torch.compile`` pay for a scoring task? The assembled student's cross-entropy pass on
the out-of-domain held-out set (the validation split for a preset without ``eval.extra``; the
experiment's own ``ScoreAssembled`` task: its model, rows and batch size), eager and through ``torch.compile``, in one run: the compiled arm's first batch (the
compile, paid once per scoring task's process), the median batch after it for each arm, each
arm's MFU against this process's matmul probe (:mod:`zgcore.training.mfu`, FLOPs from
:mod:`zgcore.evaluation.flops`), how far the compiled per-sequence CE is from the eager one, and
after how many batches the compile is paid back.

    python bench/compile_scoring.py --outputs outputs              # the default experiment, built there
    python bench/compile_scoring.py --preset tiny --outputs /tmp/o  # smoke (builds the tiny preset)

The last line: ``scoring compile speed-up X (steady batch), pays back after N batches (the task scores M)``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def scoring_task(root, family: str = "ScoreAssembled", held_out: bool = True):
    """The first task of ``family`` in ``root``'s graph scoring an ``eval.extra`` corpus
    (``held_out``) or the validation split; ``None`` when the graph has none."""
    from workflows.experiment import walk

    return next((t for t in walk(root) if t.get_task_family() == family
                 and bool(getattr(t, "held_out", {})) == held_out), None)


def main(argv=None) -> dict:
    from bench.rebuild import build
    from workflows.experiment import build_experiment, load_config

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="default", help="experiment preset (default: default; tiny for a smoke run)")
    ap.add_argument("--outputs", required=True, help="outputs folder where the experiment is (or will be) built")
    ap.add_argument("--batches", type=int, default=6, help="timed batches per arm after the first (default 6)")
    a = ap.parse_args(argv)

    import numpy as np
    import torch

    from zgcore.evaluation import flops
    from zgcore.evaluation.flops import model_parameters
    from zgcore.evaluation.metrics import sequence_cross_entropy
    from zgcore.training import mfu

    ok, _ = build(a.preset, "", a.outputs)
    if not ok:
        raise SystemExit("the experiment failed to build; see the log above")
    root = build_experiment(load_config(preset=a.preset), a.outputs)
    task = scoring_task(root) or scoring_task(root, held_out=False)  # the validation split without eval.extra
    all_rows, idx, _ = task.tokens()
    rows = all_rows[idx]
    bs = min(int(task.eval["batch_size"]), len(rows) // 2)  # a smoke preset's few rows: smaller batches
    if bs < 1:
        raise SystemExit(f"{len(rows)} scored row(s): two batches need at least 2")
    n = min(len(rows) // bs, a.batches + 1) * bs
    model = task.load_model()
    peak = mfu.probe("cpu")["peak_flops_per_second"]
    batch_flops = flops.scoring_flops(model_parameters(model), bs, rows.shape[1])
    print(f"{task.title()}: {len(rows)} rows of {rows.shape[1]} tokens, batch {bs}, {n // bs - 1} timed batches "
          f"per arm, torch threads {torch.get_num_threads()}, probe {peak / 1e9:.1f} GFLOP/s", flush=True)

    def batches(m) -> tuple[list[float], np.ndarray]:
        times, ce = [], []
        for lo in range(0, n, bs):
            t0 = time.perf_counter()
            ce.append(sequence_cross_entropy(m, rows[lo: lo + bs], bs, desc="bench"))
            times.append(time.perf_counter() - t0)
        return times, np.concatenate(ce)

    sequence_cross_entropy(model, rows[:bs], bs, desc="warm-up")  # untimed: the process's first forward
    eager_t, eager_ce = batches(model)
    compiled_t, compiled_ce = batches(torch.compile(model))
    eager, compiled = statistics.median(eager_t[1:]), statistics.median(compiled_t[1:])
    diff = float(np.abs(eager_ce - compiled_ce).max())
    for arm, first, med in (("eager", eager_t[0], eager), ("compiled", compiled_t[0], compiled)):
        print(f"{arm:<9} first batch {first:7.2f} s, median batch {med:6.3f} s, "
              f"MFU {100 * batch_flops / med / peak:.1f}%", flush=True)
    print(f"per-sequence CE: compiled vs eager max |diff| {diff:.3g} nats/token, bitwise "
          f"{'the same' if eager_ce.tobytes() == compiled_ce.tobytes() else 'different'}")
    saving = eager - compiled
    total = -(-len(rows) // bs)
    payback = (compiled_t[0] - eager) / saving if saving > 0 else float("inf")
    speedup = eager / compiled
    print(f"scoring compile speed-up {speedup:.3f} (steady batch), pays back after "
          f"{'never' if payback == float('inf') else f'{payback:.0f}'} batches (the task scores {total})")
    return {"speedup": speedup, "payback_batches": payback, "batches": total, "max_diff": diff}


if __name__ == "__main__":
    main()
