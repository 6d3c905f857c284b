"""``train.compile`` measured on an experiment's own block: the training step of block ``--block``
eager and through ``torch.compile``, in interleaved rounds in one run, each from the same
initialisation and batches (the boundary store, prefetching as the default does), after three
untimed eager steps (a process's first steps run slower). Prints, per arm,
the first step (the compile, paid once per TrainBlock; it reads TorchInductor's cache, which the
first compiled round of a fresh machine fills), the median step after it, and the MFU of that
median against this process's matmul probe (:mod:`zgcore.training.mfu`, FLOPs from
:mod:`zgcore.evaluation.flops`); then whether two compiled rounds trained bitwise the same weights.

    python bench/compile_block.py --outputs outputs              # the default experiment, built there
    python bench/compile_block.py --preset tiny --outputs /tmp/o  # smoke (builds the tiny preset)

The last line: ``compile speed-up X (steady step), Y over a 150-step block``.
"""
from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> dict:
    from bench.prefetch_default import block_arguments, block_inputs

    a = block_arguments(__doc__, 12, 2).parse_args(argv)

    import torch

    from zgcore.data.boundary_store import BoundaryReader
    from zgcore.evaluation import flops
    from zgcore.models.adapters import build_block
    from zgcore.models.teacher_weights import layer_source
    from zgcore.training import mfu
    from zgcore.training.blocks import BlockTraining, train_block

    b = block_inputs(a)
    task, rec, start, end, kept, seed, store, base = b.task, b.rec, b.start, b.end, b.kept, b.seed, b.store, b.base
    peak = mfu.probe("cpu")["peak_flops_per_second"]
    print(f"block {a.block} (layers {kept}), batch {base['batch_size']}, {a.steps} steps x {a.rounds} rounds, "
          f"torch threads {torch.get_num_threads()}, probe {peak / 1e9:.1f} GFLOP/s", flush=True)
    arms = ["eager", "compiled"]
    first: dict[str, list[float]] = {k: [] for k in arms}
    steps: dict[str, list[float]] = {k: [] for k in arms}
    weights: dict[str, list[bytes]] = {k: [] for k in arms}
    step_flops = 0
    with tempfile.TemporaryDirectory(prefix="zg-compile-") as tmp:
        warm = build_block(layer_source(rec), kept, task.train["init"], seed)  # untimed: the process's first steps
        with BoundaryReader(store) as reader:
            warm_run = BlockTraining({**base, "max_steps": 3}, seed, Path(tempfile.mkdtemp(dir=tmp)),
                                     run_hash="bench-warm-up")
            train_block(warm, reader, start, end, warm_run)
        for r in range(a.rounds):
            for arm in arms if r % 2 == 0 else arms[::-1]:
                block = build_block(layer_source(rec), kept, task.train["init"], seed)
                layer_params = [sum(p.numel() for p in layer.parameters()) for layer in block.layers]
                step_flops = flops.block_train_flops(layer_params, block.body.config.hidden_size,
                                                     int(task.corpus["seq_len"]), 1, int(base["batch_size"]))
                infos: list = []
                with BoundaryReader(store) as reader:
                    train_block(block, reader, start, end, BlockTraining({**base, "compile": arm == "compiled"}, seed,
                                Path(tempfile.mkdtemp(dir=tmp)), run_hash=f"bench-{arm}", callbacks=[infos.append]))
                first[arm].append(infos[0].seconds)
                steps[arm].extend(i.seconds for i in infos[1:])
                weights[arm].append(b"".join(v.numpy().tobytes() for _, v in sorted(block.layer_state_dict().items())))
                print(f"  round {r} {arm:<8} first step {infos[0].seconds:.2f} s, then "
                      f"{statistics.median(i.seconds for i in infos[1:]) * 1e3:.1f} ms/step", flush=True)
    med = {k: statistics.median(v) for k, v in steps.items()}
    out = {"step_s": med, "first_step_s": {k: v for k, v in first.items()},
           "mfu": {k: step_flops / med[k] / peak for k in arms},
           "compiled_reproducible": len(set(weights["compiled"])) == 1,
           "eager_equals_compiled": weights["eager"][0] == weights["compiled"][0]}
    for k in arms:
        print(f"{k:<8} {1e3 * med[k]:8.1f} ms/step  MFU {100 * out['mfu'][k]:.1f}%  first steps "
              + ", ".join(f"{s:.2f} s" for s in first[k]))
    print(f"compiled rounds bitwise identical: {out['compiled_reproducible']}; "
          f"compiled weights bitwise the eager ones: {out['eager_equals_compiled']}")
    n = 150
    whole = {k: min(first[k]) + (n - 1) * med[k] for k in arms}
    print(f"compile speed-up {med['eager'] / med['compiled']:.3f} (steady step), "
          f"{whole['eager'] / whole['compiled']:.3f} over a {n}-step block (warm cache)", flush=True)
    return out


if __name__ == "__main__":
    main()
