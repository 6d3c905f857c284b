"""What one process per block buys local learning: ``pipeline`` against ``per_block`` at the same threads.

For each K, on the same random token ids and settings:

* ``per_block``: one process with K torch threads (:func:`zgcore.local.train_local`), in a fresh
  spawned process so that its peak resident memory is its own;
* ``pipeline`` sync and async: K processes with one thread each (:func:`zgcore.local.pipeline.train_pipeline`).

It prints tokens/s of each at its steady pace (tokens of a step over the median step time; for a
pipeline the median of its slowest stage: warm-up steps and process start-up excluded), the ratio pipeline /
per_block, each stage's training state (weights, gradients, AdamW moments: what K processes split)
against the single process's, each stage's peak resident memory while it trains (a stage builds the whole model first,
for its initial bits, and frees the other blocks: that peak is reset away, and so is the single
process's build) against the single process's (and an idle interpreter with the same imports
with torch and transformers imported, the floor every process pays), each stage's idle share
(seconds waiting for input or for the next stage, over its loop's seconds: the bubble), and the
*balance bound*: the sum over stages of their busy seconds over the largest one, the speed-up K
devices would give if messages were free and the stages never waited. On CPU the stages share the
memory bus and caches, so the measured ratio is the floor of what a device per block gives. At the
CPU presets' sizes the resident memory is the runtime's floor (libraries, kernels, allocator), the
same in every process: the training state and, on CUDA, each stage's ``cuda_peak_bytes`` in the
run's metrics are the figures that show the split.

K is skipped where this process may use fewer than K cores (it would measure time-sharing).

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m bench.local_pipeline --smoke                 # seconds: tiny model, K=2
    OMP_NUM_THREADS=1 PYTHONPATH=. python -m bench.local_pipeline --k 2 4 --steps 60      # the figures (idle machine)
"""
from __future__ import annotations

import argparse
import multiprocessing
import tempfile
from pathlib import Path

import numpy as np
import torch

from zgcore import local as zl
from zgcore.local.stage import peak_rss
from zgcore.threads import usable_cores

MODELS = {  # name: (model section, vocabulary size, sequence length, batch size)
    "tiny": ({"n_layers": 4, "hidden_size": 32, "intermediate_size": 64, "n_heads": 4, "n_kv_heads": 2,
              "rope_theta": 10000.0, "vocab": "compact"}, 64, 32, 4),
    "cpu_5seed": ({"n_layers": 8, "hidden_size": 32, "intermediate_size": 96, "n_heads": 4, "n_kv_heads": 2,
                   "rope_theta": 10000.0, "vocab": "top:1024"}, 1025, 128, 16),
    "cpu_2tpp": ({"n_layers": 8, "hidden_size": 64, "intermediate_size": 192, "n_heads": 4, "n_kv_heads": 2,
                  "rope_theta": 10000.0, "vocab": "top:2048"}, 2049, 128, 16),
}


def setup(model: str, k: int, steps: int, execution: str, sync: bool = True) -> tuple[dict, int, np.ndarray]:
    """A normalised configuration (MLP heads), its vocabulary size and random token ids ``[256, T]``."""
    m, vocab, seq, bsz = MODELS[model]
    train = {**zl.LOCAL_DEFAULTS["train"], "token_budget": steps * bsz * seq, "batch_size": bsz, "warmup_steps": 2,
             "lr": 3e-3, "execution": execution, "pipeline_sync": sync}
    run = zl.normalise_run({"model": dict(m), "train": train, "local": {**zl.LOCAL_DEFAULTS["local"], "K": k}})
    return run, vocab, np.random.default_rng(0).integers(0, vocab, (256, seq)).astype(np.int64)


def _idle_rss(_: int) -> int:
    import transformers  # noqa: F401 (what every stage and the single process import)

    import zgcore.local.pipeline  # noqa: F401
    return peak_rss()


