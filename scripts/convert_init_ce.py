"""How close each token mixer starts to the teacher: held-out CE of the *untrained* converted
student, every layer of the teacher kept and converted, no training (docs/conversion.md).

    python scripts/convert_init_ce.py                           # tiny random Llama (a plumbing check)
    python scripts/convert_init_ce.py --teacher smollm2-135m --seq-len 256 --window 64 --sequences 64

Each converted layer keeps the teacher's q/k/v/o projections and rotary positions; the linear
mixers' feature maps start at the identity (zgcore.models.hf_converted_llama). The text is the
standard library's English reference (pydoc_data.topics), cut into ``--sequences`` sequences of
``--seq-len`` tokens. Prints one line per mixer: CE (nats/token) and its increase over the
teacher's; ``--json`` writes them too.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> int:
    import torch
    from pydoc_data.topics import topics

    from zgcore.models import teacher as zteacher
    from zgcore.models.adapters import build_block
    from zgcore.models.hetero import assemble_exact

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--teacher", default="tiny-llama")
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--window", type=int, default=8)
    ap.add_argument("--sequences", type=int, default=16)
    ap.add_argument("--outputs", default=None, help="where teachers are materialised (default: a temporary folder)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    out = a.outputs or tempfile.mkdtemp(prefix="convert_init-")
    model, tok = zteacher.load(zteacher.materialise(a.teacher, out, log=lambda *_: None))
    text = "\n\n".join(topics[k] for k in sorted(topics))
    ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids[0]
    n = min(a.sequences, len(ids) // a.seq_len)
    data = ids[: n * a.seq_len].view(n, a.seq_len)
    n_layers = model.config.num_hidden_layers

    @torch.no_grad()
    def ce(m) -> float:
        total = 0.0
        for row in data.split(8):
            logits = m(input_ids=row).logits[:, :-1].float()
            total += float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), row[:, 1:].reshape(-1),
                                                             reduction="sum"))
        return total / (n * (a.seq_len - 1))

    rows = {"teacher": ce(model)}
    for mixer in ("softmax", "window", "linear_window", "linear", "none"):
        block = build_block(model, list(range(n_layers)), "teacher", 0, mixer=mixer, window=a.window)
        rows[mixer] = ce(assemble_exact(model, [block]))
    for k, v in rows.items():
        print(f"{k:14} CE {v:.4f} nats/token  ({v - rows['teacher']:+.4f} over the teacher)")
    if a.json:
        Path(a.json).write_text(json.dumps({"teacher": a.teacher, "seq_len": a.seq_len, "window": a.window,
                                            "sequences": n, "ce": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
