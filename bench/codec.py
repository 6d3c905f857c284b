"""Boundary codecs (``boundary.codec``, docs/storage.md): what each costs and keeps, on SmolLM2's residual stream.

    .venv/bin/python -m bench.codec                         # SmolLM2-135M-Instruct (fetched once), 16 x 256 tokens
    .venv/bin/python -m bench.codec --teacher random        # a random-weight teacher of SmolLM2's shape (no fetch)
    .venv/bin/python -m bench.codec --sequences 8 --json codec.json

Printed, every figure a ratio of two things measured in this run:

1. scale granularity (before the codecs were fixed): per-token, per-channel and per-block (32 channels)
   scales for fp8 e4m3, int8 and rotated int4, each with and without the top-8 channels kept apart: relative
   MSE over positions >= 1 and over the 8 channels of largest RMS (the massive ones);
2. per codec (and ``none`` at float32 / bfloat16): bits per element, storage against float32, relative MSE
   per boundary and the massive channels' own, build (teacher forward + encode, check, write, checksum) over
   the forward alone, reader throughput in decoded elements/s against bfloat16 (the read alone, and read plus
   decode), and the decode's share of a training step of a default-experiment block (8 of 10 layers, fwd+bwd)
   at the same batch.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from zgcore.data.boundary_store import BoundaryReader, join_shards, write_shard
from zgcore.data.boundary_store.codec import FP8_MAX, _signs, hadamard, make, rotation_block
from zgcore.models.adapters import build_block, capture_boundaries

from .common import load_teacher, log, token_rows

BOUNDARIES = [0, 10, 20, 30]  # the default experiment's (K = 3 of SmolLM2's 30 layers)
MASSIVE = 8  # channels of largest RMS counted as the massive ones


def random_smollm2():
    """A random-weight Llama of SmolLM2-135M's shape (byte vocabulary)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=260,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    )
    return AutoModelForCausalLM.from_config(cfg).eval().requires_grad_(False)


def quantize(x: torch.Tensor, kind: str, gran: str, keep: int = 0, block: int = 32) -> torch.Tensor:
    """``x`` float32 ``[n, t, H]`` through ``kind`` (fp8 / int8 / int4 after the randomized Hadamard) at scale
    granularity ``gran`` (token / channel / block of ``block`` channels per token), ``keep`` channels exact."""
    n, t, hdim = x.shape
    y = x.clone()
    if keep:
        idx = x.pow(2).sum(1).topk(keep, dim=1).indices[:, None, :].expand(n, t, keep)
        y.scatter_(2, idx, 0.0)
    if kind == "int4":
        y = hadamard(y * _signs(hdim, y.device), rotation_block(hdim))
    if gran == "token":
        amax = y.abs().amax(2, keepdim=True)
    elif gran == "channel":
        amax = y.abs().amax(1, keepdim=True)
    else:
        amax = y.view(n, t, hdim // block, block).abs().amax(3, keepdim=True).expand(n, t, hdim // block, block)
        amax = amax.reshape(n, t, hdim)
    qmax = {"fp8": FP8_MAX, "int8": 127, "int4": 7}[kind]
    s = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    if kind == "fp8":
        q = (y / s).clamp(-qmax, qmax).to(torch.float8_e4m3fn).float() * s
    else:
        q = torch.round(y / s).clamp(-qmax, qmax) * s
    if kind == "int4":
        q = hadamard(q, rotation_block(hdim)) * _signs(hdim, q.device)
    if keep:
        q.scatter_(2, idx, x.gather(2, idx))
    return q


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).pow(2).mean() / b.pow(2).mean())


