"""Streaming tokenisation: peak resident memory of ``PrepareCorpus`` on a corpus 10x larger than
another, each run in a fresh subprocess (target: 10x within 1.2x of 1x).

The corpora are text files cut from the standard library's own source (``python-stdlib``):
1x = ``--mb`` MB in files of about 100 kB, 10x = ten times as many files. Each child runs the
real ``PrepareCorpus`` task (Luigi, local scheduler) into a scratch outputs folder and reports its
whole-process peak (``ru_maxrss``). For contrast, the same corpora are also tokenised all at once
in memory (``read_texts`` + ``tokenize`` + ``split``, what ``PrepareCorpus`` did before streaming).

    python bench/corpus_stream.py [--teacher tiny-llama] [--mb 3] [--buffer-tokens 1048576]

The byte-level tokenizer of the tiny teachers gives one token per byte, the most tokens per MB.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def write_corpus(folder: Path, mb: float, file_kb: int = 100) -> int:
    """Fill ``folder`` with ``mb`` MB of stdlib source in ~``file_kb`` kB text files; returns bytes."""
    from zgcore.data.sources import stdlib_files

    folder.mkdir(parents=True, exist_ok=True)
    want, total, i, buf = int(mb * 1e6), 0, 0, []
    files = stdlib_files()
    while total < want:
        for f in files:
            try:
                buf.append(f.read_text(encoding="utf-8"))
            except UnicodeDecodeError:
                continue
            if sum(map(len, buf)) >= file_kb * 1000 or total + sum(map(len, buf)) >= want:
                text = "".join(buf)
                (folder / f"part{i:05d}.txt").write_text(text)
                total, i, buf = total + len(text), i + 1, []
                if total >= want:
                    break
    return total


def child(spec: dict) -> dict:
    """Tokenise one corpus (``streaming`` through PrepareCorpus, or ``at-once`` in memory)."""
    from zgcore.data import corpus as zc
    from zgcore.config.experiment import DEFAULTS

    c = {**DEFAULTS["corpus"], "source": spec["source"], "seq_len": 128, "buffer_tokens": spec["buffer_tokens"]}
    if spec["mode"] == "streaming":
        import luigi

        from tasks.teacher import PrepareCorpus, PrepareTeacher

        luigi.build([PrepareTeacher(teacher=spec["teacher"], outputs=spec["outputs"])], local_scheduler=True,
                    log_level="WARNING")
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        task = PrepareCorpus(teacher=spec["teacher"], corpus=c, outputs=spec["outputs"])
        ok = luigi.build([task], local_scheduler=True, log_level="WARNING")
        if not ok:
            raise RuntimeError("PrepareCorpus failed")
        meta = json.loads((task.out_dir / "meta.json").read_text())
    else:
        from transformers import AutoTokenizer

        from tasks.teacher import PrepareTeacher, teacher_record

        import luigi

        pt = PrepareTeacher(teacher=spec["teacher"], outputs=spec["outputs"])
        luigi.build([pt], local_scheduler=True, log_level="WARNING")
        tok = AutoTokenizer.from_pretrained(teacher_record(pt)["path"])
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        train, val = zc.split(zc.tokenize(zc.read_texts(c), tok, 128), 0.1, 0)
        meta = {"tokens": int(train.size + val.size)}
    return {"peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "before_mib": before / 1024,
            "tokens": meta.get("tokens")}


def run_child(spec: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "TOKENIZERS_PARALLELISM": "false"}
    r = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)], cwd=REPO, env=env,
                       capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"child failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--teacher", default="tiny-llama")
    p.add_argument("--mb", type=float, default=3.0, help="size of the 1x corpus in MB (10x is ten times this)")
    p.add_argument("--buffer-tokens", type=int, default=1 << 20)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(child(json.loads(a.child))))
        return
    with tempfile.TemporaryDirectory(prefix="zg-corpus-bench-") as d:
        d = Path(d)
        sizes = {x: write_corpus(d / f"c{x}", a.mb * x) for x in (1, 10)}
        res = {}
        for mode in ("streaming", "at-once"):
            for x in (1, 10):
                spec = {"mode": mode, "teacher": a.teacher, "source": str(d / f"c{x}" / "*.txt"),
                        "buffer_tokens": a.buffer_tokens, "outputs": str(d / f"out-{mode}-{x}")}
                res[(mode, x)] = run_child(spec)
    print(f"teacher {a.teacher}, buffer {a.buffer_tokens} tokens; corpora {sizes[1] / 1e6:.1f} MB (1x) "
          f"and {sizes[10] / 1e6:.1f} MB (10x)")
    print(f"{'mode':<10} {'tokens 1x':>11} {'tokens 10x':>11} {'peak 1x MiB':>12} {'peak 10x MiB':>13} {'10x/1x':>7}")
    for mode in ("streaming", "at-once"):
        one, ten = res[(mode, 1)], res[(mode, 10)]
        print(f"{mode:<10} {one['tokens']:>11} {ten['tokens']:>11} {one['peak_mib']:>12.0f} {ten['peak_mib']:>13.0f} "
              f"{ten['peak_mib'] / one['peak_mib']:>7.2f}")
    ratio = res[("streaming", 10)]["peak_mib"] / res[("streaming", 1)]["peak_mib"]
    print(f"PrepareCorpus peak RSS 10x / 1x = {ratio:.2f} (target <= 1.2): {'met' if ratio <= 1.2 else 'NOT met'}")


if __name__ == "__main__":
    main()
