"""Decode speed and decode memory of converted students against their teacher, in one run
(docs/conversion.md): for each mixer, every teacher layer converted (untrained: speed and state
size do not depend on the weights' values). Per model and context, the prompt of ``context``
tokens is prefilled once; each repeat then decodes ``new`` tokens greedily, one forward call per
token, from its own copy of that state; decode tokens/s = ``new`` / the best repeat's time (the
prefill is not timed), and the cache's bytes after decoding. Figures: each student's tokens/s
divided by the teacher's at the same context, the models alternated in the same process; each
prompt's prefill time (s, one run) and its ratio to the teacher's.

    python bench/decode.py --quick                                  # tiny-llama, contexts 64 and 128
    python bench/decode.py --teacher smollm2-135m --contexts 512 4096 --new 64 --json decode.json
    python bench/decode.py --mixers linear_window --hybrid linear_window linear_window softmax   # the library's pick

``--hybrid M1 M2 ...`` adds a student of len(M) partitions, split as the graph splits
``boundary.num_blocks`` (``zgcore.models.shapes.resolve_boundaries``), partition i converted to mixer
Mi (``softmax`` keeps the teacher's attention there), as the library's selected student is built.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def cache_bytes(cache) -> int:
    """Bytes held by a generation cache: a converted student's state, or a transformers cache's keys and values."""
    if hasattr(cache, "nbytes"):
        return int(cache.nbytes())
    return int(sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
                   if isinstance(t, __import__("torch").Tensor)))


def main() -> int:
    import torch

    from zgcore.models import teacher as zteacher
    from zgcore.models.adapters import build_block
    from zgcore.checks import ConfigError
    from zgcore.models.hetero import assemble_exact
    from zgcore.models.shapes import resolve_boundaries

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--teacher", default="smollm2-135m")
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--new", type=int, default=64, help="tokens decoded after the prompt")
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--outputs", default="outputs")
    ap.add_argument("--quick", action="store_true", help="tiny-llama, contexts 64 and 128, 16 new tokens")
    ap.add_argument("--json", default=None)
    ap.add_argument("--compare-t-by-t", action="store_true",
                    help="also time each model's forward without a cache (the T x T parallel form that training "
                         "runs on the CPU) at each context: prefill / that forward")
    from zgcore.models.hf_converted_llama import MIXERS

    ap.add_argument("--mixers", nargs="*", choices=MIXERS[1:], default=["window", "linear", "linear_window"],
                    help="uniform students to time: every layer converted to this mixer")
    ap.add_argument("--hybrid", nargs="+", default=None, metavar="MIXER", choices=MIXERS,
                    help="a student of equal partitions, one mixer each (softmax: the teacher's attention)")
    a = ap.parse_args()
    if a.quick:  # the quick settings fill what was not given explicitly
        for k, v in {"teacher": "tiny-llama", "contexts": [64, 128], "new": 16, "window": 8, "repeats": 2}.items():
            if getattr(a, k) == ap.get_default(k):
                setattr(a, k, v)
        a.outputs = a.outputs if a.outputs != ap.get_default("outputs") else tempfile.mkdtemp()
    if min(a.new, a.window, a.repeats, *a.contexts) < 1:
        ap.error("--new, --window, --repeats and every --contexts value must be at least 1")
    if a.json and not Path(a.json).resolve().parent.is_dir():
        ap.error(f"--json {a.json}: its folder does not exist")
    try:
        teacher, _tok = zteacher.load(zteacher.materialise(a.teacher, a.outputs, log=lambda *_: None))
    except ConfigError as e:
        ap.error(f"--teacher {a.teacher}: {e}")
    if max(a.contexts) + a.new > teacher.config.max_position_embeddings:
        print(f"note: {max(a.contexts)} + {a.new} tokens pass the teacher's {teacher.config.max_position_embeddings} "
              "positions; rotary positions extrapolate there", file=sys.stderr)
    n = teacher.config.num_hidden_layers
    models = {"teacher": teacher}
    for mixer in a.mixers:
        models[mixer] = assemble_exact(teacher, [build_block(teacher, list(range(n)), "teacher", 0, mixer=mixer,
                                                             window=a.window)])
    if a.hybrid:  # partitioned as the graph partitions boundary.num_blocks = len(--hybrid)
        try:
            bs = resolve_boundaries({"boundaries": None, "num_blocks": len(a.hybrid)}, n)
        except ConfigError as e:
            ap.error(f"--hybrid: {e}")
        models["hybrid:" + ",".join(a.hybrid)] = assemble_exact(teacher, [
            build_block(teacher, list(range(bs[i], bs[i + 1])), "teacher", i, mixer=m, window=a.window)
            for i, m in enumerate(a.hybrid)])

    @torch.no_grad()
    def prefill(m, prompt):
        out = m(input_ids=prompt, use_cache=True)
        cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
        return cache, out.logits[:, -1:].argmax(-1)

    @torch.no_grad()
    def decode(m, cache, token, new):
        t0 = time.perf_counter()
        for _ in range(new):
            out = m(input_ids=token, cache=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
        return time.perf_counter() - t0

    rows = []
    for ctx in a.contexts:
        prompt = torch.randint(0, teacher.config.vocab_size, (1, ctx), generator=torch.Generator().manual_seed(ctx))
        prefilled, prefill_s, t_by_t_s = {}, {}, {}
        for k, m in models.items():
            t0 = time.perf_counter()
            prefilled[k] = prefill(m, prompt)
            prefill_s[k] = time.perf_counter() - t0
            print(f"context {ctx:6d}  {k:40} prefilled in {prefill_s[k]:8.3f} s "
                  f"(x{prefill_s[k] / prefill_s['teacher']:.2f} of the teacher's)", flush=True)
            if a.compare_t_by_t:
                t0 = time.perf_counter()
                with torch.no_grad():
                    m(input_ids=prompt, use_cache=False)
                t_by_t_s[k] = time.perf_counter() - t0
                print(f"context {ctx:6d}  {k:40} forward without a cache in {t_by_t_s[k]:8.3f} s "
                      f"(prefill / that: {prefill_s[k] / t_by_t_s[k]:.2f})", flush=True)
        best = {k: float("inf") for k in models}
        nbytes = {}
        for _ in range(a.repeats):  # alternate the models so a neighbour's load hits them alike
            for k, m in models.items():
                cache, token = copy.deepcopy(prefilled[k])
                best[k] = min(best[k], decode(m, cache, token, a.new))
                nbytes[k] = cache_bytes(cache)
        for k in models:
            tps = a.new / best[k]
            rows.append({"context": ctx, "model": k, "tokens_per_s": tps, "vs_teacher": tps / (a.new / best["teacher"]),
                         "cache_bytes": nbytes[k], "prefill_s": prefill_s[k],
                         "prefill_vs_teacher": prefill_s[k] / prefill_s["teacher"],
                         **({"t_by_t_forward_s": t_by_t_s[k]} if k in t_by_t_s else {})})
            print(f"context {ctx:6d}  {k:40} {tps:9.1f} tokens/s  x{rows[-1]['vs_teacher']:.2f} of the teacher  "
                  f"cache {nbytes[k] / 2**20:10.4f} MiB", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"teacher": a.teacher, "new": a.new, "window": a.window, "hybrid": a.hybrid,
                                            "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
