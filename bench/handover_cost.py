"""What taking one batch from the prefetch workers costs the consumer, per batch, with worker
processes and with worker threads: a consumer that sleeps ``step`` per batch (as a training thread
waiting on an accelerator) times each ``next()`` on batches already made (two float32 tensors of
8 x 256 x 576, SmolLM2's width); the first ``--skip`` batches (each worker buffer's first trip, its
file descriptor fetched once) are printed apart. One worker, ``ahead`` 2.

    .venv/bin/python bench/handover_cost.py            # steps of 2 and 20 ms, 250 batches each
"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402

from zgcore.data.feed import prefetch  # noqa: E402


def source(worker: int, workers: int):
    """Ready-made batches: the cost measured is the hand-over's, not a read's."""
    x, y = torch.zeros(8, 256, 576), torch.zeros(8, 256, 576)
    for _ in range(worker, 100_000, workers):
        yield x.clone(), y.clone()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, default=250)
    p.add_argument("--skip", type=int, default=30)
    p.add_argument("--steps-ms", type=float, nargs="+", default=[2.0, 20.0])
    a = p.parse_args(argv)
    for mode in ("process", "thread"):
        for step_ms in a.steps_ms:
            it = prefetch(source, 2, workers=1, mode=mode)
            next(it)
            ts = []
            for _ in range(a.batches):
                time.sleep(step_ms / 1e3)
                t = time.perf_counter()
                b = next(it)
                ts.append(time.perf_counter() - t)
                del b
            it.close()
            first, rest = ts[: a.skip], sorted(ts[a.skip:])
            print(f"{mode:7s} step {step_ms:g} ms: per batch median {1e3 * rest[len(rest) // 2]:.3f} ms, "
                  f"mean {1e3 * sum(rest) / len(rest):.3f}, p90 {1e3 * rest[int(0.9 * len(rest))]:.3f} "
                  f"(first {a.skip}: mean {1e3 * sum(first) / len(first):.3f})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
