"""The prefetch default, measured on an experiment's own block: the time of a training step fed by
worker processes (``train.prefetch_mode=process``), by worker threads (``thread``) and by
boundaries already in memory (:class:`bench.common.InMemoryBoundaries`, no reader at all), in
interleaved rounds in one run. The step of the experiment's block is the CPU regime; the 2 ms
regime is ``bench/data_feed.py``'s simulated accelerator step (``docs/performance.md``).

    python bench/prefetch_default.py --outputs outputs              # the default experiment, built there
    python bench/prefetch_default.py --preset tiny --outputs /tmp/o  # smoke (builds the tiny preset)

Each arm trains a fresh copy of block ``--block`` (same seed, same batches) for ``--steps`` steps
per round; ``--rounds`` rounds rotate the arms' order. A step's time is the loop's own wall time
per step (the wait for its batch included) from the second step on: a worker's start, paid once
per TrainBlock, is printed apart. Beside the step times, two figures that do not drown in this
machine's drift: each arm's **wait**, the share of its steps' time the loop spent waiting for a
batch (measured by the loop itself), and the **reader's own time** per batch (a synchronous read
and check of the same batches, timed on one thread) over the median step: all a worker of either
kind could take from the step's cores. ``train.prefetch_mode=auto`` (the default) picks by
:func:`zgcore.data.feed.choose_mode`; the line before the last names its pick. The last line:
``prefetch cost process X% thread Y%`` (median step time over the in-memory step's, minus 1).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def find_block(preset: str, overrides: str, outputs: str, block: int):
    """The experiment's TrainBlock ``block`` (its inputs must be built)."""
    from workflows.experiment import build_experiment, load_config, walk
    from tasks.blocks import TrainBlock

    root = build_experiment(load_config(overrides=overrides, preset=preset), outputs)
    found = [t for t in walk(root) if isinstance(t, TrainBlock) and t.block == block and not t.candidate]
    if not found:
        raise SystemExit(f"the experiment has no TrainBlock for block {block}")
    return found[0]


