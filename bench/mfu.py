"""Each compute phase's model FLOPs utilisation (MFU) on one experiment: cache build, each block,
healing (when ``heal.steps`` > 0) and scoring, from the report's utilisation table (each phase's
FLOPs from :mod:`zgcore.evaluation.flops` over its seconds, against the matmul peak probed in the
process that ran it: :mod:`zgcore.training.mfu`).

    python bench/mfu.py                       # the default experiment (builds it first unless --outputs has it)
    python bench/mfu.py --preset tiny         # seconds-long smoke run
    python bench/mfu.py --outputs outputs     # read an outputs folder where the experiment is built

Prints one line per phase: ``<phase>  <seconds>  <achieved GFLOP/s>  MFU <x%>``.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> list[dict]:
    from bench.rebuild import build
    from workflows.experiment import build_experiment, load_config

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="default", help="experiment preset (default: default; tiny for a smoke run)")
    ap.add_argument("--set", default="", help="overrides, e.g. heal.steps=50")
    ap.add_argument("--outputs", default="", help="outputs folder (default: a temporary one, removed at the end)")
    a = ap.parse_args(argv)
    tmp = None if a.outputs else tempfile.TemporaryDirectory(prefix="zg-mfu-")
    outputs = a.outputs or tmp.name
    try:
        ok, _ = build(a.preset, a.set, outputs)
        if not ok:
            raise SystemExit("the experiment failed to build; see the log above")
        root = build_experiment(load_config(overrides=a.set, preset=a.preset), outputs)
        rows = json.loads((root.out_dir / "report.json").read_text())["mfu"]
    finally:
        if tmp is not None:
            tmp.cleanup()
    peak = rows[0]
    print(f"peak {peak['peak_gflops_per_second']:.1f} GFLOP/s ({peak['peak_dtype']} matmul probe)")
    for r in rows:
        rate = "-" if r["gflops_per_second"] is None else f"{r['gflops_per_second']:.2f}"
        mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        print(f"{r['phase']:<32} {r['seconds']:8.2f} s {rate:>10} GFLOP/s  MFU {mfu}", flush=True)
    return rows


if __name__ == "__main__":
    main()
