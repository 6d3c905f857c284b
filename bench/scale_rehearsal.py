"""The plan (``zerograph plan``) against what the real graph does at real shapes: random-weight
teachers built from the real configs of Llama-3.2-1B and Qwen2.5-1.5B (``bench/scale_configs.py``),
the boundary store in float32 and bfloat16, run through the experiment's own graph (the cache build
over ``--sequences`` sequences, ``--blocks`` TrainBlocks of ``--steps`` steps, Assemble, the scoring
tasks), each task in a process of its own, in the graph's order.

For every task it prints the predicted and the measured peak resident memory (the task process's
``ru_maxrss``), bytes written (its output folder) and seconds (the task's ``luigi.build`` inside the
process, imports excluded), predicted at this machine's probe and the MFU of
:mod:`zgcore.evaluation.accelerators`; then the largest error of each column (bytes: outputs of at
least 1 MiB). Tolerances: RSS within 15%, bytes within 2%, seconds within 25%.

    python bench/scale_rehearsal.py                               # both models, both dtypes
    python bench/scale_rehearsal.py --models Llama-3.2-1B --dtypes float32 --sequences 64 --steps 10
    python bench/scale_rehearsal.py --device cuda                 # the graph on a GPU (host RSS measured; device memory not yet)

Heavy: a 1B teacher in float32 is 5 GB, its cache build a few TFLOP. Run it nice'd on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
TOL = {"rss": 0.15, "bytes": 0.02, "seconds": 0.25}
MIN_JUDGED_BYTES = 2**20  # outputs below this (JSON records) are listed, not judged: a few hundred bytes are not 2%


def make_teacher(name: str, folder: Path) -> Path:
    """A random-weight teacher of ``name``'s real config (seed 0) with the byte tokenizer, saved once."""
    if (folder / "model.safetensors").is_file() or (folder / "model.safetensors.index.json").is_file():
        return folder
    import torch
    import transformers

    from bench.scale_configs import CONFIGS
    from zgcore.models.teacher import byte_tokenizer

    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in CONFIGS[name].items() if k != "architectures"})
    model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    tmp = folder.with_name(folder.name + ".tmp")
    model.save_pretrained(tmp, max_shard_size="20GB")
    byte_tokenizer().save_pretrained(tmp)
    tmp.rename(folder)
    return folder


def settings(teacher: Path, dtype: str, sequences: int, seq_len: int, steps: int, blocks: int, dev: str = "cpu") -> str:
    """The ``--set`` string of one rehearsal run."""
    return (
        f"teacher={teacher} device={dev} corpus.seq_len={seq_len} corpus.max_tokens={sequences * seq_len} "
        f"boundary.num_blocks={blocks} boundary.dtype={dtype} boundary.batch_size=8 train.max_steps={steps} "
        f"train.batch_size=2 train.warmup_steps=2 train.checkpoint_every=1000 train.tensorboard=false "
        f"eval.context_sequences=0 eval.extra=[] eval.batch_size=4"
    )


def graph(overrides: str, outputs: str):
    """The rehearsal's graph: ``(tasks, deps, sizes)`` as the plan lays it out."""
    import workflows
    from workflows.plan import graph_tasks

    root = workflows.RunExperiment(preset="", set=overrides, outputs=outputs)
    return graph_tasks([root.requires()], None)


def run_one(overrides: str, outputs: str, task_id: str) -> None:
    """In a child process: build the one task ``task_id`` (its inputs are built) and print its seconds."""
    import luigi

    tasks, _, _ = graph(overrides, outputs)
    task = next(t for t in tasks if t.task_id == task_id)
    t0 = time.perf_counter()
    ok = luigi.build([task], local_scheduler=True, workers=1, log_level="WARNING")
    print(json.dumps({"seconds": time.perf_counter() - t0, "ok": bool(ok and task.complete())}), flush=True)


def folder_bytes(p: Path) -> int:
    """Bytes of the files under ``p`` (0 if absent)."""
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else 0


