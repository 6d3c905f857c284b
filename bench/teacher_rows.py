"""The price of a teacher that runs one sequence at a time: ``capture_boundaries`` over ``B``
sequences (one forward each, so a sequence's boundaries are the same bits in any batch, which keeps
cached and online targets bitwise identical on every machine) ÷ one forward over the ``B`` rows at
once (the former rule), the same rows, interleaved rounds, best of ``--rounds``. A randomly
initialised Llama of SmolLM2-135M's shape by default (30 layers, hidden 576); no download.

    .venv/bin/python bench/teacher_rows.py                 # B = 8 x 256 tokens
    .venv/bin/python bench/teacher_rows.py --quick         # 4 layers, B = 4 x 64 (seconds)

Prints ``per-sequence / batched X`` last (1.00 = free).
"""
from __future__ import annotations

import argparse
import time

import torch


def main(argv: list[str] | None = None) -> float:
    """Time both forms and print their ratio; returns it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from zgcore.models.adapters import capture_boundaries

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8, help="sequences per teacher batch (the cache build's batch_size)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="4 layers, 4 x 64 tokens")
    a = ap.parse_args(argv)
    if a.quick:  # the quick settings fill what was not given explicitly
        for k, v in {"layers": 4, "batch": 4, "seq_len": 64}.items():
            if getattr(a, k) == ap.get_default(k):
                setattr(a, k, v)
    if min(a.batch, a.seq_len, a.layers, a.rounds) < 1:
        ap.error("--batch, --seq-len, --layers and --rounds must be at least 1")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=a.layers,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=max(2048, a.seq_len),
                      tie_word_embeddings=True)
    teacher = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (a.batch, a.seq_len))

    @torch.no_grad()
    def batched():  # one forward over every row: what capture_boundaries did before
        return teacher.model(input_ids=ids, use_cache=False).last_hidden_state

    @torch.no_grad()
    def per_sequence():
        return capture_boundaries(teacher, ids, [a.layers])

    batched(), per_sequence()  # warm-up, untimed
    best = {"batched": float("inf"), "per_sequence": float("inf")}
    for _ in range(a.rounds):
        for name, f in (("batched", batched), ("per_sequence", per_sequence)):
            t0 = time.perf_counter()
            f()
            best[name] = min(best[name], time.perf_counter() - t0)
    ratio = best["per_sequence"] / best["batched"]
    print(f"{a.batch} x {a.seq_len} tokens, {a.layers} layers, {torch.get_num_threads()} thread(s): "
          f"batched {best['batched']:.3f} s, per-sequence {best['per_sequence']:.3f} s")
    print(f"per-sequence / batched {ratio:.2f}")
    return ratio


if __name__ == "__main__":
    main()
