"""A model's shape from its configuration alone, for the plan (:mod:`zgcore.evaluation.plan`): the
parameters of each decoder layer, of the embedding and of the LM head, the width and the vocabulary,
counted from a Hugging Face ``config.json`` without building the model, so a 70B teacher is planned
on a laptop. No weight file is opened, and neither torch nor transformers is imported for a local
folder or the built-in teacher.

Counting per decoder layer (the families of :mod:`zgcore.models.families`): attention
``d (H h) + 2 d (G h) + (H h) d`` (``H`` query heads, ``G`` key-value heads, ``h`` the head width),
its biases where the family has them (Qwen2, ``attention_bias``), per-head q/k norms (Qwen3,
OLMo-2), the gated MLP ``3 d I`` (GPT-2: ``2 d I`` plus biases), and the layer's norms. The result
is what :mod:`zgcore.evaluation.flops` takes: ``{"layers": [P per layer], "head": V d, "width": d}``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from collections.abc import Mapping


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only LM's sizes. ``layers``: parameters of each decoder layer; ``embed``: the token
    (and, GPT-2, position) embedding's parameters; ``head``: ``vocab x width`` (the LM head's
    FLOPs and logits, tied or not); ``untied``: the head has its own weights; ``final_norm``: the
    last norm's parameters."""

    model_type: str
    width: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    layers: tuple[int, ...]
    embed: int
    untied: bool
    final_norm: int
    config: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def head(self) -> int:
        """``vocab x width``: the LM head's weights (what its FLOPs count)."""
        return self.vocab * self.width

    @property
    def n_layers(self) -> int:
        """Decoder layers."""
        return len(self.layers)

    def flops_par(self, layers: int | None = None) -> dict[str, Any]:
        """``{"layers", "head", "width"}`` of the first ``layers`` decoder layers (all: None), as
        :func:`zgcore.evaluation.flops.model_parameters` gives them for a built model."""
        return {
            "layers": list(self.layers[: layers if layers is not None else len(self.layers)]),
            "head": self.head,
            "width": self.width,
        }

    def total(self) -> int:
        """Every parameter of the whole model (layers, embedding, untied head, final norm)."""
        return sum(self.layers) + self.embed + (self.head if self.untied else 0) + self.final_norm


def text_config(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """The text model's part of a (possibly multimodal) config: its ``text_config`` when it has one."""
    return cfg.get("text_config") or cfg


def layer_parameters(cfg: Mapping[str, Any], intermediate: int | None = None, kv_heads: int | None = None) -> int:
    """Parameters of one decoder layer of ``cfg`` (a config.json mapping), with the MLP width
    ``intermediate`` and ``kv_heads`` key-value heads when given (a student block's)."""
    c = text_config(cfg)
    mt = c.get("model_type", "llama")
    if mt == "gpt2":
        d = int(c["n_embd"])
        i = int(intermediate or c.get("n_inner") or 4 * d)
        return d * 3 * d + 3 * d + d * d + d + d * i + i + i * d + d + 4 * d
    d, h = int(c["hidden_size"]), int(c["num_attention_heads"])
    hd = int(c.get("head_dim") or d // h)
    g = int(kv_heads or c.get("num_key_value_heads") or h)
    i = int(intermediate or c["intermediate_size"])
    attn = d * h * hd + 2 * d * g * hd + h * hd * d
    if mt == "qwen2" or c.get("attention_bias"):
        attn += h * hd + 2 * g * hd + (d if c.get("attention_bias") and mt != "qwen2" else 0)
    if mt in ("qwen3", "gemma3"):
        attn += 2 * hd  # per-head q and k norms
    if mt == "olmo2":
        attn += h * hd + g * hd  # q and k norms over all heads
    mlp = 3 * d * i + (2 * i + d if c.get("mlp_bias") else 0)
    norms = 4 * d if mt in ("gemma2", "gemma3") else 2 * d
    return attn + mlp + norms


def shape_of(cfg: Mapping[str, Any]) -> ModelShape:
    """The :class:`ModelShape` of a config.json mapping."""
    c = text_config(cfg)
    mt = c.get("model_type", "llama")
    if mt == "gpt2":
        d, n, v = int(c["n_embd"]), int(c["n_layer"]), int(c["vocab_size"])
        return ModelShape(
            mt,
            d,
            int(c.get("n_inner") or 4 * d),
            int(c["n_head"]),
            int(c["n_head"]),
            d // int(c["n_head"]),
            v,
            (layer_parameters(c),) * n,
            v * d + int(c["n_positions"]) * d,
            False,
            2 * d,
            dict(c),
        )
    d, h = int(c["hidden_size"]), int(c["num_attention_heads"])
    n, v = int(c["num_hidden_layers"]), int(c["vocab_size"])
    untied = not bool(c.get("tie_word_embeddings", mt not in ("llama", "mistral", "qwen2", "qwen3", "olmo2", "phi3")))
    return ModelShape(
        mt,
        d,
        int(c["intermediate_size"]),
        h,
        int(c.get("num_key_value_heads") or h),
        int(c.get("head_dim") or d // h),
        v,
        (layer_parameters(c),) * n,
        v * d,
        untied,
        d,
        dict(c),
    )


def read_config(spec: str) -> dict[str, Any]:
    """A teacher spec's config.json mapping, reading no weight file: the built-in ``smollm2-135m``,
    a ``tiny-<family>`` (:func:`zgcore.models.teacher.tiny_config`), a local folder's
    ``config.json`` (the folder need hold nothing else), or a GGUF file's header.

    Raises:
        FileNotFoundError: a folder without ``config.json``, or a spec that is none of these
            (a Hub id: the plan does not download).
    """
    if spec == "smollm2-135m":  # fetched as a GGUF file: its shape is written down
        from zgcore.models.costs import SMOLLM2_SHAPE

        return {"model_type": "llama", **SMOLLM2_SHAPE}
    if spec.startswith("tiny-"):
        from zgcore.models.teacher import TINY_FAMILIES, tiny_config

        return tiny_config(TINY_FAMILIES[spec]).to_dict()
    p = Path(os.path.expanduser(spec))
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise FileNotFoundError(f"teacher folder {p} has no config.json")
        return json.loads((p / "config.json").read_text())
    if p.suffix == ".gguf" and p.is_file():
        from transformers import AutoConfig  # reads the GGUF header only

        return AutoConfig.from_pretrained(str(p.parent), gguf_file=p.name).to_dict()
    raise FileNotFoundError(f"teacher {spec!r}: no local config.json to plan from (the plan does not download)")


def student_shape(
    teacher: ModelShape, n_layers: int, intermediate: int | None = None, kv_heads: int | None = None
) -> ModelShape:
    """A student of ``n_layers`` decoder layers of ``teacher``'s family (MLP width
    ``intermediate`` and ``kv_heads`` when given), with the teacher's embedding and head."""
    p = layer_parameters(teacher.config, intermediate, kv_heads) if teacher.config else teacher.layers[0]
    return replace(teacher, layers=(p,) * int(n_layers))
