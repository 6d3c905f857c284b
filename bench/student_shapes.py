"""Student shapes before training: held-out CE of students initialised from the teacher by depth
pruning (``keep = spread`` vs ``keep = importance``) and by width pruning (MLP channels of largest
activation, all layers kept), with their parameter counts, on the default teacher and corpus.

This is the starting point of the README's importance and width comparisons (the untrained
student of each experiment); the gap recovered after training needs the full experiments
(commands in README, "Students: which layers, how wide").

    python bench/student_shapes.py [--outputs outputs] [--width 1152] [--keep-fraction 0.8]

Prepares the default teacher and corpus through the graph (``PrepareTeacher``, ``PrepareCorpus``)
in ``--outputs`` if they are not there yet, then measures on ``train.importance_sequences``
training sequences and evaluates on the whole validation split.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--outputs", default="outputs")
    p.add_argument("--width", type=int, default=1152, help="MLP width of the width-pruned student (default 75%% of 1536)")
    p.add_argument("--keep-fraction", type=float, default=0.8, help="layers kept per partition by depth pruning")
    a = p.parse_args(argv)

    import luigi

    from tasks.teacher import PrepareCorpus, PrepareTeacher, teacher_record
    from workflows.experiment import load_config
    from zgcore.data import corpus
    from zgcore.evaluation import metrics
    from zgcore.models import teacher as zteacher
    from zgcore.models.adapters import assemble, build_block
    from zgcore.config.experiment import block_train_config
    from zgcore.models.shapes import kept_layers, resolve_boundaries
    from zgcore.markdown import num, table
    from zgcore.models.channels import mlp_width
    from zgcore.models.students import measure

    cfg = load_config(preset="default")
    pt = PrepareTeacher(teacher=cfg["teacher"], outputs=a.outputs)
    pc = PrepareCorpus(teacher=cfg["teacher"], corpus=cfg["corpus"], outputs=a.outputs)
    assert luigi.build([pc], local_scheduler=True, log_level="WARNING")
    model, _tok = zteacher.load(teacher_record(pt))
    tokens = {s: corpus.read_tokens(pc.out_dir / "tokens.h5", s) for s in ("train", "val")}
    t = block_train_config(cfg, 0)
    t0 = time.perf_counter()
    m = measure(model, tokens["train"][: int(t["importance_sequences"])])
    print(f"measured {t['importance_sequences']} sequences in {time.perf_counter() - t0:.0f} s; block influence by layer: "
          + " ".join(f"{i}:{v:.3f}" for i, v in enumerate(m["influence"])), flush=True)
    bs = resolve_boundaries(cfg["boundary"], model.config.num_hidden_layers)
    parts = list(zip(bs, bs[1:]))
    depth = {**t, "keep_fraction": a.keep_fraction}
    shapes = {
        "spread": [(kept_layers(s, e, {**depth, "keep": "spread"}), None) for s, e in parts],
        "importance": [(kept_layers(s, e, {**depth, "keep": "importance"}, m["influence"]), None) for s, e in parts],
        f"width {a.width}": [(list(range(s, e)), a.width) for s, e in parts],
    }
    n_params = lambda mod: sum(x.numel() for x in mod.parameters())
    rows = [["teacher", model.config.num_hidden_layers, mlp_width(model.config), n_params(model) / 1e6,
             metrics.cross_entropy(model, tokens["val"], 8, desc="CE teacher"), "-"]]
    for name, blocks in shapes.items():
        student = assemble(model, [build_block(model, kept, "teacher", 0, intermediate_size=w, channels=m["channels"]) for kept, w in blocks])
        ce = metrics.cross_entropy(student, tokens["val"], 8, desc=f"CE {name}")
        rows.append([name, student.config.num_hidden_layers, student.config.intermediate_size, n_params(student) / 1e6, ce,
                     " ".join(str(k) for k, _ in blocks)])
        print(f"{name}: CE {ce:.4f}", flush=True)
    print(table(["student (untrained)", "layers", "MLP width", "params (M)", "held-out CE (nats/token)", "kept layers"],
                [[r[0], r[1], r[2], num(r[3], ".2f"), num(r[4], ".4f"), r[5]] for r in rows]))


if __name__ == "__main__":
    main()