def granularity(caps: dict[int, torch.Tensor]) -> list[dict]:
    """Figure 1: relative MSE of every kind x granularity x keep, over boundaries > 0 (positions >= 1)."""
    rows = []
    for kind in ("fp8", "int8", "int4"):
        for keep in (0, MASSIVE):
            for gran in ("token", "channel", "block"):
                errs, massive = [], []
                for b, h in caps.items():
                    if b == 0:
                        continue
                    x = h[:, 1:]
                    top = x.pow(2).mean((0, 1)).topk(MASSIVE).indices
                    q = quantize(x, kind, gran, keep)
                    errs.append(rel(q, x))
                    massive.append(rel(q[..., top], x[..., top]))
                rows.append(
                    {
                        "kind": kind,
                        "keep": keep,
                        "scale": gran,
                        "rel_mse": float(np.mean(errs)),
                        "massive_rel_mse": float(np.mean(massive)),
                    }
                )
    return rows


def build(folder: Path, teacher, caps, rows, spec) -> tuple[Path, float]:
    """A one-shard store of ``caps`` written by the store's writer (replaying the captured boundaries): its
    path and the write's seconds (encode, finiteness check, HDF5 write, checksums, records)."""
    dtype, name = spec
    sd = folder / "shard"
    sd.mkdir(parents=True)
    k = [0]

    def replay(ids):
        out = {b: h[k[0] : k[0] + len(ids)] for b, h in caps.items()}
        k[0] += len(ids)
        return out

    t0 = time.perf_counter()
    write_shard(
        sd,
        teacher,
        rows,
        "train",
        0,
        list(caps),
        dtype,
        8,
        {},
        capture=replay,
        codec=None if name == "none" else {"name": name, "keep": MASSIVE},
    )
    seconds = time.perf_counter() - t0
    join_shards(folder, [sd], {"train": len(rows), "val": 0}, {})
    return folder, seconds


def reader_rate(path: Path, b: int, n: int, batch: int, repeats: int, decode: bool) -> float:
    """Decoded elements per second of reading every sequence in batches (and widening / decoding them)."""
    with BoundaryReader(path) as r:
        r.read("train", b, np.arange(min(batch, n)))  # opens the file (checked once), untimed
        elems = n * int(r.manifest["seq_len"]) * int(r.manifest["hidden_size"])
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            for lo in range(0, n, batch):
                x = r.read("train", b, np.arange(lo, min(n, lo + batch)))
                if decode:
                    r.widen(x)
            best = min(best, time.perf_counter() - t0)
    return elems / best


