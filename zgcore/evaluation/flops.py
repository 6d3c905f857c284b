"""The one FLOPs count of ZeroGraph's phases: the training FLOPs of the distillation study's arms
(what each arm spent, beside its tokens and its student layer-token passes, so that "matched" can
name the quantity it matches), and the FLOPs of each compute phase that the model FLOPs
utilisation divides by its seconds (:mod:`zgcore.training.mfu`): the cache build, a block's
training, healing, and scoring a model.

Counting (Kaplan et al. 2020, "Scaling laws for neural language models", Table 1): a decoder
layer's forward costs ``2 P + 2 T d`` FLOPs per token (``P`` its parameters, ``T`` the sequence
length, ``d`` the width: the attention scores and their weighted sum); an LM head's forward
``2 V d``; a training step (forward and backward) three times its forward. Per arm:

* student: forward and backward of the layers it trains, and of the student's LM head where the
  loss goes through it (end-to-end distillation and healing; blockwise blocks regress hidden
  states and never run it);
* teacher: its forwards — with cached targets the cache build (every train and validation
  sequence through the teacher up to the last boundary, once; the cache serves arms (a) and (c),
  so each is charged the whole build, amortised over nothing), with online targets the forward up
  to each block's output boundary at every step, and for logit distillation (end to end,
  healing) the whole teacher and its LM head at every step.
"""
from __future__ import annotations

from typing import Any
from collections.abc import Mapping, Sequence


def model_parameters(model) -> dict[str, Any]:
    """``{"layers": [P per decoder layer], "head": LM-head parameters, "width": d}`` of a causal LM
    (``torch.nn.Module`` with ``get_output_embeddings``)."""
    from zgcore.models.adapters import adapter_for

    if hasattr(model, "flop_parameters"):  # a streamed teacher counts from its files' headers
        return model.flop_parameters(head=True)
    layers = adapter_for(model).decoder_layers(model)
    cfg = model.config.get_text_config()
    return {"layers": [int(sum(p.numel() for p in layer.parameters())) for layer in layers],
            "head": int(model.get_output_embeddings().weight.numel()), "width": int(cfg.hidden_size)}


def decoder_parameters(model) -> dict[str, Any]:
    """``{"layers": [P per decoder layer], "width": d}`` of a decoder stack with or without its LM
    head (e.g. the teacher's base model the cache build runs)."""
    from zgcore.models.adapters import adapter_for

    if hasattr(model, "flop_parameters"):
        return model.flop_parameters(head=False)
    layers = adapter_for(model).decoder_layers(model)
    return {"layers": [int(sum(p.numel() for p in layer.parameters())) for layer in layers],
            "width": int(model.config.get_text_config().hidden_size)}


def layers_forward(params: Sequence[int], seq_len: int, width: int) -> int:
    """Forward FLOPs per token of the decoder layers with ``params`` parameters each: ``sum 2 P + 2 T d``."""
    return int(sum(2 * p + 2 * seq_len * width for p in params))


def arm_flops(name: str, seq_len: int, teacher: Mapping[str, Any], student: Mapping[str, Any],
              blocks: Sequence[Mapping[str, Any]], batch_sizes: Sequence[int], e2e: Mapping[str, int] | None = None,
              heal: Mapping[str, int] | None = None, cache_sequences: int | None = None) -> dict[str, Any]:
    """One arm's training FLOPs.

    Args:
        name: ``blockwise`` | ``healed`` (blocks, then healing) | ``e2e`` | ``e2e_healed`` (end to end).
        teacher, student: :func:`model_parameters` of each.
        blocks: each TrainBlock's metrics (``start``, ``end``: teacher layers; ``kept``; ``steps``;
            ``targets``: cached | online), in block order; ``batch_sizes`` their batch sizes.
        e2e: ``{"steps", "batch_size"}`` of an end-to-end arm. heal: ``{"steps", "batch_size"}``.
        cache_sequences: sequences the cache build ran through the teacher (train + val).

    Returns:
        ``{"student", "teacher", "total"}`` (FLOPs, int) and ``"teacher_mode"`` (what the teacher term is).
    """
    T = int(seq_len)
    t_full = layers_forward(teacher["layers"], T, teacher["width"]) + 2 * teacher["head"]
    s_layers = [layers_forward([p], T, student["width"]) for p in student["layers"]]
    s_full = sum(s_layers) + 2 * student["head"]
    stu = tea = 0
    modes = []
    if name in ("blockwise", "healed"):
        at = 0
        for b, bs in zip(blocks, batch_sizes):
            n = len(b["kept"])
            tokens = int(b["steps"]) * int(bs) * T
            stu += 3 * tokens * sum(s_layers[at: at + n])
            at += n
            if b["targets"] == "online":
                tea += tokens * layers_forward(teacher["layers"][: int(b["end"])], T, teacher["width"])
        if any(b["targets"] == "cached" for b in blocks):
            last = max(int(b["end"]) for b in blocks)
            tea += int(cache_sequences or 0) * T * layers_forward(teacher["layers"][:last], T, teacher["width"])
            modes.append("cache build (whole, once)")
        if any(b["targets"] == "online" for b in blocks):
            modes.append("online forwards")
    steps = e2e if name in ("e2e", "e2e_healed") else heal if name == "healed" else None
    if steps:
        tokens = int(steps["steps"]) * int(steps["batch_size"]) * T
        stu += 3 * tokens * s_full
        tea += tokens * t_full
        modes.append("online forwards of the whole teacher and its LM head")
    return {"student": int(stu), "teacher": int(tea), "total": int(stu + tea), "teacher_mode": "; ".join(modes)}


