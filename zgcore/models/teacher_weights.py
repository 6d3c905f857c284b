"""Loading only the part of a teacher a task needs.

* :class:`LazyLayers` — the teacher's config plus its decoder layers' weights read one layer at a
  time, on demand, from the teacher's safetensors files (``safetensors.safe_open``: only the
  requested tensors are read). A cached-targets ``TrainBlock`` builds its block from it and never
  materialises the other layers, the embedding or the LM head. For a GGUF teacher this is the
  Hugging Face folder ``PrepareTeacher`` converted it into.
* :func:`load_base` — the teacher's base model (embedding and decoder layers, no LM head) truncated
  to its first ``n_layers`` layers, in a chosen dtype: what a boundary shard (all layers up to the
  last boundary) and online targets (up to the block's output boundary) run.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any
from collections.abc import Mapping

import torch

from zgcore.models.adapters import adapter_for, attn_implementation


class LazyLayers:
    """A teacher's config and per-layer weights, read lazily from its safetensors files.

    Args:
        record: a teacher record (:func:`zgcore.models.teacher.materialise`) whose ``path`` is a local
            Hugging Face folder with ``*.safetensors`` weights (see :func:`has_safetensors`).

    Attributes:
        config: the teacher's HF config. device: ``cpu`` (where weights are read to).
    """

    device = torch.device("cpu")

    def __init__(self, record: Mapping[str, Any]):
        from safetensors import safe_open
        from transformers import AutoConfig

        self.path = Path(record["path"])
        self.config = AutoConfig.from_pretrained(str(self.path))
        self._prefix = adapter_for(self.config).layer_prefix()
        self._where: dict[str, Path] = {}
        for f in sorted(self.path.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as g:
                for k in g.keys():
                    self._where[k] = f

    def layer_weights(self, i: int) -> dict[str, torch.Tensor]:
        """Teacher decoder layer ``i``'s weights keyed as in the layer's own ``state_dict``
        (stored dtype, CPU). Raises ``KeyError`` if the files hold no such layer."""
        from safetensors import safe_open

        pre = f"{self._prefix}{i}."
        keys = [k for k in self._where if k.startswith(pre)]
        if not keys:
            raise KeyError(f"{self.path}: no weights for decoder layer {i} (prefix {pre})")
        out = {}
        for f in sorted({self._where[k] for k in keys}):
            with safe_open(str(f), framework="pt") as g:
                for k in keys:
                    if self._where[k] == f:
                        out[k[len(pre):]] = g.get_tensor(k)
        return out


    def other_weights(self, base_only: bool = False) -> dict[str, torch.Tensor]:
        """Every tensor that belongs to no decoder layer (embedding, final norm, LM head), keyed as
        in the causal LM's ``state_dict`` (stored dtype, CPU); no layer's tensor is read.
        ``base_only``: only the base model's (no LM head)."""
        from safetensors import safe_open

        keys = self._other_keys(base_only)
        out = {}
        for f in sorted({self._where[k] for k in keys}):
            with safe_open(str(f), framework="pt") as g:
                out.update({k: g.get_tensor(k) for k in keys if self._where[k] == f})
        return out

    def _other_keys(self, base_only: bool) -> list[str]:
        base = self._prefix.split(".")[0] + "."
        return [k for k in self._where if not k.startswith(self._prefix) and (not base_only or k.startswith(base))]

    def _numel(self, keys) -> int:
        from safetensors import safe_open

        n = 0
        for f in sorted({self._where[k] for k in keys}):
            with safe_open(str(f), framework="pt") as g:
                for k in keys:
                    if self._where[k] == f:
                        shape = g.get_slice(k).get_shape()
                        n += int(torch.Size(shape).numel())
        return n

    def layer_numel(self, i: int) -> int:
        """Elements of decoder layer ``i``'s weights, from the files' headers (nothing read)."""
        return self._numel([k for k in self._where if k.startswith(f"{self._prefix}{i}.")])

    def other_numel(self, head: bool = True) -> int:
        """Elements of the weights outside the decoder layers (with ``head``, the LM head's too), from the headers."""
        return self._numel(self._other_keys(not head))


