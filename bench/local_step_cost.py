"""What a step of local-learning pretraining costs at two model sizes, to size a CPU preset.

For each model (``local_cpu_2tpp``'s 8 x 64 model and ``local_cpu_10tpp``'s 8 x 32 model) and each
of the six configurations the presets run, :func:`zgcore.local.train_local` runs ``--steps`` steps
of 16 x 128 random token ids on one thread, interleaved, ``--reps`` times. It reports the CPU time
per step (``time.process_time``: what the step costs a core, unlike wall time, which on a shared
machine measures the other jobs too; it includes the activation-memory measurement before step 1,
alike for every run) and the ratio of the sums over the six configurations, smaller / larger model.

``local_cpu_10tpp``'s time is estimated from that ratio and the measured end-to-end time of
``local_cpu_2tpp`` (docs/tuning.md).

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m bench.local_step_cost --steps 20 --reps 2
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from zgcore import local as zl

MODELS = {
    "local_cpu_2tpp (8 x 64, top:2048)": ({"n_layers": 8, "hidden_size": 64, "intermediate_size": 192, "n_heads": 4,
                                           "n_kv_heads": 2, "rope_theta": 10000.0, "vocab": "top:2048"}, 2049),
    "local_cpu_10tpp (8 x 32, top:1024)": ({"n_layers": 8, "hidden_size": 32, "intermediate_size": 96, "n_heads": 4,
                                            "n_kv_heads": 2, "rope_theta": 10000.0, "vocab": "top:1024"}, 1025),
}
CONFIGS = {"K1": {"K": 1, "aux": "mlp", "mtp_boundaries": []},
           "K2-mlp": {"K": 2, "aux": "mlp", "mtp_boundaries": []},
           "K4-mlp": {"K": 4, "aux": "mlp", "mtp_boundaries": []},
           "K4-tr": {"K": 4, "aux": "transformer", "mtp_boundaries": []},
           "K4-tr-mtp1": {"K": 4, "aux": "transformer", "mtp_boundaries": [1]},
           "K4-tr-mtpall": {"K": 4, "aux": "transformer", "mtp_boundaries": [1, 2, 3]}}
BATCH, SEQ = 16, 128


def step_cost(model: dict, vocab: int, loc: dict, steps: int) -> dict:
    """CPU and wall seconds per training step of one configuration (random tokens, 1 thread)."""
    train = {**zl.LOCAL_DEFAULTS["train"], "token_budget": steps * BATCH * SEQ, "batch_size": BATCH, "warmup_steps": 2,
             "lr": 3e-3}
    run = zl.normalise_run({"model": model, "train": train, "local": {**zl.LOCAL_DEFAULTS["local"], **loc, "mtp_n": 2}})
    lm = zl.build_local(run, vocab, SEQ)
    tokens = np.random.default_rng(0).integers(0, vocab, (512, SEQ))
    t0, c0 = time.perf_counter(), time.process_time()
    zl.train_local(lm, tokens, {**run["train"], "log_every": 10 ** 6, "checkpoint_every": 0})
    return {"cpu_s": (time.process_time() - c0) / steps, "wall_s": (time.perf_counter() - t0) / steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    best: dict = {}
    for rep in range(args.reps):
        for mname, (model, vocab) in MODELS.items():
            for cname, loc in CONFIGS.items():
                r = step_cost(model, vocab, loc, args.steps)
                best[(mname, cname)] = min(best.get((mname, cname), float("inf")), r["cpu_s"])
                print(json.dumps({"model": mname, "config": cname, "rep": rep, **r}), flush=True)
    names = list(MODELS)
    print(f"\nCPU s/step (min of {args.reps} reps of {args.steps} steps, 1 thread, batch {BATCH} x {SEQ})")
    print(f"{'configuration':14s}" + "".join(f"{n:>38s}" for n in names))
    for cname in CONFIGS:
        print(f"{cname:14s}" + "".join(f"{best[(n, cname)]:38.3f}" for n in names))
    sums = [sum(best[(n, c)] for c in CONFIGS) for n in names]
    print(f"{'sum':14s}" + "".join(f"{s:38.3f}" for s in sums))
    print(f"ratio (second / first model), summed over the six configurations: {sums[1] / sums[0]:.3f}")


if __name__ == "__main__":
    main()
