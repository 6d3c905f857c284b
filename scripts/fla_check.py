"""Check flash-linear-attention's kernel against our PyTorch form, on a GPU: the parallel form of the
``linear`` and ``linear_window`` mixers (:mod:`zgcore.models.hf_converted_llama`) with ``kernel="fla"``
(fla's ``chunk_linear_attn``, plus banded softmax terms) and ``kernel="torch"`` (the ``T x T`` form
the CPU runs), on SmolLM2-135M's attention shape (9 heads, 3 key-value heads, head_dim 64, window
64), the same inputs and feature maps.

    python scripts/fla_check.py                     # B = 2, T = 512, 2048, 4096
    python scripts/fla_check.py --lengths 256       # quicker

Prints, per mixer and length: the largest output difference relative to the output's largest
value, the same for the gradients of q, k, v and the feature maps, each form's time per forward +
backward and its peak memory, ``fla / torch`` ratios, and the fla path's output under bf16 autocast
(as training on CUDA runs it) against float32. Exits 1 when a difference exceeds ``--tol`` (default
5e-3: fla's kernels may multiply in TF32) or the bf16 one ``--tol-bf16`` (5e-2) or is not finite,
2 without CUDA, 3 without fla.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def mixer(kind: str, device: str):
    """A ``ZGMixer`` of SmolLM2-135M's attention shape with perturbed feature maps (seed 0)."""
    from transformers import LlamaConfig

    from zgcore.models.hf_converted_llama import ZGMixer

    cfg = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3)
    torch.manual_seed(0)
    m = ZGMixer(cfg, 0, kind, window=64)
    with torch.no_grad():
        m.feature_q.add_(0.3 * torch.randn_like(m.feature_q))
        m.feature_k.add_(0.3 * torch.randn_like(m.feature_k))
    return m.to(device)


def run(m, kernel: str, q, k, v):
    """``(output, {name: grad}, seconds, peak bytes)`` of one forward + backward with ``kernel``."""
    m.kernel = kernel
    m.zero_grad()
    qkv = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    y = m.parallel(*qkv)
    y.pow(2).mean().backward()
    torch.cuda.synchronize()
    sec = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() - base
    grads = {"q": qkv[0].grad, "k": qkv[1].grad, "v": qkv[2].grad,
             "feature_q": m.feature_q.grad.clone(), "feature_k": m.feature_k.grad.clone()}
    return y.detach(), grads, sec, peak


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def main(argv: list[str] | None = None) -> int:
    """Run the check; returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 4096])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--tol", type=float, default=5e-3)
    ap.add_argument("--tol-bf16", type=float, default=5e-2, help="the fla path under bf16 autocast vs float32 torch")
    ap.add_argument("--json", help="also write the figures here")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: fla's kernels run only on a GPU; nothing checked")
        return 2
    from zgcore.models.hf_linear_attention import fla_linear_attn

    if fla_linear_attn() is None:
        print("flash-linear-attention (with Triton) is not importable: pip install flash-linear-attention")
        return 3
    import fla

    print(f"torch {torch.__version__}, fla {getattr(fla, '__version__', '?')}, {torch.cuda.get_device_name(0)}")
    rows, worst, bad_bf16 = [], 0.0, False
    for kind in ("linear", "linear_window"):
        m = mixer(kind, "cuda")
        for t in a.lengths:
            g = torch.Generator(device="cuda").manual_seed(t)
            q = torch.randn(a.batch, 9, t, 64, device="cuda", generator=g)
            k = torch.randn(a.batch, 3, t, 64, device="cuda", generator=g)
            v = torch.randn(a.batch, 3, t, 64, device="cuda", generator=g)
            run(m, "fla", q, k, v)  # warm-up: Triton compiles
            yf, gf, sf, pf = run(m, "fla", q, k, v)
            yt, gt, st, pt = run(m, "torch", q, k, v)
            diff = {"output": rel(yf, yt), **{f"grad {n}": rel(gf[n], gt[n]) for n in gt}}
            worst = max(worst, *(x if math.isfinite(x) else math.inf for x in diff.values()))  # a NaN fails
            with torch.autocast("cuda", dtype=torch.bfloat16):  # as training on CUDA runs it
                yb, _, _, _ = run(m, "fla", q.bfloat16(), k.bfloat16(), v.bfloat16())
            bf16 = rel(yb.float(), yt) if torch.isfinite(yb).all() else float("inf")
            bad_bf16 = bad_bf16 or not bf16 <= a.tol_bf16
            row = {"mixer": kind, "length": t, "batch": a.batch, **diff, "bf16_autocast_output": bf16, "fla_s": sf, "torch_s": st,
                   "fla_peak_mib": pf / 2**20, "torch_peak_mib": pt / 2**20,
                   "time_fla_over_torch": sf / st, "memory_fla_over_torch": pf / max(pt, 1)}
            rows.append(row)
            print(f"{kind:13s} T={t:5d}: output {diff['output']:.1e}, grads max "
                  f"{max(v for n, v in diff.items() if n != 'output'):.1e}, bf16 autocast output {bf16:.1e} (relative); "
                  f"time fla/torch {sf / st:.2f} ({sf * 1e3:.1f} / {st * 1e3:.1f} ms), "
                  f"peak memory fla/torch {pf / max(pt, 1):.2f} ({pf / 2**20:.0f} / {pt / 2**20:.0f} MiB)")
            del q, k, v
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    ok = worst <= a.tol and not bad_bf16
    print(f"largest relative difference {worst:.1e}: {'within' if worst <= a.tol else 'ABOVE'} tolerance {a.tol:g}; "
          f"bf16 autocast {'ABOVE' if bad_bf16 else 'within'} {a.tol_bf16:g}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