def load_head(record: Mapping[str, Any], device: str = "cpu"):
    """The teacher's causal LM with no decoder layers, float32, frozen: the embedding, final norm
    and LM head — all that :func:`zgcore.models.adapters.head_logits` needs for local auxiliary terms
    (cross-entropy, multi-token prediction). From local safetensors only those tensors are read
    (:meth:`LazyLayers.other_weights`); for other teachers (Hub id, GGUF, ``.bin``) the whole
    teacher is loaded and its layers dropped.

    Raises:
        KeyError: the safetensors files lack a weight the head needs (named).
    """
    from transformers import AutoModelForCausalLM

    from zgcore.device import resolve

    if not has_safetensors(record):
        from zgcore.models.adapters import head_only
        from zgcore.models.teacher import load

        return head_only(load(dict(record), device)[0])
    src = LazyLayers(record)
    cfg = adapter_for(src.config).sub_config(src.config, range(0), headless=False)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    missing, _ = model.load_state_dict(src.other_weights(), strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or []) if getattr(cfg, "tie_word_embeddings", False) else set()
    missing = [k for k in missing if k not in tied]
    if missing:
        raise KeyError(f"{src.path}: the teacher's safetensors lack {', '.join(missing)} (needed for its LM head)")
    model.tie_weights()
    return model.eval().requires_grad_(False).to(resolve(device))


def has_safetensors(record: Mapping[str, Any]) -> bool:
    """Whether a teacher record points to a local folder with safetensors weights and a config
    (built-in, tiny, converted GGUF and most local HF folders; not a Hub id or a ``.bin`` folder)."""
    p = Path(str(record["path"]))
    return not record.get("gguf_file") and p.is_dir() and (p / "config.json").is_file() and any(p.glob("*.safetensors"))


def layer_source(record: Mapping[str, Any], device: str = "cpu"):
    """A :class:`LazyLayers` for the teacher when its weights are local safetensors, else the
    whole teacher loaded (float32) — either one is what :func:`zgcore.models.adapters.build_block` takes."""
    if has_safetensors(record):
        return LazyLayers(record)
    from zgcore.models.teacher import load

    return load(dict(record), device)[0]


def load_base(record: Mapping[str, Any], n_layers: int, dtype: str = "float32", device: str = "cpu"):
    """The teacher's base model (no LM head) with only its first ``n_layers`` decoder layers, in
    ``dtype`` (``float32`` | ``bfloat16`` | ``float16``), eval mode, gradients off, SDPA attention.

    Only those layers' weights are loaded; the rest of the checkpoint is skipped. GGUF weights are
    de-quantised by transformers. Raises ``ValueError`` for an unknown dtype or a bad layer count.
    """
    from transformers import AutoConfig, AutoModel

    from zgcore.device import DTYPE_NAMES, resolve, torch_dtype

    if dtype not in DTYPE_NAMES:
        raise ValueError(f"teacher dtype must be one of {DTYPE_NAMES}, got {dtype!r}")
    kw = {"gguf_file": record["gguf_file"]} if record.get("gguf_file") else {}
    full = AutoConfig.from_pretrained(record["path"], **kw)
    ad = adapter_for(full)
    total = int(full.num_hidden_layers)  # GPT-2 maps it to n_layer
    if not 1 <= n_layers <= total:
        raise ValueError(f"n_layers must be in 1..{total}, got {n_layers}")
    cfg = ad.sub_config(full, range(n_layers), headless=False)
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the skipped layers and head are reported as unused weights
    try:
        model = AutoModel.from_pretrained(record["path"], config=cfg, dtype=torch_dtype(dtype),
                                          attn_implementation=attn_implementation(full), **kw)
    finally:
        hf_logging.set_verbosity(verbosity)
    model.eval().requires_grad_(False).to(resolve(device))
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    return model

