"""What a training task costs, predicted from shapes (see :mod:`zgcore.evaluation.plan_costs` for the
model of memory): a block trained alone (TrainBlock), a whole student distilled end to end (Heal,
DistillE2E), and local learning's models trained from scratch (PretrainLocal) and scored
(EvaluateLocal). FLOPs from :mod:`zgcore.evaluation.flops`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from zgcore.evaluation import flops
from zgcore.evaluation.plan_costs import (
    ACT_D,
    ACT_I,
    DTYPE_BYTES,
    SMALL_FILE,
    Context,
    Cost,
    _act_scale,
    _boundaries,
    _score,
    _student_layers,
    element_bytes,
)
from zgcore.evaluation.plan_shape import ModelShape, student_shape
from zgcore.data.order import total_steps  # the training loop's own count (imports no torch)


def _training_memory(params: int, tokens_per_step: int, layers: int, shape: ModelShape, ctx: Context) -> dict[str, int]:
    act = tokens_per_step * layers * (ACT_D * shape.width + ACT_I * shape.intermediate) * 4 * _act_scale(ctx)
    return {"weights": 4 * params, "optimizer": 12 * params, "activations": int(act)}


def train_block(p: Mapping[str, Any], ctx: Context) -> Cost:
    """TrainBlock: one block's steps, reading ``batch_size`` input and target boundaries a step."""
    from zgcore.models.shapes import n_kept

    t, tr, T = ctx.teacher, p["train"], int(p["corpus"]["seq_len"])
    bs = _boundaries(p["boundary"], t.n_layers)
    start, end = bs[int(p["block"])], bs[int(p["block"]) + 1]
    n = n_kept(start, end, tr)
    stu = student_shape(t, n, tr.get("intermediate_size"), tr.get("kv_heads"))
    steps, batch = total_steps(ctx.n_train, tr), int(tr["batch_size"])
    P = sum(stu.layers)
    mem = _training_memory(P, batch * T, n, stu, ctx)
    ahead = int(tr.get("prefetch") or 0) + 1
    step_bytes = int(2 * batch * T * t.width * 4)  # input and target, float32
    mem["buffers"] = 4 * P + ahead * step_bytes * (2 if ctx.accelerator else 1) + 3 * step_bytes
    read = steps * int(2 * batch * T * t.width * element_bytes(p["boundary"]))
    work = flops.block_train_flops(list(stu.layers), t.width, T, steps, batch)
    wbytes = DTYPE_BYTES[str(p["boundary"].get("teacher_dtype", "float32"))]
    if tr["targets"] == "online":
        mem["weights"] += wbytes * (sum(t.layers[:end]) + t.embed)
        work += steps * batch * T * flops.layers_forward(t.layers[:end], T, t.width)
    if tr.get("objective") == "attention_transfer":
        mem["weights"] += 4 * sum(t.layers[start:end])
    if float(tr.get("ce_weight") or 0) or float(tr.get("mtp_weight") or 0):
        mem["weights"] += 4 * (t.embed + t.head + t.width)
        mem["activations"] += batch * T * t.vocab * 4 * 3
    # block and init weights, the final train state (weights and AdamW's moments), the loss log, the metrics
    return Cost(
        "train",
        flops=work,
        bytes_written=20 * P + 16 * 1024 + 2 * SMALL_FILE + 40 * steps,
        read=read,
        scratch=20 * P,
        memory=mem,
        host_extra=ahead * step_bytes * 2,
    )


def heal(p: Mapping[str, Any], ctx: Context) -> Cost:
    """Heal / DistillE2E: end-to-end logit distillation of a whole student, the teacher online or from a store."""
    h = p.get("heal") or p.get("distill") or {}
    t, T = ctx.teacher, int(p["corpus"]["seq_len"])
    n = _student_layers(p, ctx) if "blocks" in p and "boundary" in p else t.n_layers
    stu = student_shape(t, n)
    steps, batch = int(h.get("steps") or 1), int(h.get("batch_size", 4))
    cached = h.get("targets") == "cached"
    work = flops.heal_flops(T, t.flops_par(), stu.flops_par(), steps, batch, 0 if cached else None)["total"]
    mem = _training_memory(stu.total(), batch * T, n, stu, ctx)
    mem["activations"] += batch * T * t.vocab * 4 * 4
    if not cached:
        mem["weights"] += 4 * t.total()
    return Cost("train", flops=work, bytes_written=4 * stu.total() + 2 * 2**20, scratch=16 * stu.total(), memory=mem)


def _local_shape(p: Mapping[str, Any], ctx: Context) -> ModelShape:
    from zgcore.evaluation.plan_shape import shape_of

    m = p["setup"]["model"]
    vocab = str(m.get("vocab", "compact"))
    v = int(vocab.split(":")[1]) + 1 if vocab.startswith("top:") else ctx.teacher.vocab
    return shape_of(
        {
            "model_type": "llama",
            "hidden_size": m["hidden_size"],
            "intermediate_size": m["intermediate_size"],
            "num_hidden_layers": m["n_layers"],
            "num_attention_heads": m["n_heads"],
            "num_key_value_heads": m["n_kv_heads"],
            "vocab_size": v,
            "tie_word_embeddings": False,
        }
    )


def pretrain_local(p: Mapping[str, Any], ctx: Context) -> Cost:
    """PretrainLocal: a small Llama trained from scratch over ``train.token_budget`` tokens."""
    s, T = _local_shape(p, ctx), int(p["corpus"]["seq_len"])
    tr = p["setup"]["train"]
    tokens, batch = int(tr["token_budget"]), int(tr["batch_size"])
    work = 3 * flops.forward_flops(s.flops_par(), tokens, T)
    mem = _training_memory(s.total(), batch * T, s.n_layers, s, ctx)
    mem["activations"] += batch * T * s.vocab * 4 * 3
    return Cost("train", flops=work, bytes_written=4 * s.total() + SMALL_FILE * 4, scratch=16 * s.total(), memory=mem)


def evaluate_local(p: Mapping[str, Any], ctx: Context) -> Cost:
    """EvaluateLocal: a local-learning model's forward over the validation rows."""
    return _score(_local_shape(p, ctx), {**p, "eval": {}}, ctx, ctx.n_val)