def _per_block(args: tuple[str, int, int]) -> dict:
    model, k, steps = args
    torch.set_num_threads(k)
    run, vocab, tokens = setup(model, k, steps, "per_block")
    lm = zl.build_local(run, vocab, tokens.shape[1])
    peak_rss(reset=True)  # as in a stage: from training on
    secs: list[float] = []
    m = zl.train_local(lm, tokens, {**run["train"], "log_every": 10 ** 6, "checkpoint_every": 0},
                       callbacks=[lambda info: secs.append(info.seconds)])
    return {"tokens_per_second": m["tokens"] / m["steps"] / float(np.median(secs)), "peak_rss_bytes": peak_rss(),
            "threads": torch.get_num_threads()}


def pipeline(model: str, k: int, steps: int, sync: bool) -> dict:
    """One pipelined run with one thread per stage; :func:`train_pipeline`'s metrics."""
    run, vocab, tokens = setup(model, k, steps, "pipeline", sync)
    lm = zl.build_local(run, vocab, tokens.shape[1])
    from zgcore.local.pipeline import train_pipeline

    with tempfile.TemporaryDirectory() as work:
        return train_pipeline(lm, tokens, run, {**run["train"], "log_every": 10 ** 6, "checkpoint_every": 0},
                              work=Path(work), threads=1)


def state_bytes(model: str, k: int) -> list[int]:
    """Bytes of each block's training state (float32 weights, gradients and AdamW's two moments:
    16 bytes per parameter), the part of a process's memory that K processes split; the single
    process holds their sum."""
    run, vocab, tokens = setup(model, k, 1, "per_block")
    lm = zl.build_local(run, vocab, tokens.shape[1])
    return [16 * sum(p.numel() for p in lm.block_params(j)) for j in range(k)]


def mib(b: float) -> str:
    """Bytes as whole MiB, for the printout."""
    return f"{b / 2 ** 20:.1f} MiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="cpu_5seed")
    ap.add_argument("--k", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--smoke", action="store_true", help="the smallest setting: tiny model, K=2, 6 steps")
    args = ap.parse_args()
    if args.smoke:
        args.model, args.k, args.steps = "tiny", [2], 6
    cores = usable_cores()
    spawn = multiprocessing.get_context("spawn")
    with spawn.Pool(1) as pool:
        idle = pool.map(_idle_rss, [0])[0]
    print(f"model {args.model}, {args.steps} steps, {cores} usable core(s); an idle interpreter with torch, transformers "
          f"and zgcore.local imported: {mib(idle)} peak resident")
    for k in args.k:
        if k > cores:
            print(f"K={k}: skipped, this process may use {cores} core(s) (K stages need K)")
            continue
        with spawn.Pool(1) as pool:
            ref = pool.map(_per_block, [(args.model, k, args.steps)])[0]
        print(f"\nK={k}  per_block, 1 process x {ref['threads']} threads: {ref['tokens_per_second']:.0f} tokens/s, "
              f"peak {mib(ref['peak_rss_bytes'])}")
        for sync in (True, False):
            m = pipeline(args.model, k, args.steps, sync)
            busy = [s["seconds"] - s["idle_seconds"] for s in m["stages"]]
            m["tokens_per_second"] = m["tokens"] / m["steps"] / max(s["median_step_seconds"] for s in m["stages"])
            print(f"K={k}  pipeline {'sync ' if sync else 'async'}, {k} processes x 1 thread: "
                  f"{m['tokens_per_second']:.0f} tokens/s = {m['tokens_per_second'] / ref['tokens_per_second']:.2f}x per_block; "
                  f"balance bound {sum(busy) / max(busy):.2f}x (K devices, free messages); staleness max "
                  f"{[int(x) for x in m['staleness_max']]}")
            state = state_bytes(args.model, k)
            for s in m["stages"]:
                print(f"    stage {s['stage']}: training state {mib(state[s['stage']])} = "
                      f"{state[s['stage']] / sum(state):.2f}x the single process's; peak {mib(s['peak_rss_bytes'])} = {s['peak_rss_bytes'] / ref['peak_rss_bytes']:.2f}x "
                      f"the single process ({(s['peak_rss_bytes'] - idle) / max(1, ref['peak_rss_bytes'] - idle):.2f}x above an idle "
                      f"interpreter); idle share {s['idle_share']:.2f}")


if __name__ == "__main__":
    main()