def step_seconds(teacher, x: torch.Tensor, y: torch.Tensor, repeats: int) -> float:
    """One training step (forward, loss, backward) of a default-experiment block (8 of layers 0-9) on ``x``."""
    block = build_block(teacher, [0, 1, 2, 4, 5, 6, 7, 9], "teacher", 0)
    best = float("inf")
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        loss = torch.nn.functional.mse_loss(block(x), y)
        loss.backward()
        if i:
            best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--teacher", default="smollm2-135m", help="smollm2-135m (fetched once into --outputs) or random")
    ap.add_argument("--outputs", default="outputs")
    ap.add_argument("--sequences", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4, help="sequences per read and per training step")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    if a.teacher == "random":
        teacher = random_smollm2()
        rows = np.random.default_rng(0).integers(0, 256, (a.sequences, a.seq_len)).astype(np.int32)
    else:
        _, teacher, tok = load_teacher(a.teacher, a.outputs)
        rows = token_rows(tok, a.seq_len, a.sequences)[: a.sequences]
    ids = torch.from_numpy(rows.astype(np.int64))
    log(f"teacher {a.teacher}: {a.sequences} x {a.seq_len} tokens, boundaries {BOUNDARIES}")
    capture_boundaries(teacher, ids[:1], BOUNDARIES)  # warm-up
    t0, caps = time.perf_counter(), {b: [] for b in BOUNDARIES}
    for lo in range(0, len(ids), 8):
        for b, h in capture_boundaries(teacher, ids[lo : lo + 8], BOUNDARIES).items():
            caps[b].append(h)
    forward_s = time.perf_counter() - t0
    caps = {b: torch.cat(v) for b, v in caps.items()}
    out = {
        "teacher": a.teacher,
        "sequences": a.sequences,
        "seq_len": a.seq_len,
        "forward_s": forward_s,
        "granularity": granularity(caps),
        "codecs": [],
    }
    print("\nscale granularity (positions >= 1, boundaries 10/20/30): relative MSE, massive channels' relative MSE")
    for r in out["granularity"]:
        print(f"  {r['kind']:5s} keep {r['keep']}  per-{r['scale']:8s} {r['rel_mse']:.2e}  {r['massive_rel_mse']:.2e}")
    bf16_rate = None
    x_step = caps[0][: a.batch].clone()
    step_s = step_seconds(teacher, x_step, caps[10][: a.batch], a.repeats)
    with tempfile.TemporaryDirectory() as d:
        for spec in (
            ("float32", "none"),
            ("bfloat16", "none"),
            ("float32", "fp8"),
            ("float32", "int8"),
            ("float32", "int4"),
        ):
            path, write_s = build(Path(d) / "-".join(spec), teacher, caps, rows, spec)
            with BoundaryReader(path) as r:
                got = {b: r.widen(r.read("train", b, np.arange(a.sequences))) for b in BOUNDARIES}
                codes = r.read("train", 10, np.arange(a.batch)).clone()
                decode = lambda t, r=r: r.widen(t)
                best = float("inf")
                for _ in range(a.repeats):
                    t0 = time.perf_counter()
                    decode(codes), decode(codes)  # x and y of one step
                    best = min(best, time.perf_counter() - t0)
            c = make(spec[1], a.seq_len, int(teacher.config.hidden_size), MASSIVE)
            bits = 32.0 if spec == ("float32", "none") else 16.0 if c is None else c.bits
            errs = {}
            for b in BOUNDARIES:
                x, g = caps[b][:, 1:], got[b][:, 1:]
                top = x.pow(2).mean((0, 1)).topk(MASSIVE).indices
                errs[b] = {
                    "rel_mse": rel(g, x),
                    "massive_rel_mse": rel(g[..., top], x[..., top]),
                    "pos0_rel_mse": rel(got[b][:, 0], caps[b][:, 0]),
                }
            rate = reader_rate(path, 10, a.sequences, a.batch, a.repeats, decode=False)
            rate_dec = reader_rate(path, 10, a.sequences, a.batch, a.repeats, decode=True)
            if spec[0] == "bfloat16":
                bf16_rate = (rate, rate_dec)
            out["codecs"].append(
                {
                    "codec": spec[1] if spec[1] != "none" else f"none ({spec[0]})",
                    "bits": bits,
                    "storage_vs_float32": bits / 32,
                    "build_vs_forward": (forward_s + write_s) / forward_s,
                    "errors": errs,
                    "read_elems_s": rate,
                    "read_decode_elems_s": rate_dec,
                    "decode_share_of_step": best / step_s,
                }
            )
    print(
        f"\nper codec (a step of 8 layers at {a.batch} x {a.seq_len} tokens: {step_s:.2f} s; forward alone "
        f"{forward_s:.1f} s)"
    )
    print(
        "  codec            bits  vs fp32  build/fwd  rel MSE b10/b20/b30            massive b10/b20/b30           "
        "read/bf16  read+decode/bf16  decode/step"
    )
    for r in out["codecs"]:
        r["read_vs_bf16"], r["read_decode_vs_bf16"] = (
            r["read_elems_s"] / bf16_rate[0],
            r["read_decode_elems_s"] / bf16_rate[1],
        )
        e = r["errors"]
        print(
            f"  {r['codec']:15s} {r['bits']:5.2f}  {r['storage_vs_float32']:.3f}    {r['build_vs_forward']:.3f}    "
            + " ".join(f"{e[b]['rel_mse']:.1e}" for b in BOUNDARIES[1:])
            + "    "
            + " ".join(f"{e[b]['massive_rel_mse']:.1e}" for b in BOUNDARIES[1:])
            + f"      {r['read_vs_bf16']:.2f}      {r['read_decode_vs_bf16']:.2f}"
            + f"          {100 * r['decode_share_of_step']:.2f}%"
        )
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
