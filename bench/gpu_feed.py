"""The accelerator figure of the input pipeline: how busy one block's training keeps the device when its
batches come from the boundary store, against the same steps fed from memory.

    python bench/gpu_feed.py                 # on CUDA where there is one, else the CPU (a rehearsal)
    python bench/gpu_feed.py --quick         # a few steps, tiny store (seconds)

A randomly initialised teacher of SmolLM2's shape (hidden 576, MLP 1536, 9 heads, 3 KV heads;
10 layers: one block of the default 3-block experiment, no download) writes a float32 store of
boundaries 0 and 10 (``--sequences`` x 256 tokens); a student block of 8 kept layers (~28 M
parameters) trains ``--steps`` steps on batches of 4 sequences with the default train settings,
three times from the same seed:

* ``memory``: both boundaries already in RAM as float32 (:class:`bench.common.InMemoryBoundaries`);
* ``cached-sync``: read from the store on the training thread (``train.prefetch=0``);
* ``cached-prefetch``: read ahead by the prefetching worker (``train.prefetch`` default).

For each, ``step_ms`` is the wall time per step and ``busy`` the share of it spent outside waiting
for the batch (:class:`zgcore.training.loop.TrainLoop`'s ``compute_seconds`` over ``seconds``; on CUDA a step
ends with ``loss.item()``, so the device computes through that share and idles through the
rest). The last lines are ``device <mode> step_ms <ms> busy <fraction>``, then whether the three
runs gave bitwise identical weights. Run by ``scripts/device_check.sh`` on a lent GPU.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="2 teacher layers, 24 sequences, 6 steps")
    p.add_argument("--steps", type=int, default=None, help="training steps per run (default 300; 6 quick)")
    p.add_argument("--sequences", type=int, default=None, help="sequences in the store (default 512; 24 quick)")
    a = p.parse_args(argv)
    a.steps = a.steps or (6 if a.quick else 300)
    a.sequences = a.sequences or (24 if a.quick else 512)
    a.layers = 2 if a.quick else 10
    return a


def main(argv=None) -> int:
    from bench.common import InMemoryBoundaries, random_teacher, train_settings
    from zgcore.models.adapters import build_block
    from zgcore.data.boundary_store import BoundaryReader, build_store
    from zgcore.models.shapes import kept_layers
    from zgcore.models.teacher import load

    a = parse(argv)
    root = Path(tempfile.mkdtemp(prefix="gpu_feed-"))
    try:
        random_teacher(root / "teacher", a.layers, 576, 1536, heads=9, kv_heads=3)
        teacher, _ = load({"path": str(root / "teacher")}, a.device)
        rng = np.random.default_rng(0)
        tokens = {"train": rng.integers(0, 256, (a.sequences, 256)).astype(np.int32),
                  "val": rng.integers(0, 256, (8, 256)).astype(np.int32)}
        b_out = a.layers
        build_store(root / "store", teacher, tokens, [0, b_out], "float32", 8, {}, log=lambda m: None)
        t = train_settings(4, max_steps=a.steps)
        kept = kept_layers(0, b_out, t)
        runs, weights = {}, {}
        with BoundaryReader(root / "store") as r:
            memory = InMemoryBoundaries(r, [0, b_out])
        from zgcore.training.blocks import BlockTraining, train_block

        for mode, source, ahead in (("memory", lambda: memory, 0), ("cached-sync", lambda: BoundaryReader(root / "store"), 0),
                                    ("cached-prefetch", lambda: BoundaryReader(root / "store"), None)):
            tt = dict(t) if ahead is None else {**t, "prefetch": ahead}
            block = build_block(teacher, kept, "teacher", 7, device=a.device)
            with source() as src, tempfile.TemporaryDirectory() as work:
                m = train_block(block, src, 0, b_out, BlockTraining(tt, 7, Path(work), mode))
            runs[mode] = (1e3 * m["seconds"] / m["steps"], m["compute_seconds"] / m["seconds"])
            weights[mode] = {k: v.cpu() for k, v in block.layer_state_dict().items()}
            print(f"  {mode}: {m['steps']} steps in {m['seconds']:.2f} s, waiting for data {m['data_seconds']:.2f} s",
                  flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    n_params = sum(v.numel() for v in weights["memory"].values())
    print(f"device {a.device}: block of {len(kept)} layers, {n_params / 1e6:.1f} M parameters, batch 4 x 256 tokens, "
          f"prefetch {t['prefetch']}")
    for mode, (ms, busy) in runs.items():
        print(f"device {mode} step_ms {ms:.2f} busy {busy:.3f}")
    same = all(all(torch.equal(weights["memory"][k], w[k]) for k in w) for w in weights.values())
    print(f"identity weights memory / cached-sync / cached-prefetch: {'bitwise identical' if same else 'DIFFERENT'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