def rehearse(name: str, dtype: str, args, rows: list[dict]) -> list[dict]:
    """Run one model and dtype task by task, appending one row per task (predicted and measured) to ``rows``."""
    from zgcore.evaluation.accelerators import device
    from workflows.plan import make_plan

    import workflows

    work = Path(args.work)
    teacher = work / "teachers" / name
    if not teacher.is_dir():  # in a process of its own: its 5-6 GB go back when it ends
        subprocess.run([sys.executable, __file__, "--make-teacher", name, "--work", args.work], check=True, cwd=ROOT)
    over = settings(teacher, dtype, args.sequences, args.seq_len, args.steps, args.blocks, args.device)
    out, dev = str(work / "outputs"), device(args.device)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ZG_PREFLIGHT": "0"}
    done_before = set()
    while True:
        root = workflows.RunExperiment(preset="", set=over, outputs=out)
        p = make_plan([root.requires()], None, dev, 1)
        todo = [t for t in p["tasks"] if not t.done and t.id not in done_before]
        if not todo:
            break
        t = todo[0]  # dependencies first; re-planned after each task (the corpus's true size once tokenised)
        proc = subprocess.Popen(
            [sys.executable, __file__, "--run-one", t.id, "--set", over, "--work", args.work],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            cwd=ROOT,
            env=env,
            text=True,
        )
        stdout = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        measured = json.loads(stdout.strip().splitlines()[-1]) if stdout.strip() else {"ok": False, "seconds": 0}
        done_before.add(t.id)
        spec = next(x for x in p["tasks"] if x.id == t.id)
        task = next(x for x in graph(over, out)[0] if x.task_id == t.id)
        row = {
            "model": name,
            "dtype": dtype,
            "task": t.name,
            "family": t.family,
            "ok": measured["ok"],
            "rss_pred": spec.host_bytes,
            "rss_meas": usage.ru_maxrss * 1024,
            "bytes_pred": spec.bytes_written,
            "bytes_meas": folder_bytes(task.out_dir),
            "s_pred": spec.seconds,
            "s_meas": measured["seconds"],
        }
        rows.append(row)
        print(line(row), flush=True)
        if args.json:  # kept row by row: a run cut short keeps what it measured
            Path(args.json).write_text(json.dumps(rows, indent=1))
        if not measured["ok"]:
            print(f"  {t.name} failed: stopping this run", flush=True)
            break
    return rows


def err(pred: float, meas: float) -> float:
    """Relative error of a prediction against a measurement."""
    return (pred - meas) / meas if meas else 0.0


def line(r: dict) -> str:
    """One row of the table (Markdown)."""
    mib = 2**20
    return (
        f"| {r['model']} | {r['dtype']} | {r['task']} | {r['rss_pred'] / mib:.0f} / {r['rss_meas'] / mib:.0f} "
        f"({err(r['rss_pred'], r['rss_meas']):+.0%}) | {r['bytes_pred'] / mib:.2f} / {r['bytes_meas'] / mib:.2f} "
        f"({err(r['bytes_pred'], r['bytes_meas']):+.1%}) | {r['s_pred']:.1f} / {r['s_meas']:.1f} "
        f"({err(r['s_pred'], r['s_meas']):+.0%}) |"
    )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="Llama-3.2-1B,Qwen2.5-1.5B")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--sequences", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--blocks", type=int, default=4, help="boundary.num_blocks (K)")
    ap.add_argument("--work", default="/tmp/zg-scale-rehearsal")
    ap.add_argument("--device", default="cpu", help="cpu | cuda: the graph's device, probed for the predictions")
    ap.add_argument("--json", default="", help="write every row here")
    ap.add_argument("--run-one", default="", help=argparse.SUPPRESS)
    ap.add_argument("--set", default="", help=argparse.SUPPRESS)
    ap.add_argument("--make-teacher", default="", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.make_teacher:
        make_teacher(a.make_teacher, Path(a.work) / "teachers" / a.make_teacher)
        return
    if a.run_one:
        run_one(a.set, str(Path(a.work) / "outputs"), a.run_one)
        return
    print("| model | storage | task | peak RSS MiB: predicted / measured | written MiB | seconds |")
    print("|---|---|---|---|---|---|")
    rows = []
    for m in a.models.split(","):
        for d in a.dtypes.split(","):
            rehearse(m, d, a, rows)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    for key, tol in (("rss", TOL["rss"]), ("bytes", TOL["bytes"]), ("s", TOL["seconds"])):
        judged = [r for r in rows if r[f"{key}_meas"] and (key != "bytes" or r["bytes_meas"] >= MIN_JUDGED_BYTES)]
        errs = [abs(err(r[f"{key}_pred"], r[f"{key}_meas"])) for r in judged]
        worst = max(errs, default=0.0)
        print(f"{key}: largest error {worst:.1%} (tolerance {tol:.0%}): {'within' if worst <= tol else 'OUTSIDE'}")


if __name__ == "__main__":
    main()
