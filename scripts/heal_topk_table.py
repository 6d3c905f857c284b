"""The table of docs/topk-distillation.md: healing SmolLM2 with full-vocabulary KD (the teacher
online) against the teacher's cached top-k logits, from finished runs of the ``heal_topk`` preset.

    .venv/bin/python scripts/heal_topk_table.py [--outputs outputs] [--seeds 0 1 2] [--ks 0 8 64]

Arm ``k = 0`` is ``heal.top_k=0 heal.targets=online``; every other ``k`` is ``heal.top_k=k
heal.targets=cached`` (the commands are in docs/topk-distillation.md). For each arm and seed it
reads the healed student's evaluation (``per_sequence_ce.json``: held-out CE in nats/token on the
test sequences and on each ``eval.extra`` text), the ``Heal`` task's ``metrics.json`` (seconds,
steps, peak resident memory of the task) and, for cached arms, the logit store's record (bytes
per token, build seconds). Then it compares the arms over the seeds the runs share
(:func:`zgcore.evaluation.compare.compare_arms`: trained configurations, the training run is the
unit, documents resampled where the scores record them, Holm-adjusted over every comparison of the
table, test and out-of-domain together) and prints Markdown with each arm's healing FLOPs
(:func:`zgcore.evaluation.flops.heal_flops`). A run that has not finished is named and skipped.

Exit status 0 when every arm of every seed was found, 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def arm_overrides(k: int, seed: int) -> str:
    """The ``--set`` string of arm ``k`` (0: full-vocabulary KD, online) at healing seed ``seed``."""
    arm = "heal.top_k=0 heal.targets=online" if k == 0 else f"heal.top_k={k} heal.targets=cached"
    return f"{arm} heal.seed={seed}"


def find(outputs: str, k: int, seed: int) -> dict | None:
    """The finished outputs of one run: ``{"scores", "heal", "store"}`` or None if any is missing."""
    from workflows.experiment import build_experiment, load_config, walk

    tasks = walk(build_experiment(load_config(overrides=arm_overrides(k, seed), preset="heal_topk"), outputs))
    by = {}
    for t in tasks:
        by.setdefault(t.get_task_family(), []).append(t)
    ev = [t for t in by.get("Evaluate", []) if int(t.heal.get("steps", 0))]
    heal = by.get("Heal", [])
    if not ev or not heal or not ev[0].complete() or not heal[0].complete():
        return None
    store = None
    if k:
        st = by["TeacherLogitStore"][0]
        store = json.loads((st.out_dir / "manifest.json").read_text())
    return {"scores": json.loads((ev[0].out_dir / "per_sequence_ce.json").read_text()),
            "heal": json.loads((heal[0].out_dir / "metrics.json").read_text()), "store": store,
            "report": json.loads((ev[0].out_dir / "report.json").read_text()), "batch_size": int(ev[0].heal["batch_size"])}


def _find(tree, key: str):
    """The first value under ``key`` anywhere in a JSON tree (the report's top-k store section), or None."""
    if isinstance(tree, dict):
        if key in tree:
            return tree[key]
        tree = list(tree.values())
    if isinstance(tree, list):
        for v in tree:
            got = _find(v, key)
            if got is not None:
                return got
    return None


def main(argv=None) -> int:
    from zgcore.evaluation.compare import compare_arms, holm, markdown
    from zgcore.evaluation.flops import heal_flops

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--outputs", default="outputs")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--ks", type=int, nargs="+", default=[0, 8, 64])
    a = p.parse_args(argv)
    runs, missing = {}, []
    for k in a.ks:
        for s in a.seeds:
            r = find(a.outputs, k, s)
            if r is None:
                missing.append(f"k={k} seed={s}")
            else:
                runs[(k, s)] = r
    if missing:
        print(f"not finished (skipped): {', '.join(missing)}", file=sys.stderr)
    name = {k: ("full vocabulary, online" if k == 0 else f"top-{k}, cached") for k in a.ks}
    print("| arm | seed | held-out CE (test) | out-of-domain CE | teacher (test, out-of-domain) | Heal s/step | "
          "Heal peak RSS (MiB) | store bytes/token | healing FLOPs |")
    print("|---|---|---|---|---|---|---|---|---|")
    parts, docs = {}, {}
    for (k, s), r in sorted(runs.items()):
        val = r["scores"]["val"]
        key = "student" if "student" in val["ce"] else sorted(val["ce"])[-1]
        ce = float(np.mean(val["ce"][key]))
        extra = {n: float(np.mean(v["ce"][key])) for n, v in r["scores"].get("extra", {}).items()}
        h = r["heal"]
        sps = float(h.get("seconds", 0)) / max(1, int(h.get("steps", 1)))
        found = _find(r["report"], "bytes_per_token") if r["store"] else None
        bpt = f"{found:.1f}" if found is not None else ""
        teacher = [float(np.mean(val["ce"]["teacher"]))] + [float(np.mean(v["ce"]["teacher"]))
                                                           for v in r["scores"].get("extra", {}).values()]
        par, st = r["report"].get("parameters"), r["store"]
        fl = heal_flops(int(r["report"]["seq_len"]), par["teacher"], par["student"], int(h["steps"]),
                        r["batch_size"], (int(st["n_train"]) + int(st["n_val"])) if st else None) if par else None
        print(f"| {name[k]} | {s} | {ce:.4f} | {', '.join(f'{v:.4f}' for v in extra.values())} | "
              f"{', '.join(f'{v:.4f}' for v in teacher)} | {sps:.2f} | "
              f"{h.get('peak_rss_mib', float('nan')):.0f} | {bpt} | {format(fl['total'], '.3e') if fl else ''} |")
        parts.setdefault("test", {}).setdefault(name[k], {})[s] = np.asarray(val["ce"][key])
        docs["test"] = val.get("documents")
        for n, v in r["scores"].get("extra", {}).items():
            parts.setdefault(n, {}).setdefault(name[k], {})[s] = np.asarray(v["ce"][key])
            docs[n] = v.get("documents")
    pairs = [(name[k], name[0]) for k in a.ks if k] + [(name[a.ks[i]], name[a.ks[j]]) for i in range(1, len(a.ks))
                                                       for j in range(i + 1, len(a.ks))]
    tables = {part: compare_arms(pairs, arms, groups=docs.get(part)) for part, arms in parts.items()}
    holm([c for cs in tables.values() for c in cs])  # in place: one family, every comparison of the table
    for part, cs in tables.items():
        print(f"\n**{part}** (unit: the training run; Holm over all {sum(map(len, tables.values()))} comparisons "
              "of this table)\n")
        print(markdown(cs))
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