def block_arguments(doc: str, steps: int, rounds: int) -> argparse.ArgumentParser:
    """The command line of a bench that trains one block of a built experiment in interleaved rounds."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--preset", default="default", help="experiment preset (default: default)")
    ap.add_argument("--set", default="", help="overrides")
    ap.add_argument("--outputs", default="outputs", help="outputs folder holding the experiment's boundary store")
    ap.add_argument("--block", type=int, default=1)
    ap.add_argument("--steps", type=int, default=steps, help=f"steps per arm and round (default {steps})")
    ap.add_argument("--rounds", type=int, default=rounds, help=f"interleaved rounds (default {rounds})")
    return ap


def block_inputs(a: argparse.Namespace) -> SimpleNamespace:
    """Block ``a.block`` of the experiment ``a.preset`` / ``a.set`` under ``a.outputs``, its inputs
    built when missing: ``task``, the teacher record ``rec``, boundaries ``start`` / ``end``, the
    ``kept`` teacher layers, the block's ``seed``, the boundary ``store`` folder and ``base``, its train
    settings for ``a.steps`` steps with no checkpoints, TensorBoard or lr search."""
    import luigi

    from tasks.teacher import teacher_record
    from zgcore.models.shapes import kept_layers, resolve_boundaries
    from zgcore.training.blocks import block_seed

    task = find_block(a.preset, a.set, a.outputs, a.block)
    deps = luigi.task.flatten(task.requires())
    if not all(d.complete() for d in deps):
        luigi.build(deps, local_scheduler=True, workers=1, log_level="WARNING")
    rec = teacher_record(task.teacher_task())
    bs = resolve_boundaries(task.boundary, rec["n_layers"])
    start, end = bs[a.block], bs[a.block + 1]
    return SimpleNamespace(task=task, rec=rec, start=start, end=end, kept=kept_layers(start, end, task.train),
                           seed=block_seed(int(task.train["seed"]), a.block), store=task.requires()["cache"].out_dir,
                           base={**dict(task.train), "max_steps": a.steps, "tensorboard": False,
                                 "checkpoint_every": 0, "lrs": []})


def main(argv=None) -> dict:
    a = block_arguments(__doc__, 6, 3).parse_args(argv)

    import numpy as np
    import torch

    from bench.common import InMemoryBoundaries
    from zgcore.data.boundary_store import BoundaryReader
    from zgcore.models.adapters import build_block
    from zgcore.models.teacher_weights import layer_source
    from zgcore.training.blocks import BlockTraining, train_block
    from zgcore.data.feed import choose_mode, stored_batch_bytes

    b = block_inputs(a)
    task, rec, start, end, kept, seed, store, base = b.task, b.rec, b.start, b.end, b.kept, b.seed, b.store, b.base
    print(f"block {a.block} (layers {kept}), batch {base['batch_size']}, {a.steps} steps x {a.rounds} rounds, "
          f"torch threads {torch.get_num_threads()}", flush=True)
    with BoundaryReader(store) as reader:
        memory = InMemoryBoundaries(reader, [start, end])
    arms = ["process", "thread", "memory"]
    steps: dict[str, list[float]] = {k: [] for k in arms}
    first: dict[str, list[float]] = {k: [] for k in arms}
    waits: dict[str, list[float]] = {k: [] for k in arms}
    weights: dict[str, bytes] = {}
    with tempfile.TemporaryDirectory(prefix="zg-prefetch-") as tmp:
        for r in range(a.rounds):
            for arm in arms[r % 3:] + arms[:r % 3]:
                block = build_block(layer_source(rec), kept, task.train["init"], seed)
                t = {**base, "prefetch_mode": arm if arm != "memory" else "process"}
                work = Path(tempfile.mkdtemp(dir=tmp))
                source = memory if arm == "memory" else BoundaryReader(store)
                infos: list = []
                train_block(block, source, start, end, BlockTraining(t, seed, work, run_hash=f"bench-{arm}",
                            callbacks=[infos.append]))
                if arm != "memory":
                    source.close()
                per_step = [i.seconds for i in infos[1:]]
                waits[arm].append(sum(i.data_seconds for i in infos[1:]) / sum(per_step))
                first[arm].append(infos[0].seconds)
                steps[arm].extend(per_step)
                w = b"".join(v.numpy().tobytes() for _, v in sorted(block.layer_state_dict().items()))
                if weights.setdefault(arm, w) != w:
                    raise SystemExit(f"{arm}: round {r} trained other weights than round 0")
                print(f"  round {r} {arm:<8} first step {infos[0].seconds:.3f} s, then "
                      f"{statistics.median(per_step) * 1e3:.1f} ms/step (median of {len(per_step)})", flush=True)
    same = len(set(weights.values())) == 1
    med = {k: statistics.median(v) for k, v in steps.items()}
    # the reader's own time per batch: what a worker of either kind could take from the step's cores
    bs = int(base["batch_size"])
    with BoundaryReader(store) as reader:
        batch_bytes = stored_batch_bytes(reader, bs, 2)
        n = reader.n("train")
        idx = [np.arange(i * bs, (i + 1) * bs) % n for i in range(max(8, a.steps))]
        reader.read("train", start, idx[0]), reader.read("train", end, idx[0])  # warm: open files, page cache
        t0 = time.thread_time()
        for ix in idx:
            reader.read("train", start, ix), reader.read("train", end, ix)
        read_ms = 1e3 * (time.thread_time() - t0) / len(idx)
    auto = choose_mode(batch_bytes, accelerator=False)  # every arm trains on this machine's CPU
    out = {"step_ms": {k: 1e3 * v for k, v in med.items()},
           "first_step_s": {k: statistics.median(v) for k, v in first.items()},
           "wait": {k: statistics.median(v) for k, v in waits.items()},
           "reader_ms_per_batch": read_ms, "batch_bytes": batch_bytes, "auto": auto,
           "cost": {k: med[k] / med["memory"] - 1 for k in ("process", "thread")}, "bitwise_identical": same}
    for k in arms:
        print(f"{k:<8} {out['step_ms'][k]:9.1f} ms/step   first step {out['first_step_s'][k]:.3f} s   "
              f"waiting for its batch {100 * out['wait'][k]:.2f}% of the step")
    print(f"reading and checking one batch ({batch_bytes / 1e6:.1f} MB) on one thread: {read_ms:.1f} ms of CPU, "
          f"{100 * read_ms / out['step_ms']['memory']:.2f}% of the in-memory step")
    print(f"weights bitwise identical across arms: {same}")
    print(f"prefetch_mode=auto picks {auto}: at most {100 * (out['wait'][auto] + read_ms / out['step_ms']['memory']):.2f}% "
          "of a step (its wait plus the reader's whole time)")
    print(f"prefetch cost process {100 * out['cost']['process']:+.1f}% thread {100 * out['cost']['thread']:+.1f}%",
          flush=True)
    return out


if __name__ == "__main__":
    main()