def add_flops(arms: Sequence[dict[str, Any]], seq_len: int, blockwise: Mapping[str, Any], batch_sizes: Sequence[int],
              steps: Mapping[str, tuple[int, int]], manifest: Mapping[str, Any] | None) -> None:
    """Give every arm of a distillation study its ``flops`` (:func:`arm_flops`), in place.

    Args:
        arms: the study's arms (``name`` each). blockwise: the blockwise arm's Evaluate report
            (``parameters``, ``blocks``); nothing is added without ``parameters``.
        batch_sizes: each block's batch size. steps: ``{"e2e" | "e2e_healed" | "healed": (steps,
            batch size)}`` of the end-to-end arms and of healing. manifest: the teacher cache's
            manifest (``n_train``, ``n_val``), or None (online targets).
    """
    par = blockwise.get("parameters")
    if not par:
        return
    n_cache = int(manifest["n_train"]) + int(manifest["n_val"]) if manifest else None
    as_dict = {k: {"steps": int(n), "batch_size": int(b)} for k, (n, b) in steps.items()}
    for arm in arms:
        name = arm["name"]
        arm["flops"] = arm_flops(name, seq_len, par["teacher"], par["student"], blockwise["blocks"], batch_sizes,
                                 e2e=as_dict.get(name) if name.startswith("e2e") else None, heal=as_dict.get("healed"),
                                 cache_sequences=n_cache)


def heal_flops(seq_len: int, teacher: Mapping[str, Any] | None, student: Mapping[str, Any], steps: int, batch_size: int,
               store_sequences: int | None = None) -> dict[str, Any]:
    """Training FLOPs of healing alone (end-to-end logit distillation of an assembled student):
    the student's forward and backward through every layer and its LM head at every step; the
    teacher's whole forward and LM head at every step (``store_sequences`` None: online targets) or
    once per stored sequence (a top-k logit store of ``store_sequences`` sequences, built once).
    Same counting as :func:`arm_flops`. ``store_sequences = 0`` counts the healing run alone, its
    store already built (``teacher`` may then be None: what a healing task's own MFU divides by).
    Returns ``{"student", "teacher", "total", "teacher_mode"}``."""
    T = int(seq_len)
    t_full = layers_forward(teacher["layers"], T, teacher["width"]) + 2 * teacher["head"] if teacher else 0
    s_full = layers_forward(student["layers"], T, student["width"]) + 2 * student["head"]
    tokens = int(steps) * int(batch_size) * T
    stu = 3 * tokens * s_full
    if store_sequences is None:
        tea, mode = tokens * t_full, "online forwards of the whole teacher and its LM head"
    else:
        tea, mode = int(store_sequences) * T * t_full, "top-k logit store build (whole, once)"
    return {"student": int(stu), "teacher": int(tea), "total": int(stu + tea), "teacher_mode": mode}


def blocks_training_flops(blocks: Sequence[Mapping[str, Any]], seq_len: int) -> int:
    """Student-side training FLOPs of blocks trained alone: ``3 x steps x batch_size x seq_len x
    forward`` summed over ``blocks`` (each ``{"steps", "batch_size", "forward"}``, ``forward`` its
    forward FLOPs per token). The teacher's forwards (the boundary cache, shared by every student
    built from these blocks) are not included."""
    return int(sum(3 * int(b["steps"]) * int(b["batch_size"]) * int(seq_len) * float(b["forward"]) for b in blocks))


def forward_flops(par: Mapping[str, Any], tokens: int, seq_len: int) -> int:
    """Forward FLOPs of a whole causal LM (:func:`model_parameters` ``par``: decoder layers and LM
    head) over ``tokens`` tokens in sequences of ``seq_len``."""
    return int(tokens) * (layers_forward(par["layers"], seq_len, par["width"]) + 2 * int(par["head"]))


def scoring_flops(par: Mapping[str, Any], sequences: int, seq_len: int, context_sequences: int = 0,
                  window: int = 0) -> int:
    """FLOPs of scoring one model (:func:`model_parameters` ``par``): the CE forward over
    ``sequences`` rows of ``seq_len`` tokens, and for context use (``context_sequences`` > 0,
    :func:`zgcore.evaluation.metrics.context_use`) per sequence one more full forward and
    ``seq_len - seq_len // 2`` forwards of ``window`` tokens."""
    out = forward_flops(par, sequences * seq_len, seq_len)
    if context_sequences:
        half = seq_len - seq_len // 2
        out += context_sequences * (forward_flops(par, seq_len, seq_len) + forward_flops(par, half * window, window))
    return int(out)


def block_train_flops(layer_params: Sequence[int], width: int, seq_len: int, steps: int, batch_size: int) -> int:
    """Training FLOPs of one student block (decoder layers of ``layer_params`` parameters each):
    three forwards (forward and backward) per token over ``steps`` steps of ``batch_size`` sequences."""
    return 3 * int(steps) * int(batch_size) * int(seq_len) * layers_forward(layer_params, seq_len, width)


def cache_build_flops(teacher: Mapping[str, Any], sequences: int, seq_len: int, last: int) -> int:
    """FLOPs of the boundary cache build: ``sequences`` rows through the teacher's first ``last``
    decoder layers (never its LM head)."""
    return int(sequences) * int(seq_len) * layers_forward(teacher["layers"][: int(last)], seq_len, teacher["width"])
