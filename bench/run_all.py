"""Run every benchmark in one process and print the five figures side by side.

    python bench/run_all.py [--teacher smollm2-135m] [--tokens N] [--quick] [--json out.json]

Figures (all ratios measured in this one run):
  1. cache build time / teacher forward-only time over the same tokens       target <= 1.15
  2. cached TrainBlock step time / same step on tensors in memory            target <= 1.10
  3. online / cached TrainBlock wall time per block, and break-even reuse    target: pays off within one
     count of the cache                                                      experiment of K >= 2 blocks
  4. peak RSS of one TrainBlock / end-to-end training of the whole student   recorded
  5. how figures 1-3 (and the times behind them) move when tokens double     should stay linear

Figures 1-3 run at N tokens and again at 2N (figure 5); figure 4 at N. Scratch files go to a
temporary folder that is removed at the end (``--keep`` keeps it).
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--teacher", default=None, help="teacher spec (default smollm2-135m; tiny-llama with --quick)")
    p.add_argument("--tokens", type=int, default=None,
                   help="tokens of the base run, train+val (default 32 x seq-len, i.e. 8192; 2048 with --quick); figure 5 doubles it")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 256; 64 with --quick)")
    p.add_argument("--batch-size", type=int, default=8, help="teacher and training batch size (default 8)")
    p.add_argument("--blocks", type=int, default=3, help="K, blocks of the experiment (default 3)")
    p.add_argument("--dtype", default="float32", help="boundary storage dtype (default float32)")
    p.add_argument("--mem-steps", type=int, default=2, help="training steps of each figure-4 child (default 2)")
    p.add_argument("--outputs", default=str(REPO / "outputs"),
                   help="outputs folder holding (or to hold) the teacher; a PrepareTeacher conversion there is reused")
    p.add_argument("--workdir", default=None, help="scratch folder (default: a new temporary folder)")
    p.add_argument("--keep", action="store_true", help="keep the scratch folder")
    p.add_argument("--json", default=None, help="also write every measurement to this JSON file")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny-llama, short sequences (~1 minute)")
    p.add_argument("--verbose", action="store_true", help="show progress bars")
    a = p.parse_args(argv)
    a.teacher = a.teacher or ("tiny-llama" if a.quick else "smollm2-135m")
    a.seq_len = a.seq_len or (64 if a.quick else 256)
    a.tokens = a.tokens or 32 * a.seq_len
    return a


def main(argv=None) -> int:
    a = parse(argv)
    if not a.verbose:
        os.environ["TQDM_DISABLE"] = "1"  # read by tqdm when zgcore is imported
    import torch

    from bench import cache_build, memory, train_step
    from bench.common import dump, load_teacher, log, plan_blocks, split_tokens, token_rows, train_settings
    from safetensors.torch import save_file
    from zgcore.models.adapters import build_block
    from zgcore.training.blocks import block_seed

    t_start = time.perf_counter()
    work = Path(a.workdir or tempfile.mkdtemp(prefix="zg-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    n_seq = a.tokens // a.seq_len
    if n_seq < 2:
        raise SystemExit("--tokens must cover at least two sequences of --seq-len")
    log(f"teacher {a.teacher}; N = {n_seq} x {a.seq_len} tokens (and 2N for figure 5); batch {a.batch_size}; "
        f"K = {a.blocks}; torch {torch.__version__}, {torch.get_num_threads()} threads; scratch {work}")
    rec, teacher, tok = load_teacher(a.teacher, a.outputs)
    t = train_settings(a.batch_size)
    boundaries, kept = plan_blocks(rec["n_layers"], a.blocks, t)
    log(f"loaded in {time.perf_counter() - t_start:.0f} s: {rec['n_layers']} layers, hidden {rec['hidden_size']}; "
        f"boundaries {boundaries}; kept layers {kept}")
    rows = token_rows(tok, a.seq_len, 2 * n_seq)
    res = {"args": vars(a), "boundaries": boundaries, "kept": kept, "machine": platform.platform(),
           "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "runs": {}}
    try:
        for scale, n in (("N", n_seq), ("2N", 2 * n_seq)):
            tokens = split_tokens(rows[:n])
            log(f"[{scale}] figure 1: cache build vs forward-only over {n} sequences "
                f"({len(tokens['train'])} train + {len(tokens['val'])} val)")
            store = work / f"boundaries-{scale}"
            f1 = cache_build.measure(teacher, tokens, boundaries, a.dtype, a.batch_size, store)
            log(f"[{scale}] figure 1: build {f1['build_s']:.1f} s / forward {f1['forward_s']:.1f} s = {f1['ratio']:.3f}")
            f23 = train_step.measure(teacher, store, tokens["train"], boundaries, kept, t, a.dtype, a.batch_size,
                                     f1["build_s"], work)
            log(f"[{scale}] figure 2: {f23['fig2']['ratio']:.3f}; figure 3: {f23['fig3']['ratio']:.3f}, "
                f"break-even {f23['fig3']['break_even_experiments']:.2f} experiments")
            res["runs"][scale] = {"fig1": f1, **f23}
            if scale == "N":
                log("figure 4: peak RSS of one TrainBlock vs end-to-end, fresh subprocesses")
                init_files = []
                for i, k in enumerate(kept):
                    path = work / f"init-b{i}.safetensors"
                    save_file(build_block(teacher, k, t["init"], block_seed(int(t["seed"]), i)).layer_state_dict(), str(path))
                    init_files.append(str(path))
                res["fig4"] = memory.measure(rec, boundaries, kept, init_files, store, t, a.mem_steps, work)
            shutil.rmtree(store)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    res["total_s"] = time.perf_counter() - t_start
    print(report(res, a), flush=True)
    if a.json:
        dump(a.json, res)
    return 0


def _yes(ok: bool) -> str:
    return "yes" if ok else "NO"


def report(res: dict, a) -> str:
    N, N2 = res["runs"]["N"], res["runs"]["2N"]
    K = len(res["boundaries"]) - 1
    f4 = res["fig4"]
    L = []
    w = L.append
    w("")
    w(f"ZeroGraph benchmarks - teacher {a.teacher}, boundaries {res['boundaries']}, batch {a.batch_size}, "
      f"dtype {a.dtype}, {res['torch_threads']} torch threads, {res['cpus']} CPUs")
    w(f"N = {N['fig1']['sequences']} sequences x {a.seq_len} tokens = {N['fig1']['tokens']} tokens; "
      f"2N = {N2['fig1']['tokens']} tokens; whole run {res['total_s'] / 60:.1f} min")
    w("")
    hdr = f"{'figure':<58}{'N':>9}{'2N':>9}{'2N/N':>8}  {'target':<16}{'met'}"
    w(hdr)
    w("-" * len(hdr))

    def row(name, x, y, target="", met=""):
        finite = y is not None and 0 < x < float("inf") and y < float("inf")
        r = f"{y / x:8.2f}" if finite else f"{'-':>8}"
        w(f"{name:<58}{x:9.3f}{(y if y is not None else float('nan')):9.3f}{r}  {target:<16}{met}")

    f1n, f1d = N["fig1"]["ratio"], N2["fig1"]["ratio"]
    row("1 cache build / teacher forward-only", f1n, f1d, "<= 1.15", _yes(max(f1n, f1d) <= 1.15))
    f2n, f2d = N["fig2"]["ratio"], N2["fig2"]["ratio"]
    row("2 cached step / in-memory step (block 0)", f2n, f2d, "<= 1.10", _yes(max(f2n, f2d) <= 1.10))
    row("3 online / cached TrainBlock wall, whole experiment", N["fig3"]["ratio"], N2["fig3"]["ratio"])
    for i in range(K):
        b, b2 = N["fig3"]["blocks"][i], N2["fig3"]["blocks"][i]
        row(f"    block {i} ({b['b_in']}->{b['b_out']}, {b['layers']} layers)", b["ratio"], b2["ratio"])
    be, be2 = N["fig3"]["break_even_experiments"], N2["fig3"]["break_even_experiments"]
    row(f"  break-even reuse count (experiments of K={K} blocks)", be, be2, "<= 1 (K >= 2)", _yes(max(be, be2) <= 1))
    row("  break-even reuse count (blocks trained)", N["fig3"]["break_even_blocks"], N2["fig3"]["break_even_blocks"],
        f"<= {K}", _yes(max(N["fig3"]["break_even_blocks"], N2["fig3"]["break_even_blocks"]) <= K))
    w(f"{'4 peak RSS one TrainBlock / end-to-end student (training)':<58}{f4['ratio_training']:9.3f}{'':17}  recorded")
    w(f"{'    whole process (ru_maxrss)':<58}{f4['ratio_process']:9.3f}{'':17}  recorded")
    w(f"{'    growth during training (peak - before)':<58}{f4['ratio_increment']:9.3f}{'':17}  recorded")
    w("")
    w("5 scaling when tokens double (seconds at N, at 2N, and 2N/N; linear = 2.00):")
    lin = []

    def trow(name, x, y):
        lin.append(y / x)
        w(f"    {name:<54}{x:9.1f}{y:9.1f}{y / x:8.2f}")

    trow("teacher forward-only (figure 1)", N["fig1"]["forward_s"], N2["fig1"]["forward_s"])
    trow("cache build (figure 1)", N["fig1"]["build_s"], N2["fig1"]["build_s"])
    trow("TrainBlock from memory, block 0 (figure 2)", N["fig2"]["memory_step_s"] * N["fig2"]["steps"],
         N2["fig2"]["memory_step_s"] * N2["fig2"]["steps"])
    trow("TrainBlock cached, all blocks (figure 3)", N["fig3"]["cached_wall_s"], N2["fig3"]["cached_wall_s"])
    trow("TrainBlock online, all blocks (figure 3)", N["fig3"]["online_wall_s"], N2["fig3"]["online_wall_s"])
    w("    the figure ratios 1-3 at 2N / at N are in the 2N/N column above (constant = 1.00)")
    w("")
    w("details:")
    for s, r in (("N", N), ("2N", N2)):
        f1, f2, f3 = r["fig1"], r["fig2"], r["fig3"]
        w(f"  [{s}] build {f1['build_s']:.1f} s, forward-only {f1['forward_s']:.1f} s, store {f1['store_bytes'] / 2**20:.1f} MiB; "
          f"step {f2['cached_step_s']:.3f} s cached vs {f2['memory_step_s']:.3f} s in memory over {f2['steps']} steps "
          f"(data share of the cached step {100 * f2['cached_data_share']:.1f}%)")
        for b in f3["blocks"]:
            w(f"  [{s}] block {b['block']}: {b['steps']} steps, cached {b['cached_wall_s']:.1f} s, online {b['online_wall_s']:.1f} s "
              f"(teacher {b['online_teacher_s']:.1f} s)")
        w(f"  [{s}] cache build {f3['build_s']:.1f} s vs saving {f3['saving_per_experiment_s']:.1f} s per experiment; "
          f"blocks bitwise identical memory=cached: {_yes(f2['identical'])}, cached=online: {_yes(f3['identical'])}")
    for m in ("block", "e2e"):
        r = f4[m]
        w(f"  [4] {m:<5}: {r['layers']} layers, {r['trainable_params'] / 1e6:.1f} M trainable, {r['steps']} steps; "
          f"RSS after imports {r['imported_kb'] / 1024:.0f} MiB, before training {r['before_train_kb'] / 1024:.0f} MiB, "
          f"training peak {r['train_peak_kb'] / 1024:.0f} MiB, process peak {r['maxrss_kb'] / 1024:.0f} MiB")
    return "\n".join(L)


if __name__ == "__main__":
    sys.exit(main())
